"""The ``lowmem`` command line.

``lowmem train``: train a WideResNet on the digits dataset that ships with scikit-learn, with any
combination of the techniques (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import sys

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax import precision as precision_lib


def _add_plan_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("techniques (composed into one jitted train step)")
    group.add_argument(
        "--precision",
        default="mixed_fp16",
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
        default=4,
        help="split each batch into K microbatches and accumulate gradients with lax.scan "
        "(BatchNorm uses per-microbatch statistics). Default: %(default)s",
    )
    group.add_argument(
        "--remat",
        default="full",
        help="rematerialization policy per residual block: none, full (save block inputs), dots "
        "(save conv/matmul outputs), save:NAME[,NAME] (save tagged activations, e.g. "
        "save:conv_out), every:K (checkpoint segments of K blocks), sqrt. Default: %(default)s",
    )


def _plan(args: argparse.Namespace):
    from lowmem_jax.train import Plan

    return Plan(
        precision=args.precision,
        loss_scale=args.loss_scale,
        microbatches=args.microbatches,
        remat=args.remat,
    )


def _cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lowmem_jax.run import TrainConfig, train_and_evaluate

    try:
        config = TrainConfig(
            model=args.model,
            dataset=args.dataset,
            plan=_plan(args),
            batch_size=args.batch_size,
            epochs=args.epochs,
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            seed=args.seed,
            progress=not args.no_progress,
        )
    except ValueError as err:
        parser.error(str(err))  # exits with status 2 and the usage line
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    if not args.json:
        print(f"training {config.model} on {config.dataset}: {config.plan.to_dict()}")
    summary = train_and_evaluate(config, log=log)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"test accuracy {summary['test_accuracy']:.4f} after {config.epochs} epochs "
            f"({summary['train_seconds']:.0f}s, {summary['skipped_steps']} skipped steps, "
            f"{summary['param_count']:,} parameters, backend {summary['backend']})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowmem", description="How much memory does training take, and how to make it fit."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model with a combination of low-memory techniques",
        description="Train a WideResNet on the scikit-learn digits dataset (1,797 8x8 images "
        "upsampled to 32x32; ships with scikit-learn, nothing is downloaded).",
    )
    train.add_argument("--model", default="wrn-16-2", help="wrn-D-K. Default: %(default)s")
    train.add_argument("--dataset", default="digits", choices=["digits"], help="Default: digits")
    _add_plan_flags(train)
    train.add_argument("--batch-size", type=int, default=128, help="Default: %(default)s")
    train.add_argument("--epochs", type=int, default=10, help="Default: %(default)s")
    train.add_argument(
        "--lr",
        type=float,
        default=0.1,
        help="peak learning rate (SGD Nesterov, cosine decay). Default: %(default)s",
    )
    train.add_argument("--weight-decay", type=float, default=5e-4, help="Default: %(default)s")
    train.add_argument("--seed", type=int, default=0, help="Default: %(default)s")
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
