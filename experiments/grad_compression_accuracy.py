"""Accuracy of compressed gradient communication against float32 data parallelism, with an
interval.

The study's digits task (WideResNet-16-2 on the 8x8 digits, batch 128, 10 epochs), data parallel
over ``--devices`` host devices: ``dp`` (the float32 gradient all-reduced, BatchNorm statistics
over the whole batch) against ``dp`` with ``grad_compression`` ``"int8"``, ``"powersgd"`` (rank
4) and ``"topk"`` (1%) (each device's gradient, reduced compressed with error feedback;
BatchNorm statistics per device). Stratified ``--folds``-fold cross-validation x ``--seeds``,
each (seed, fold) pairing a variant with the float32 ``dp`` run on the same split; interval: the
corrected resampled t-test's over the paired differences (as ``envelope_accuracy.py``). The goal
(within 0.5 points of uncompressed) is the mean paired delta >= -0.5 points.

    python experiments/grad_compression_accuracy.py [--seeds 0,1,2] [--folds 5] [--devices 4]

Runs are kept one file each in ``results/grad_compression/runs`` (a cut-short invocation
resumes); ``results/grad_compression/accuracy.{json,md,png}`` are rewritten from them.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))  # fmt: skip

from experiments import study  # noqa: E402
from lowmem_jax.compose.plan import Plan  # noqa: E402

OUT = os.path.join(study.RESULTS, "grad_compression")
GOAL = -0.5  # points of test accuracy


def variants(devices: int) -> list[study.Variant]:
    """The uncompressed data-parallel step (``baseline``: what each is paired with), int8,
    PowerSGD and top-k."""
    dp = Plan(shard="dp", devices=devices)
    return [
        study.Variant("baseline", "baseline", f"dp over {devices} devices, float32 gradients", dp),
        study.Variant(
            "int8",
            "gradient compression",
            f"dp over {devices} devices, int8 gradients with error feedback",
            Plan(shard="dp", devices=devices, grad_compression="int8"),
        ),
        study.Variant(
            "powersgd",
            "gradient compression",
            f"dp over {devices} devices, PowerSGD rank 4 with error feedback",
            Plan(shard="dp", devices=devices, grad_compression="powersgd"),
        ),
        study.Variant(
            "topk",
            "gradient compression",
            f"dp over {devices} devices, top-k 1% with error feedback",
            Plan(shard="dp", devices=devices, grad_compression="topk"),
        ),
    ]


def to_markdown(result: dict) -> str:
    lines = [
        "# Compressed gradient communication: accuracy against float32 data parallelism",
        "",
        f"`{result['command']}` ({result['backend']}, {result['machine']}, JAX "
        f"{result['jax_version']}; the protocol: the script's docstring). Test accuracy in "
        "points; paired delta: the variant minus float32 `dp` on the same (seed, fold), mean [95% "
        f"interval]. Goal: mean >= {GOAL:+g} points.",
        "",
        "| config | runs | pooled accuracy per seed | paired delta, mean [95% interval] | "
        "min..max | skipped steps | train s (mean) |",
        "|---|---:|---|---|---|---:|---:|",
    ]
    for r in result["rows"]:
        per_seed = ", ".join(f"{100 * v:.2f}" for v in r["pooled_by_seed"].values())
        d = r["delta_vs_baseline"]
        delta = span = "-"
        if d is not None:
            low, high = d["ci95"]
            delta = f"{100 * d['mean']:+.2f} [{100 * low:+.2f}, {100 * high:+.2f}]"
            span = f"{100 * d['min']:+.2f}..{100 * d['max']:+.2f}"
        lines.append(
            f"| {r['setting']} | {r['runs']} | {per_seed} | {delta} | {span} | "
            f"{r['skipped_steps']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["delta_vs_baseline"] is not None]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.4))
    for i, r in enumerate(rows):
        d = r["delta_vs_baseline"]
        ax.plot([100 * x for x in d["ci95"]], [i, i], color="k", lw=2)
        ax.plot(100 * d["mean"], i, "o", color="C0")
    ax.axvline(0, color="k", lw=0.8)
    ax.axvline(GOAL, color="C3", lw=0.8, ls="--", label=f"{GOAL:+g} (goal)")
    ax.set_yticks(range(len(rows)), [r["setting"] for r in rows], fontsize=8)
    ax.set_xlabel("digits test accuracy minus float32 dp, points (mean, 95% interval)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    parser.add_argument("--folds", type=int, default=5, help="default 5")
    parser.add_argument("--devices", type=int, default=4, help="host devices (default 4)")
    parser.add_argument("--out-dir", default=OUT)
    args = parser.parse_args(argv)
    if args.devices < 2 or 128 % args.devices or args.folds < 2:
        parser.error(f"--devices must divide the batch of 128 and be >= 2 (got {args.devices}); "
                     f"--folds >= 2 (got {args.folds})")  # fmt: skip
    from lowmem_jax.core import mesh as sharding

    sharding.set_cpu_devices(args.devices)  # before JAX starts its backends
    import result_writer

    seeds = [int(s) for s in args.seeds.split(",") if s]
    records = study.run_variants(
        "digits", variants(args.devices), seeds, args.out_dir, folds=args.folds
    )
    result = {**result_writer.metadata(__file__, argv), "rows": study.summarize_cv(records)}
    result_writer.write(os.path.join(args.out_dir, "accuracy"), result, to_markdown, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
