"""The ``lowmem`` command line.

``lowmem analyze``: compile-only memory analysis of one configuration (``--json`` for machines).
``lowmem report``: the standard grid of configurations, as a table, JSON, markdown and plots.
``lowmem train``: train a WideResNet on the digits dataset that ships with scikit-learn, with any
combination of the techniques (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import sys

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax import precision as precision_lib
from lowmem_jax.workloads import MODEL_PATTERN as MODELS


def _add_workload_flags(
    parser: argparse.ArgumentParser, *, model: str, batch_size: int | None, models: str
) -> None:
    parser.add_argument("--model", default=model, help=f"{models}. Default: %(default)s")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help="examples (sentences for dynamicconv-iwslt) per batch. Default: "
        + ("%(default)s" if batch_size else "128 for wrn-D-K, 100 for dynamicconv-iwslt"),
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=40,
        help="tokens per sentence for dynamicconv-iwslt (100 x 40 = the recipe's 4,000 tokens). "
        "Default: %(default)s",
    )


def _add_plan_flags(parser: argparse.ArgumentParser, defaults: dict) -> None:
    group = parser.add_argument_group("techniques (composed into one jitted train step)")
    group.add_argument(
        "--precision",
        default=defaults["precision"],
        choices=sorted(precision_lib.POLICIES),
        help="dtype policy: fp32; bf16/fp16 (params and compute half); mixed_bf16/mixed_fp16 "
        "(fp32 master weights, half compute). Default: %(default)s",
    )
    group.add_argument(
        "--loss-scale",
        default="auto",
        choices=["auto", *loss_scale_lib.LOSS_SCALES],
        help="loss scaling; auto = dynamic when computing in float16, else none. Non-finite "
        "gradients skip the whole update. Default: %(default)s",
    )
    group.add_argument(
        "--microbatches",
        type=int,
        default=defaults["microbatches"],
        help="split each batch into K microbatches and accumulate gradients with lax.scan "
        "(BatchNorm uses per-microbatch statistics). Default: %(default)s",
    )
    group.add_argument(
        "--remat",
        default=defaults["remat"],
        help="rematerialization policy per residual block: none, full (save block inputs), dots "
        "(save conv/matmul outputs), save:NAME[,NAME] (save tagged activations, e.g. "
        "save:conv_out), every:K (checkpoint segments of K blocks), sqrt. Default: %(default)s",
    )


def _add_sparsity_flags(parser: argparse.ArgumentParser) -> None:
    from lowmem_jax.sparsity import ALGORITHMS, DISTRIBUTIONS, INITS

    group = parser.add_argument_group("sparsity (lowmem_jax.sparsity)")
    group.add_argument(
        "--sparsity",
        type=float,
        default=0.0,
        help="fraction of zeros in the sparse weights (conv and dense kernels except the "
        "classifier; for translation the Linear kernels except DynamicConv's weight_linear, "
        "embeddings dense), e.g. 0.9; 0 = dense. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-algorithm", default="dsr", choices=ALGORITHMS, help="Default: %(default)s"
    )
    group.add_argument(
        "--sparse-distribution",
        default="uniform",
        choices=DISTRIBUTIONS,
        help="per-layer densities. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-init", default="random", choices=INITS, help="initial mask. Default: %(default)s"
    )
    group.add_argument(
        "--sparse-storage",
        default="compressed",
        choices=["compressed", "masked"],
        help="compressed: non-zero values + int32 indices, dense weights only transient inside "
        "the step; masked: dense weights + a mask (more memory than dense). Default: %(default)s",
    )
    group.add_argument(
        "--sparse-period",
        type=int,
        default=100,
        help="optimizer steps between mask updates. Default: %(default)s",
    )


def _sparse_config(args: argparse.Namespace):
    """The SparseConfig the flags ask for, or None for dense training."""
    if not 0.0 <= args.sparsity < 1.0:
        raise ValueError(f"--sparsity must be in [0, 1) (fraction of zeros), got {args.sparsity}")
    if args.sparsity == 0.0:
        return None
    from lowmem_jax.sparsity import SparseConfig

    return SparseConfig(
        algorithm=args.sparse_algorithm,
        density=1.0 - args.sparsity,
        distribution=args.sparse_distribution,
        init=args.sparse_init,
        update_period=args.sparse_period,
        compressed=args.sparse_storage == "compressed",
    )


def _plan(args: argparse.Namespace):
    from lowmem_jax.train import Plan

    return Plan(
        precision=args.precision,
        loss_scale=args.loss_scale,
        microbatches=args.microbatches,
        remat=args.remat,
    )


TRANSLATION_DATASETS = ("synthetic-copy", "synthetic-reverse", "iwslt14", "ted_multi")
TRANSLATION_MODELS = {"dynamicconv-small": "small", "dynamicconv-iwslt": "iwslt"}


def _run_fields(args: argparse.Namespace) -> dict:
    """The config fields both training loops take from the same flags."""
    return {
        "plan": _plan(args),
        "sparse": _sparse_config(args),
        "seed": args.seed,
        "data_dir": args.data_dir,
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every,
        "keep_checkpoints": args.keep_checkpoints,
        "resume": args.resume,
        "tensorboard": not args.no_tensorboard,
    }


def _image_config(args: argparse.Namespace):
    from lowmem_jax.run import TrainConfig

    return TrainConfig(
        model=args.model or "wrn-16-2",
        dataset=args.dataset,
        batch_size=args.batch_size,
        epochs=args.epochs,
        learning_rate=0.1 if args.lr is None else args.lr,
        lr_schedule=args.lr_schedule,
        weight_decay=5e-4 if args.weight_decay is None else args.weight_decay,
        **_run_fields(args),
        progress=not args.no_progress,
    )


def _translation_config(args: argparse.Namespace):
    from lowmem_jax.run_translation import TranslationConfig

    model = args.model or "dynamicconv-small"
    if model not in TRANSLATION_MODELS:
        raise ValueError(
            f"Unknown model={model!r} for dataset={args.dataset!r}; allowed values: "
            f"{list(TRANSLATION_MODELS)}"
        )
    return TranslationConfig(
        model=TRANSLATION_MODELS[model],
        dataset=args.dataset,
        max_tokens=args.max_tokens,
        steps=args.steps,
        learning_rate=2e-3 if args.lr is None else args.lr,
        warmup=args.warmup,
        weight_decay=1e-4 if args.weight_decay is None else args.weight_decay,
        label_smoothing=args.label_smoothing,
        **_run_fields(args),
        average_last=args.average_last,
        eval_every=args.eval_every,
        beam_size=args.beam_size,
    )


def _cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    translation = args.dataset in TRANSLATION_DATASETS
    try:
        config = _translation_config(args) if translation else _image_config(args)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    if not args.json:
        print(f"training {config.model} on {config.dataset}: {config.plan.to_dict()}")
    if translation:
        from lowmem_jax.run_translation import train_and_evaluate_translation as train
    else:
        from lowmem_jax.run import train_and_evaluate as train
    summary = train(config, log=log)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    elif translation:
        print(
            f"token accuracy {summary['token_accuracy']:.4f}, BLEU greedy "
            f"{summary['bleu_greedy']:.1f} / beam-{config.beam_size} {summary['bleu_beam']:.1f} "
            f"after {summary['steps']} steps ({summary['train_seconds']:.0f}s)"
            + (f", density {summary['sparsity']['density']:.4f}" if summary.get("sparsity") else "")
        )
    else:
        print(
            f"test accuracy {summary['test_accuracy']:.4f} after {config.epochs} epochs "
            f"({summary['train_seconds']:.0f}s, {summary['skipped_steps']} skipped steps, "
            f"{summary['param_count']:,} parameters, backend {summary['backend']})"
        )
    return 0


def _cmd_analyze(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lowmem_jax.workloads import analyze_model

    try:
        plan = _plan(args)
        report = analyze_model(
            args.model, args.batch_size, plan, sparse=_sparse_config(args), seq_len=args.seq_len
        )
    except ValueError as err:
        parser.error(str(err))
    result = {"model": args.model, "batch_size": report.config["batch_size"], **report.to_dict()}
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    mib = 2.0**20
    x, a = result["xla"], result["analytic"]
    print(
        f"{args.model}, batch {result['batch_size']}, {result['param_count']:,} parameters, "
        f"backend {result['backend']}; plan {result['config']}"
    )
    print(
        f"  {x['source']:>9}: argument {x['argument_bytes'] / mib:9.2f} MiB  "
        f"output {x['output_bytes'] / mib:9.2f}  alias {x['alias_bytes'] / mib:9.2f}  "
        f"temp {x['temp_bytes'] / mib:9.2f}  total {x['total_bytes'] / mib:9.2f}"
    )
    print(
        f"   analytic: model {a['model_bytes'] / mib:9.2f} MiB  optimizer "
        f"{a['optimizer_bytes'] / mib:9.2f}  activations {a['activation_bytes'] / mib:9.2f}  "
        f"inputs {a['input_bytes'] / mib:7.2f}  total {a['total_bytes'] / mib:9.2f}"
    )
    print(
        f"      FLOPs: {result['flops']:.4g} per step (jaxpr; XLA cost analysis: "
        f"{result['flops_xla'] or 0:.4g}, loop bodies counted once)"
    )
    return 0


def _cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lowmem_jax.report import run_report, to_markdown, write_report
    from lowmem_jax.workloads import make_workload

    try:
        work = make_workload(args.model, args.batch_size, seq_len=args.seq_len)
    except ValueError as err:
        parser.error(str(err))
    batch_size = next(iter(work.batch.values())).shape[0]
    print(f"lowmem report: {args.model}, batch {batch_size} (compile-only, no step runs)")
    result = run_report(args.model, batch_size, seq_len=args.seq_len)
    command = "lowmem report " + " ".join(
        [f"--model {args.model}", f"--batch-size {batch_size}", f"--out-dir {args.out_dir}"]
        + ([f"--seq-len {args.seq_len}"] if args.model == "dynamicconv-iwslt" else [])
    )
    paths = write_report(result, args.out_dir, command=command)
    print(to_markdown(result))
    print("wrote " + ", ".join(paths))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowmem", description="How much memory does training take, and how to make it fit."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    analyze = sub.add_parser(
        "analyze",
        help="compile-only memory analysis of one configuration",
        description="Lower and compile one train step for abstract inputs (nothing runs, no "
        "data) and report XLA's memory figures next to the analytic model / optimizer / "
        "activation breakdown.",
    )
    _add_workload_flags(analyze, model="wrn-28-2", batch_size=None, models=MODELS)
    _add_plan_flags(analyze, {"precision": "fp32", "microbatches": 1, "remat": "none"})
    _add_sparsity_flags(analyze)
    analyze.add_argument("--json", action="store_true", help="print exactly one JSON object")
    analyze.set_defaults(func=_cmd_analyze)

    report = sub.add_parser(
        "report",
        help="the standard grid: baseline, each technique, combinations (tables and plots)",
        description="Memory analysis of the baseline, each technique alone at several settings "
        "and combinations; prints a table and writes report.json, report.md, breakdown.png and "
        "tradeoff.png.",
    )
    _add_workload_flags(report, model="wrn-28-2", batch_size=None, models=MODELS)
    report.add_argument("--out-dir", default="lowmem_report", help="Default: %(default)s")
    report.set_defaults(func=_cmd_report)

    train = sub.add_parser(
        "train",
        help="train a model with a combination of low-memory techniques",
        description="Train a WideResNet on the scikit-learn digits dataset (1,797 8x8 images "
        "upsampled to 32x32; ships with scikit-learn, nothing is downloaded) or on CIFAR-10 "
        "prepared once with tensorflow-datasets (see the README). WRN recipe on CIFAR-10: "
        "--dataset cifar10 --model wrn-28-2 --epochs 200 --lr-schedule step --precision fp32 "
        "--microbatches 1 --remat none.",
    )
    train.add_argument(
        "--model",
        default=None,
        help="wrn-D-K for image datasets (default wrn-16-2); dynamicconv-small or "
        "dynamicconv-iwslt for translation datasets (default dynamicconv-small)",
    )
    train.add_argument(
        "--batch-size", type=int, default=128, help="images per batch. Default: %(default)s"
    )
    train.add_argument(
        "--dataset",
        default="digits",
        choices=["digits", "cifar10", *TRANSLATION_DATASETS],
        help="Default: digits",
    )
    train.add_argument(
        "--data-dir", metavar="DIR", help="TFDS data directory (cifar10); nothing is downloaded"
    )
    _add_plan_flags(train, {"precision": "mixed_fp16", "microbatches": 4, "remat": "full"})
    _add_sparsity_flags(train)
    train.add_argument("--epochs", type=int, default=10, help="Default: %(default)s")
    train.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate. Default: 0.1 (SGD Nesterov) for images, 2e-3 (Adam, "
        "inverse-sqrt) for translation",
    )
    train.add_argument(
        "--lr-schedule",
        default="cosine",
        choices=["cosine", "step"],
        help="cosine decay to 0, or step: x0.2 at 30/60/80%% of training. Default: %(default)s",
    )
    train.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="Default: 5e-4 for images (kernels only), 1e-4 for translation (decoupled)",
    )
    text = train.add_argument_group("translation datasets (DynamicConv Transformer)")
    text.add_argument("--steps", type=int, default=200, help="optimizer updates. Default: 200")
    text.add_argument(
        "--max-tokens", type=int, default=1024, help="padded tokens per batch. Default: 1024"
    )
    text.add_argument("--warmup", type=int, default=50, help="inverse-sqrt warmup. Default: 50")
    text.add_argument("--label-smoothing", type=float, default=0.1, help="Default: 0.1")
    text.add_argument("--beam-size", type=int, default=4, help="Default: 4")
    text.add_argument(
        "--average-last", type=int, default=1, help="average the newest N checkpoints. Default: 1"
    )
    text.add_argument("--eval-every", type=int, default=1000, help="Default: 1000")
    train.add_argument("--seed", type=int, default=0, help="Default: %(default)s")
    train.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save Orbax checkpoints here (atomic); per-epoch (per-eval for translation) "
        "metrics go to DIR/metrics.jsonl and TensorBoard event files in DIR",
    )
    train.add_argument(
        "--no-tensorboard",
        action="store_true",
        help="write metrics.jsonl only, no TensorBoard event files",
    )
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="steps between saves. Default: %(default)s",
    )
    train.add_argument(
        "--keep-checkpoints", type=int, default=3, help="checkpoints kept. Default: %(default)s"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue exactly from the newest checkpoint in --checkpoint-dir",
    )
    train.add_argument("--output", metavar="PATH", help="write the summary JSON here")
    train.add_argument(
        "--json",
        action="store_true",
        help="print only the summary JSON on stdout (progress goes to stderr)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=_cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
