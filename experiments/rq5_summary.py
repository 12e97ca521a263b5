"""RQ5: how far does the combination go on both benchmarks, next to the report's 60.7x and 8.7x?

Collects what the other scripts measured, nothing new is trained or compiled:

- the RQ4 answer per benchmark (the largest XLA:CPU reduction within the accuracy tolerance,
  its analytic reduction, FLOPs, measured step time and CPU-task accuracy);
- the most aggressive row of each full-size memory report, whatever its accuracy (how far
  memory alone goes);
- plots: memory reduction against the accuracy difference (single techniques and the RQ4
  combination), and memory reduction against FLOPs with the Pareto front.

Usage:
    python experiments/rq5_summary.py

Writes ``experiments/results/rq5/summary.{json,md}``, ``memory_vs_accuracy.png`` and
``memory_vs_flops.png``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.memory_reports import MODELS, load_or_run_report  # noqa: E402
from experiments.rq4_search import MODEL_OF, RQ2, SCALE, full_size  # noqa: E402
from experiments.rq4_search import OUT as RQ4  # noqa: E402

OUT = os.path.join(study.RESULTS, "rq5")
PUBLISHED = {
    "wrn-28-2": {"reduction": 60.7, "cost": "-0.4% accuracy (CIFAR-10, 94.7% dense)"},
    "dynamicconv-iwslt": {"reduction": 8.7, "cost": "-0.15 BLEU (IWSLT'14 De-En, 35.2 dense)"},
}
MIB = 2.0**20


def load_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def accuracy_points(task: str, report: dict) -> list[dict]:
    """Single settings of ``task`` with their paired accuracy delta and full-size reduction."""
    rows = {r["name"]: r for r in report["configs"]}
    acc = study.summarize(study.load_runs(os.path.join(RQ2, task)))
    variants = {v.name: v for v in study.single_variants(task)}
    points = []
    for r in acc:
        v = variants.get(r["name"])
        if v is None or v.technique == "baseline" or r["delta_vs_baseline"] is None:
            continue
        row = rows.get(full_size(task, v)[0])
        if row is None:
            continue
        d = r["delta_vs_baseline"]
        points.append(
            {
                "setting": v.setting,
                "technique": v.technique,
                "delta": d["mean"] * SCALE[task],
                "delta_min": d["min"] * SCALE[task],
                "delta_max": d["max"] * SCALE[task],
                "reduction_xla": row["reduction_xla"],
            }
        )
    return points


def summarize() -> dict:
    out = {"benchmarks": []}
    for task, model in MODEL_OF.items():
        report = load_or_run_report(model)
        most = max(report["configs"], key=lambda r: r["reduction_xla"])
        folder = os.path.join(RQ4, task)
        searches = sorted(
            (
                load_json(os.path.join(folder, f))
                for f in os.listdir(folder)
                if f.startswith("search_tol") and f.endswith(".json")
            )
            if os.path.isdir(folder)
            else [],
            key=lambda s: s["tolerance"],
        )
        entry = {
            "task": task,
            "model": model,
            "batch_size": MODELS[model][0],
            "published": PUBLISHED[model],
            "xla_source": report["xla_source"],
            "most_aggressive": {
                "name": most["name"],
                "reduction_xla": most["reduction_xla"],
                "reduction_analytic": most["reduction_analytic"],
                "flops_overhead": most["flops_overhead"],
            },
            "rq4": searches,
            "points": accuracy_points(task, report),
        }
        out["benchmarks"].append(entry)
    return out


def to_markdown(summary: dict) -> str:
    lines = [
        "# RQ5: how far the combination goes",
        "",
        "| benchmark | technical report | ours: combination (RQ4) | reduction (XLA:CPU) "
        "| reduction (analytic) | accuracy cost (CPU task, paired, mean [range]) "
        "| FLOPs | step time (CPU, same run) | most aggressive row, any accuracy |",
        "|---|---|---|---:|---:|---|---:|---:|---|",
    ]
    for b in summary["benchmarks"]:
        pub = f"{b['published']['reduction']}x at {b['published']['cost']}"
        m = b["most_aggressive"]
        most = (
            f"{m['name']}: {m['reduction_xla']:.1f}x XLA:CPU, "
            f"{m['reduction_analytic']:.1f}x analytic"
        )
        if not b["rq4"]:
            lines.append(f"| {b['model']} | {pub} | not run | - | - | - | - | - | {most} |")
        for s in b["rq4"]:
            f = s["full_size"]
            plan = ", ".join(f"{k}={v}" for k, v in f["plan"].items()) or "fp32"
            if f["sparse"]:
                plan += f", DSR {1 - f['sparse']['density']:.0%} compressed"
            unit = "points" if b["task"] == "digits" else "BLEU"
            acc, time_ratio = "not measured", "-"
            if "cpu_task" in s:
                k = s["cpu_task"]["unit_scale"]
                d = s["cpu_task"]["summary"]["delta_vs_baseline"]
                acc = (
                    f"{d['mean'] * k:+.2f} {unit} [{d['min'] * k:+.2f}, {d['max'] * k:+.2f}], "
                    f"{len(s['cpu_task']['summary']['seeds'])} seeds"
                )
                time_ratio = f"{s['time']['ratio']:.2f}x"
            lines.append(
                f"| {b['model']} (b{b['batch_size']}) | {pub} | {plan} (tolerance "
                f"{s['tolerance']:g} {unit}) | **{f['reduction_xla']:.1f}x** | "
                f"{f['reduction_analytic']:.1f}x | {acc} | {f['flops_overhead']:.2f}x | "
                f"{time_ratio} | {most} |"
            )
    lines += [
        "",
        "Memory: full-size models (WRN-28-2 batch 128; DynamicConv IWSLT preset 100 x 40 tokens), "
        "compile-only; XLA:CPU totals = argument + output + temp - alias; analytic = the "
        "report's method (model + optimizer + saved activations + inputs). Accuracy: the CPU "
        "tasks (WRN-16-2 on 8x8 digits; the small DynamicConv on synthetic reversal), the "
        "combination's own settings, paired with the baseline of the same seed. Not measured "
        "here: accuracy at full scale (needs a GPU), and XLA:GPU memory (fp16 activations and "
        "cuDNN workspaces differ from XLA:CPU).",
        "",
        "![memory vs accuracy](memory_vs_accuracy.png)",
        "",
        "![memory vs FLOPs](memory_vs_flops.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summary["benchmarks"])
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.8), squeeze=False)
    for ax, b in zip(axes[0], summary["benchmarks"], strict=True):
        techniques = sorted({p["technique"] for p in b["points"]})
        for i, t in enumerate(techniques):
            sel = [p for p in b["points"] if p["technique"] == t]
            ax.errorbar(
                [p["reduction_xla"] for p in sel],
                [p["delta"] for p in sel],
                yerr=[
                    [p["delta"] - p["delta_min"] for p in sel],
                    [p["delta_max"] - p["delta"] for p in sel],
                ],
                fmt="o",
                color=f"C{i}",
                label=t,
                capsize=2,
            )
            for p in sel:
                ax.annotate(
                    p["setting"],
                    (p["reduction_xla"], p["delta"]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        for i, s in enumerate(b["rq4"]):
            if "cpu_task" not in s:
                continue
            k = s["cpu_task"]["unit_scale"]
            d = s["cpu_task"]["summary"]["delta_vs_baseline"]
            ax.errorbar(
                [s["full_size"]["reduction_xla"]],
                [d["mean"] * k],
                yerr=[[(d["mean"] - d["min"]) * k], [(d["max"] - d["mean"]) * k]],
                fmt="*",
                ms=14,
                color=f"C{len(techniques) + i}",
                label=f"RQ4 combination, tolerance {s['tolerance']:g}",
                capsize=3,
            )
            ax.axhline(-s["tolerance"], color=f"C{len(techniques) + i}", ls="--", lw=0.8)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xscale("log")
        ax.set_xlabel(f"memory reduction, full-size step ({b['xla_source']}, x)")
        unit = "test accuracy points" if b["task"] == "digits" else "BLEU"
        ax.set_ylabel(f"{unit} vs baseline, CPU task (mean, range)")
        ax.set_title(f"{b['model']} memory / {b['task']} accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "memory_vs_accuracy.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.8), squeeze=False)
    for ax, b in zip(axes[0], summary["benchmarks"], strict=True):
        rows = load_or_run_report(b["model"])["configs"]
        pts = sorted((r["flops_overhead"], r["reduction_xla"], r["name"]) for r in rows)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=20)
        for x, y, name in pts:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front, best = [], 0.0
        for x, y, _ in pts:  # most reduction for at most this many FLOPs
            if y > best:
                front.append((x, y))
                best = y
        ax.plot([p[0] for p in front], [p[1] for p in front], "r-", lw=1, label="Pareto front")
        ax.set_yscale("log")
        ax.set_xlabel("FLOPs per step / baseline (jaxpr count)")
        ax.set_ylabel(f"memory reduction ({b['xla_source']}, x)")
        ax.set_title(f"{b['model']}: memory vs compute")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "memory_vs_flops.png"), dpi=110)
    plt.close(fig)


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    summary = summarize()
    summary["command"] = "python experiments/rq5_summary.py"
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(OUT, "summary.md"), "w") as f:
        f.write(to_markdown(summary) + "\nMade by: `python experiments/rq5_summary.py`\n")
    plot(summary)
    print(to_markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
