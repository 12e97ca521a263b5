"""``lowmem train``'s flags and command: flags -> a :class:`~lowmem_jax.training.loop.TrainConfig`
-> :func:`~lowmem_jax.training.loop.train_and_evaluate` (the other commands:
:mod:`lowmem_jax.cli.dispatch`)."""

from __future__ import annotations

import argparse
import json
import sys

from lowmem_jax.compose.flags import (
    add_plan_flags,
    given_technique_flags,
    plan_from_args,
)
from lowmem_jax.core import paths
from lowmem_jax.workloads.recipes import SCHEDULES

__all__ = ["add_train_flags", "cmd_train"]


# The train flags that set TrainConfig fields of the same name (None: the config's default).
_TRAIN_FIELDS = (
    "dataset", "model", "epochs", "steps", "batch_size", "max_tokens", "warmup", "weight_decay",
    "label_smoothing", "seed", "data_dir", "image_size", "fold", "folds", "eval_every", "beam_size",
    "average_last", "checkpoint_dir", "checkpoint_every", "keep_checkpoints",
    "max_consecutive_skips", "decompose_from", "seq_len", "eval_windows",
)  # fmt: skip


def _train_config(args: argparse.Namespace):
    from lowmem_jax.core.units import parse_bytes
    from lowmem_jax.training.loop import DEFAULT_PLAN, TrainConfig

    fields = {k: getattr(args, k) for k in _TRAIN_FIELDS if getattr(args, k) is not None}
    plan, budget, devices = DEFAULT_PLAN, None, 1
    if args.memory_budget is None:
        plan = plan_from_args(args, DEFAULT_PLAN)
    else:
        budget = parse_bytes(args.memory_budget)
        # --devices N: the devices to plan over (a budget per device), not a technique
        given = [flag for flag in given_technique_flags(args) if flag != "--devices"]
        if given:
            raise ValueError(
                f"--memory-budget chooses the techniques; it takes no {', '.join(given)}"
            )
        devices = args.devices or 1  # host devices on CPU: asked for by lowmem_jax.cli.dispatch
    return TrainConfig(
        **fields,
        plan=plan,
        memory_budget=budget,
        memory_envelope=args.envelope,
        memory_devices=devices,
        learning_rate=args.lr,
        lr_schedule=args.lr_schedule,
        resume=args.resume,
        overwrite=args.overwrite,
        tensorboard=not args.no_tensorboard,
        progress=not args.no_progress,
    )


def cmd_train(args: argparse.Namespace) -> int:
    from lowmem_jax.training.loop import train_and_evaluate

    config = _train_config(args)
    if args.output:
        paths.check_writable_file(args.output, "--output")
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    if not args.json:
        plan = "planned for --memory-budget" if config.memory_budget else config.plan.to_dict()
        print(f"training {config.model_name} on {config.dataset}: {plan}")
    summary = train_and_evaluate(config, log=log)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
        return 0
    if "bleu_beam" in summary:
        result = (
            f"token accuracy {summary['token_accuracy']:.4f}, BLEU greedy "
            f"{summary['bleu_greedy']:.1f} / beam-{summary['beam_size']} {summary['bleu_beam']:.1f}"
        )
    elif "token_accuracy" in summary:
        result = f"token accuracy {summary['token_accuracy']:.4f}"
    elif "test_bits_per_byte" in summary:
        result = (
            f"held-out loss {summary['test_loss']:.4f} nats/byte "
            f"({summary['test_bits_per_byte']:.3f} bits/byte), next-byte accuracy "
            f"{summary['test_accuracy']:.4f}"
        )
    else:
        result = f"test accuracy {summary['test_accuracy']:.4f}"
    # what the optimizer's techniques describe of themselves (sparse training: its density)
    headlines = [v["headline"] for v in summary.values() if isinstance(v, dict) and "headline" in v]
    print(
        f"{result} after {summary['steps']} steps ({summary['train_seconds']:.0f}s, "
        f"{summary['skipped_steps']} skipped steps, {summary['param_count']:,} parameters, "
        f"backend {summary['backend']})" + "".join(f", {h}" for h in headlines)
    )
    return 0


def add_train_flags(train: argparse.ArgumentParser) -> None:
    from lowmem_jax.training.loop import DEFAULT_PLAN
    from lowmem_jax.training.tasks import DATASETS

    train.add_argument(
        "--dataset", choices=list(DATASETS), help="Default: digits (embedded, nothing to prepare)"
    )
    train.add_argument(
        "--model",
        help="wrn-D-K for image datasets (default wrn-16-2); dynamicconv-small or "
        "dynamicconv-iwslt for translation datasets (default dynamicconv-small); llama-SIZE for "
        "python-source (default llama-18m)",
    )
    train.add_argument(
        "--data-dir",
        metavar="DIR",
        help="TFDS data directory (cifar10, iwslt14, ted_multi), the folder of Fashion-MNIST's "
        "IDX files (default: /usr/share/datasets/fashion-mnist, Debian's dataset-fashion-mnist), "
        "or a folder of .py files for python-source (default: this Python's standard library); "
        "nothing is downloaded",
    )
    add_plan_flags(train, DEFAULT_PLAN)
    run = train.add_argument_group("the run (defaults: the dataset's and the model's recipe)")
    run.add_argument("--epochs", type=int, help="Default: 10 for image datasets")
    run.add_argument("--steps", type=int, help="optimizer updates. Default: 200 for translation")
    run.add_argument(
        "--batch-size", type=int, help="images per batch (image datasets; translation batches "
        "by --max-tokens). Default: 128",
    )  # fmt: skip
    run.add_argument("--image-size", type=int, help="digits: 8, 16 or 32 pixels. Default: 32")
    run.add_argument(
        "--fold", type=int, help="digits: test on this fold (0-based) of --folds stratified "
        "folds shuffled by --seed (cross-validation) instead of the 80/20 split",
    )  # fmt: skip
    run.add_argument("--folds", type=int, help="digits: folds for --fold. Default: 5")
    run.add_argument(
        "--lr", type=float, help="peak learning rate. Default: the recipe's (0.1 SGD Nesterov for "
        "wrn-D-K; Adam 2e-3 for dynamicconv-small, 5e-4 for dynamicconv-iwslt)",
    )  # fmt: skip
    run.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        help="step: x0.2 at 30/60/80%% of training. Default: cosine for wrn-D-K, inverse_sqrt "
        "for dynamicconv-*",
    )
    run.add_argument(
        "--warmup", type=int, help="inverse_sqrt warmup. Default: 50 small, 4000 iwslt"
    )
    run.add_argument(
        "--weight-decay",
        type=float,
        help="Default: 5e-4 for wrn-D-K (kernels only), 1e-4 for dynamicconv-* (decoupled)",
    )
    run.add_argument("--seed", type=int, help="Default: 0")
    run.add_argument(
        "--eval-every", type=int, help="steps between records. Default: an epoch; 1000 translation"
    )
    text = train.add_argument_group("translation datasets (DynamicConv Transformer)")
    text.add_argument(
        "--max-tokens", type=int, help="padded tokens per batch (python-source: tokens per "
        "batch, --max-tokens / --seq-len sequences). Default: 1024",
    )  # fmt: skip
    text.add_argument("--label-smoothing", type=float, help="Default: 0.1")
    text.add_argument("--beam-size", type=int, help="Default: 4")
    text.add_argument(
        "--average-last", type=int, help="average the newest N checkpoints. Default: 1"
    )
    lm_group = train.add_argument_group("python-source (LLaMA-style decoder on bytes)")
    lm_group.add_argument("--seq-len", type=int, help="bytes per sequence. Default: 128")
    lm_group.add_argument(
        "--eval-windows", type=int, help="held-out windows per evaluation. Default: 256"
    )
    ckpt = train.add_argument_group("checkpoints and output")
    ckpt.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save Orbax checkpoints here (atomic); the records go to DIR/metrics.jsonl and "
        "TensorBoard event files in DIR",
    )
    ckpt.add_argument("--checkpoint-every", type=int, help="steps between saves. Default: 100")
    ckpt.add_argument(
        "--keep-checkpoints", type=int, help="checkpoints kept. Default: max(3, --average-last)"
    )
    ckpt.add_argument(
        "--resume",
        action="store_true",
        help="continue exactly from the newest checkpoint in --checkpoint-dir",
    )
    ckpt.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a --checkpoint-dir that holds one: the old run is moved aside "
        "whole to DIR.previous (a new run there is refused without it)",
    )
    ckpt.add_argument(
        "--no-tensorboard",
        action="store_true",
        help="write metrics.jsonl only, no TensorBoard event files",
    )
    ckpt.add_argument(
        "--max-consecutive-skips",
        type=int,
        help="stop (exit status 1) after this many skipped steps in a row (non-finite "
        "gradients or updates), naming the likely cause; 0: never. Default: 100",
    )
    ckpt.add_argument(
        "--decompose-from",
        metavar="DIR",
        help="start from the newest checkpoint in DIR of the same model trained dense: its "
        "layers are decomposed into the --factorize ones (BatchNorm statistics kept), then "
        "fine-tuned",
    )
    budget = train.add_argument_group("memory budget (lowmem_jax.planning.planner)")
    budget.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="choose the techniques: the plan with the fewest FLOPs whose compiled step fits SIZE "
        "(e.g. 48MiB; what lowmem plan answers), instead of technique flags; with --devices N, "
        "per device over N devices (ZeRO's and pipeline stages searched too)",
    )
    budget.add_argument(
        "--envelope",
        default="report",
        choices=("report", "any"),
        help="the settings --memory-budget may use (see lowmem plan). Default: %(default)s",
    )
    ckpt.add_argument("--output", metavar="PATH", help="write the summary JSON here")
    ckpt.add_argument(
        "--json",
        action="store_true",
        help="print only the summary JSON on stdout (progress goes to stderr)",
    )
    ckpt.add_argument("--no-progress", action="store_true", help="no progress bar")
