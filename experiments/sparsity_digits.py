"""Dynamic sparse training on the digits dataset: WRN-16-2, dense vs DSR vs RigL at 50/70/90%.

One config per run (dataclasses, like the Flax examples). Every run uses the defaults of
``lowmem train`` (WRN-16-2, digits, mixed_fp16 + dynamic loss scale + 4 microbatches + remat
full, 10 epochs, batch 128, SGD Nesterov 0.9, lr 0.1 cosine, weight decay 5e-4); the sparse runs
add compressed storage, a mask update every ``--update-period`` steps (20 by default) until 75%
of training, DSR with a uniform distribution and RigL with ERK.

For each config the script also records the stored bytes (parameters + optimizer state as
stored, the transient gradient excluded) from :func:`lowmem_jax.analyze_model` at the same
settings (compile-only) and its ratio to dense. ``analyze_model`` builds the CIFAR-shaped
workload (32x32x3 inputs, digits is 32x32x1): only the first convolution's 3x3x3x16 kernel
differs from the digits model (432 vs 144 weights), < 0.1% of the parameters.

Each finished run is written to ``<out>/runs/<name>_seed<seed>.json`` at once and the summary
``results.{json,md,png}`` is rewritten after every run, so an interrupted invocation resumes by
rerunning the same command: finished runs are read back, not retrained.

Usage:
    python experiments/sparsity_digits.py                      # 7 configs, seed 0
    python experiments/sparsity_digits.py --seeds 0,1,2
    python experiments/sparsity_digits.py --only dense,rigl_90 --skip-analysis
    python experiments/sparsity_digits.py --summarize          # rewrite the summary only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax

from lowmem_jax.run import TrainConfig, train_and_evaluate
from lowmem_jax.sparsity import SparseConfig
from lowmem_jax.workloads import analyze_model

SPARSITIES = (0.5, 0.7, 0.9)
ALGORITHMS = {"dsr": "uniform", "rigl": "erk"}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run: a name, the training config, and what the tables show about it."""

    name: str
    algorithm: str  # "dense", "dsr" or "rigl"
    sparsity: float
    train: TrainConfig


def make_configs(update_period: int, seed: int) -> list[RunConfig]:
    base = TrainConfig(seed=seed, progress=False)
    out = [RunConfig("dense", "dense", 0.0, base)]
    # The most informative runs first (90%), so a cut-short invocation still has both algorithms.
    for s in sorted(SPARSITIES, reverse=True):
        for algorithm, distribution in ALGORITHMS.items():
            sparse = SparseConfig(
                algorithm=algorithm,
                density=round(1.0 - s, 6),
                distribution=distribution,
                update_period=update_period,
                compressed=True,
                seed=seed,
            )
            out.append(
                RunConfig(
                    f"{algorithm}_{round(100 * s)}",
                    algorithm,
                    s,
                    dataclasses.replace(base, sparse=sparse),
                )
            )
    return out


def stored_bytes(config: RunConfig) -> dict:
    """Parameters + optimizer state as stored (compile-only ``analyze_model``)."""
    t = config.train
    report = analyze_model(t.model, t.batch_size, t.plan, sparse=t.sparse)
    analytic = report.analytic
    slots = {k: v for k, v in analytic["optimizer_breakdown"].items() if k.startswith("slot:")}
    return {
        "model_bytes": analytic["model_bytes"],
        "optimizer_slot_bytes": sum(slots.values()),
        "optimizer_slots": slots,
        "stored_bytes": analytic["model_bytes"] + sum(slots.values()),
        "xla_argument_bytes": report.xla["argument_bytes"],
        "xla_total_bytes": report.xla["total_bytes"],
    }


def summarize(runs: dict, analysis: dict, out_dir: str, command: str) -> dict:
    """Groups runs by config, computes mean / spread, writes results.{json,md,png}."""
    groups: dict[str, list] = {}
    for r in runs.values():
        groups.setdefault(r["name"], []).append(r)
    dense_stored = analysis.get("dense", {}).get("stored_bytes")
    rows = []
    for name, rs in groups.items():
        accs = [r["test_accuracy"] for r in rs]
        a = analysis.get(name)
        row = {
            "name": name,
            "algorithm": rs[0]["algorithm"],
            "sparsity": rs[0]["sparsity_target"],
            "seeds": sorted(r["seed"] for r in rs),
            "test_accuracy_mean": statistics.mean(accs),
            "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else None,
            "test_accuracy_min": min(accs),
            "test_accuracy_max": max(accs),
            "measured_density": [
                None if r["sparsity"] is None else r["sparsity"]["density"] for r in rs
            ],
            "skipped_steps": [r["skipped_steps"] for r in rs],
            "train_seconds": [round(r["train_seconds"], 1) for r in rs],
            "stored_bytes": None if a is None else a["stored_bytes"],
            "stored_ratio_to_dense": None
            if a is None or not dense_stored
            else a["stored_bytes"] / dense_stored,
        }
        rows.append(row)
    order = {"dense": 0, "dsr": 1, "rigl": 2}
    rows.sort(key=lambda r: (order[r["algorithm"]], r["sparsity"]))
    summary = {
        "command": command,
        "backend": jax.default_backend(),
        "platform": platform.platform(),
        "jax_version": jax.__version__,
        "rows": rows,
        "analysis": analysis,
        "runs": list(runs.values()),
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    _write_md(summary, out_dir)
    _write_png(rows, out_dir)
    return summary


def _fmt_density(d) -> str:
    if isinstance(d, dict):
        d = d.get("overall", d.get("total"))
    return "-" if d is None or isinstance(d, dict) else f"{d:.3f}"


def _write_md(summary: dict, out_dir: str) -> None:
    lines = [
        "# Dynamic sparse training, WRN-16-2 on digits",
        "",
        f"Command: `{summary['command']}` (from the repository root, with the package "
        "installed, `pip install -e .`, or with `PYTHONPATH=.`). Rerunning it resumes: finished "
        "runs in `runs/` are read back, not retrained.",
        "",
        f"Backend: {summary['backend']} ({summary['platform']}), JAX {summary['jax_version']}.",
        "All runs: mixed_fp16 + dynamic loss scale + 4 microbatches + remat full, 10 epochs, "
        "batch 128, SGD Nesterov 0.9, lr 0.1 cosine, wd 5e-4; sparse runs use compressed "
        "storage, a mask update every 20 steps until 75% of training (110 steps in all: "
        "updates at steps 20, 40, 60, 80); DSR uniform, RigL ERK. Stored bytes: parameters + "
        "optimizer state as stored (values, int32 indices, momentum; the transient gradient "
        "excluded), analytic, from `analyze_model` at the same settings (compile-only).",
        "",
        "| config | sparsity | seeds | test acc (mean) | spread (min-max) | skipped steps "
        "| stored bytes | stored / dense | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        spread = (
            "-"
            if len(r["seeds"]) == 1
            else f"{r['test_accuracy_min']:.4f}-{r['test_accuracy_max']:.4f} "
            f"(std {r['test_accuracy_std']:.4f})"
        )
        stored = "-" if r["stored_bytes"] is None else f"{r['stored_bytes'] / 2**20:.3f} MiB"
        ratio = r["stored_ratio_to_dense"]
        ratio = "-" if ratio is None else f"{100 * ratio:.1f}%"
        lines.append(
            f"| {r['name']} | {r['sparsity']:.0%} | {','.join(map(str, r['seeds']))} "
            f"| {r['test_accuracy_mean']:.4f} | {spread} | {r['skipped_steps']} | {stored} "
            f"| {ratio} | {r['train_seconds']} |"
        )
    lines += [
        "",
        "The test set has 360 images: one image is 0.28 percentage points.",
        "",
        "Stored bytes of every config (analytic, `analyze_model`, compile-only; independent "
        "of training):",
        "",
        "| config | parameters | optimizer state | stored | stored / dense | XLA argument "
        "| XLA total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    analysis = summary["analysis"]
    dense = analysis.get("dense")
    for name in sorted(analysis, key=lambda n: (n != "dense", n)):
        a = analysis[name]
        ratio = "-" if dense is None else f"{100 * a['stored_bytes'] / dense['stored_bytes']:.1f}%"
        lines.append(
            f"| {name} | {a['model_bytes'] / 2**20:.3f} MiB "
            f"| {a['optimizer_slot_bytes'] / 2**20:.3f} MiB | {a['stored_bytes'] / 2**20:.3f} MiB "
            f"| {ratio} | {a['xla_argument_bytes'] / 2**20:.2f} MiB "
            f"| {a['xla_total_bytes'] / 2**20:.1f} MiB |"
        )
    lines += ["", "![accuracy vs sparsity](accuracy_vs_sparsity.png)", ""]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))


def _write_png(rows: list, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["algorithm"] == "dense":
            ax.axhline(100 * r["test_accuracy_mean"], color="k", ls="--", label="dense")
    for algorithm, marker in (("dsr", "o"), ("rigl", "s")):
        rs = [r for r in rows if r["algorithm"] == algorithm]
        if not rs:
            continue
        x = [100 * r["sparsity"] for r in rs]
        y = [100 * r["test_accuracy_mean"] for r in rs]
        lo = [100 * (r["test_accuracy_mean"] - r["test_accuracy_min"]) for r in rs]
        hi = [100 * (r["test_accuracy_max"] - r["test_accuracy_mean"]) for r in rs]
        ax.errorbar(x, y, yerr=[lo, hi], marker=marker, capsize=3, label=algorithm.upper())
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("WRN-16-2 on digits, 10 epochs (compressed storage)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_vs_sparsity.png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
    parser.add_argument("--update-period", type=int, default=20)
    parser.add_argument("--out-dir", default="experiments/results/sparsity_digits")
    parser.add_argument("--skip-analysis", action="store_true", help="no analyze_model")
    parser.add_argument("--skip-training", action="store_true", help="analysis only")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the summary")
    args = parser.parse_args(argv)
    # The command that reproduces every run and the summary (not the flags of this invocation).
    command = "python experiments/sparsity_digits.py"
    if args.seeds != "0":
        command += f" --seeds {args.seeds}"
    if args.update_period != 20:
        command += f" --update-period {args.update_period}"
    run_dir = os.path.join(args.out_dir, "runs")
    os.makedirs(run_dir, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    only = {s for s in args.only.split(",") if s}

    def load_all():
        runs, analysis = {}, {}
        for fn in sorted(os.listdir(run_dir)):
            with open(os.path.join(run_dir, fn)) as f:
                data = json.load(f)
            if fn.startswith("analysis_"):
                analysis[data["name"]] = data
            else:
                runs[fn] = data
        return runs, analysis

    if not args.summarize:
        for seed in seeds:
            for config in make_configs(args.update_period, seed):
                if only and config.name not in only:
                    continue
                path = os.path.join(run_dir, f"{config.name}_seed{seed}.json")
                if args.skip_training or os.path.exists(path):
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] training {config.name} seed {seed}")
                result = train_and_evaluate(config.train)
                result.update(
                    name=config.name,
                    algorithm=config.algorithm,
                    sparsity_target=config.sparsity,
                    update_period=args.update_period,
                )
                with open(path, "w") as f:
                    json.dump(result, f, indent=2, default=str)
                summarize(*load_all(), args.out_dir, command)
        if not args.skip_analysis:
            for config in make_configs(args.update_period, seeds[0]):
                if only and config.name not in only:
                    continue
                path = os.path.join(run_dir, f"analysis_{config.name}.json")
                if os.path.exists(path):
                    continue
                print(f"[{time.strftime('%H:%M:%S')}] analyze_model {config.name}")
                data = {"name": config.name, **stored_bytes(config)}
                with open(path, "w") as f:
                    json.dump(data, f, indent=2)
                summarize(*load_all(), args.out_dir, command)
    runs, analysis = load_all()
    if runs:
        summary = summarize(runs, analysis, args.out_dir, command)
        print(open(os.path.join(args.out_dir, "results.md")).read())
        del summary
    return 0


if __name__ == "__main__":
    sys.exit(main())
