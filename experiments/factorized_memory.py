"""Factorized layers at full size: memory and FLOPs of CP / Tucker-2 / low-rank, with
and without remat, next to the dense step and the plain one.

Compile-only (no step runs): for each model, the plain step (``lowmem analyze --plain``), our
fp32 step dense, and each method at each compression, with ``remat`` none and full. Figures:
parameters, XLA:CPU total bytes (argument + output + temp - alias), the analytic total, the
jaxpr FLOPs (remat recomputation counted). Writes
``experiments/results/factorized/<model>.json``, ``README.md`` (tables with each row's
``lowmem analyze`` command) and ``memory_flops.png``.

Usage: python experiments/factorized_memory.py [--models wrn-28-2 dynamicconv-iwslt]
       [--compressions 0.25] [--table-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "factorized")
MIB = 2.0**20
SIZES = {"wrn-28-2": (128, 40), "dynamicconv-iwslt": (100, 40)}
# The Transformer has no convolution to factorize (DynamicConv's kernels are predicted): its
# Linear layers are low-rank under every method, so one method covers it.
METHODS = {"wrn-28-2": ("tucker", "cp", "lowrank"), "dynamicconv-iwslt": ("lowrank",)}
REMATS = ("none", "full")


def configs(model: str, compressions: list[float]):
    """``(name, plan or None)`` rows: plain, dense x remat, method x compression x remat."""
    import lowmem_jax as lm

    rows = [("plain", None)]
    rows += [(f"dense, remat {r}", lm.Plan(remat=r)) for r in REMATS]
    for method in METHODS[model]:
        for c in compressions:
            factorize = lm.FactorConfig(method, c)
            rows += [
                (f"{method} {c:g}, remat {r}", lm.Plan(remat=r, factorize=factorize))
                for r in REMATS
            ]
    return rows


def measure(model: str, compressions: list[float]) -> dict:
    from lowmem_jax.workloads import analyze_model
    from lowmem_jax.workloads.flags import analyze_argv

    batch, seq_len = SIZES[model]
    rows = []
    for name, plan in configs(model, compressions):
        report = analyze_model(model, batch, plan, seq_len=seq_len).to_dict()
        argv = analyze_argv(model, batch, plan, seq_len)
        rows.append({
            "name": name,
            "command": "lowmem analyze " + " ".join(argv),
            "param_count": report["param_count"],
            "xla_total_bytes": report["xla"]["total_bytes"],
            "xla_source": report["xla"]["source"],
            "analytic_total_bytes": report["analytic"]["total_bytes"],
            "flops": report["flops"],
        })  # fmt: skip
        print(f"{model}: {name}: {report['xla']['total_bytes'] / MIB:.1f} MiB", flush=True)
    return {"model": model, "batch_size": batch, "seq_len": seq_len, "rows": rows}


def table(result: dict) -> list[str]:
    rows = result["rows"]
    plain = rows[0]
    dense = rows[1]
    lines = [
        "| config | parameters | XLA:CPU MiB | vs plain | analytic MiB | GFLOPs | FLOPs / dense "
        "| command |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['param_count']:,} | {r['xla_total_bytes'] / MIB:.1f} "
            f"| {plain['xla_total_bytes'] / r['xla_total_bytes']:.2f}x "
            f"| {r['analytic_total_bytes'] / MIB:.1f} | {r['flops'] / 1e9:.1f} "
            f"| {r['flops'] / dense['flops']:.2f} | `{r['command']}` |"
        )
    return lines


# The digits runs (WRN-16-2, the default plan; one seed each), by these commands:
DIGITS = (
    ("dense", "digits_dense.json", "lowmem train --checkpoint-dir /tmp/dense32"),
    (
        "Tucker-2 25%, from scratch",
        "digits_tucker_scratch.json",
        "lowmem train --factorize tucker --factor-compression 0.25",
    ),
    (
        "Tucker-2 25%, dense decomposed + fine-tuned",
        "digits_tucker_decomposed.json",
        "lowmem train --factorize tucker --decompose-from /tmp/dense32",
    ),
)


def digits_table() -> list[str]:
    lines = [
        "",
        "## Digits (WRN-16-2, 10 epochs, mixed_fp16 + 4 microbatches + remat full, seed 0)",
        "",
        "One run each (`--output` JSON next to this file); the spread over seeds is in the next "
        "section.",
        "",
        "| run | parameters | test accuracy | train seconds (2 CPU cores, shared) | command |",
        "|---|---:|---:|---:|---|",
    ]
    for name, file, command in DIGITS:
        path = os.path.join(RESULTS, file)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            run = json.load(f)
        lines.append(
            f"| {name} | {run['param_count']:,} | {run['test_accuracy']:.4f} "
            f"| {run['train_seconds']:.0f} | `{command} --output {file}` |"
        )
    return lines


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        dense_flops = result["rows"][1]["flops"]
        for r in result["rows"]:
            x, y = r["flops"] / dense_flops, r["xla_total_bytes"] / MIB
            marker = "s" if r["name"] == "plain" else ("^" if "remat full" in r["name"] else "o")
            ax.scatter(x, y, marker=marker)
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("FLOPs per step / dense fp32 step (jaxpr)")
        ax.set_ylabel("XLA:CPU total MiB")
        ax.set_title(f"{result['model']}, batch {result['batch_size']}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--compressions", nargs="+", type=float, default=[0.25])
    parser.add_argument("--table-only", action="store_true", help="re-render the committed JSON")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    for model in args.models:
        if not args.table_only:
            result = measure(model, args.compressions)
            with open(os.path.join(RESULTS, f"{model}.json"), "w") as f:
                json.dump(result, f, indent=2)
    results = []
    for model in SIZES:
        path = os.path.join(RESULTS, f"{model}.json")
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                results.append(json.load(f))
    lines = [
        "# Factorized layers: memory and FLOPs at full size (compile-only)",
        "",
        "Sources: `XLA:CPU` (the compiled step's total: argument + output + temp - alias), "
        "`analytic` (tensor sizes: parameters, optimizer state, activations saved for the "
        "backward pass, inputs) and FLOPs counted from the jaxpr (remat recomputation "
        "included). `vs plain`: the plain Flax/Optax step's XLA:CPU total over the row's. The "
        "first and last layers stay dense; compression = the fraction of each factorized "
        "layer's parameters kept. Made by `python experiments/factorized_memory.py`.",
    ]
    for result in results:
        lines += ["", f"## {result['model']}, batch {result['batch_size']}", "", *table(result)]
    lines += digits_table()
    lines += [
        "",
        "## Accuracy over seeds (CPU tasks)",
        "",
        "CP / Tucker-2 / low-rank at 10, 25 and 50%, from scratch and decomposed from the "
        "dense baseline of the same seed then fine-tuned, with and without remat, ranks by "
        "VBMF and by energy, over seeds (each table gives its count), paired with the baseline: "
        "[digits/accuracy.md](digits/accuracy.md) (WRN-16-2, 8x8) and "
        "[translation/accuracy.md](translation/accuracy.md) (the small DynamicConv "
        "Transformer, synthetic reversal), by `python experiments/factorized_study.py`.",
    ]
    step_times = os.path.join(RESULTS, "train_step_wrn-28-2_b128_cpu.md")
    if os.path.exists(step_times):
        with open(step_times) as f:
            lines += [
                "",
                "## Step time, WRN-28-2 batch 128 (XLA:CPU, measured)",
                "",
                "`python benchmarks/train_step.py --configs plain,fp32,remat_full,tucker,"
                "tucker_remat_full,cp_remat_full,lowrank_remat_full --repeats 3 --out-dir "
                "experiments/results/factorized` (one run; ratios within it). Factorized rows at "
                "25%.",
                "",
                f.read().strip(),
            ]
    with open(os.path.join(RESULTS, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(results, os.path.join(RESULTS, "memory_flops.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
