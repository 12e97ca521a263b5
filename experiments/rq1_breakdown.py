"""RQ1: which memory component dominates training?

For both benchmark models at their recipe batch (WRN-28-2, 128 CIFAR images; DynamicConv
Transformer, IWSLT preset, 100 x 40 tokens), fp32 with no technique: the analytic breakdown
(model = weights, optimizer = gradients + momentum / Adam moments, activations = residuals
saved for the backward pass, inputs) next to XLA:CPU's compiled total (argument + output +
temp - alias). Read from the full-size memory reports (:mod:`experiments.memory_reports`),
computed if missing. Next to them, the same baseline step measured: the bytes live at XLA:CPU's
peak by category (:mod:`lowmem_jax.analysis.inspector`), from ``benchmarks/results/inspect/
inspect_cpu.json`` (``python benchmarks/inspect_report.py``) where it has the model.

Usage:
    python experiments/rq1_breakdown.py

Writes ``experiments/results/rq1/breakdown.{json,md,png}``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.memory_reports import MODELS, command, load_or_run_report  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rq1")
INSPECTED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks", "results", "inspect", "inspect_cpu.json",
)  # fmt: skip
#: The measured categories shown, in the analytic components' order.
MEASURED = ("parameter", "optimizer state", "gradient", "saved residual", "batch", "workspace")


def measured(model: str) -> dict | None:
    """The baseline row's peak by category (``lm.inspect``, XLA:CPU), or None."""
    if not os.path.exists(INSPECTED):
        return None
    with open(INSPECTED) as f:
        entry = json.load(f)["models"].get(model)
    if entry is None:
        return None
    row = entry["rows"]["baseline"]
    return {"peak_bytes": row["peak_bytes"], "by_category": row["by_category"],
            "peak_instruction": row["peak_instruction"]}  # fmt: skip


MIB = 2.0**20
COMPONENTS = (
    ("model_bytes", "model (weights)"),
    ("optimizer_bytes", "optimizer (gradients + state)"),
    ("activation_bytes", "activations (saved for backward)"),
    ("input_bytes", "inputs (batch)"),
)


def breakdown(report: dict) -> dict:
    """The baseline row of ``report`` as components, bytes and shares of the analytic total."""
    base = next(r for r in report["configs"] if r["name"] == "baseline")
    analytic = base["analytic"]
    total = analytic["total_bytes"]
    return {
        "model": report["model"],
        "batch_size": report["batch_size"],
        "param_count": base["param_count"],
        "components": {
            key: {"bytes": analytic[key], "share": analytic[key] / total} for key, _ in COMPONENTS
        },
        "optimizer_breakdown": analytic["optimizer_breakdown"],
        "analytic_total_bytes": total,
        "xla_total_bytes": base["xla"]["total_bytes"],
        "xla_temp_bytes": base["xla"]["temp_bytes"],
        "xla_source": base["xla"]["source"],
        "largest_residuals": analytic["activation_residuals"]["largest"][:5],
        "dominant": max(COMPONENTS, key=lambda c: analytic[c[0]])[1],
        "measured_peak": measured(report["model"]),
    }


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "# RQ1: which memory component dominates?",
        "",
        "fp32, no technique, the recipe's batch. Analytic = sum of tensor sizes (the technical "
        "report's method); XLA:CPU = compiled argument + output + temp - alias (compile-only).",
        "",
        "| model | batch | parameters | model MiB | optimizer MiB | activations MiB | inputs MiB "
        "| analytic total MiB | XLA:CPU total MiB | activations share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["components"]
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['param_count']:,} | "
            + " | ".join(f"{c[k]['bytes'] / MIB:.1f}" for k, _ in COMPONENTS)
            + f" | {r['analytic_total_bytes'] / MIB:.1f} | {r['xla_total_bytes'] / MIB:.1f} | "
            f"{c['activation_bytes']['share']:.1%} |"
        )
    inspected = [r for r in rows if r["measured_peak"]]
    if inspected:
        lines += [
            "",
            "Measured: the bytes live at the compiled step's peak, by category (XLA:CPU buffer "
            "assignment, `lm.inspect`; `python benchmarks/inspect_report.py`): the optimizer "
            "column holds the stored state only, the gradients being live then or not.",
            "",
            "| model | peak MiB | "
            + " | ".join(f"{c} MiB" for c in MEASURED)
            + " | saved residual share of the peak |",
            "|---|---:|" + "---:|" * (len(MEASURED) + 1),
        ]
        for r in inspected:
            m = r["measured_peak"]
            by = m["by_category"]
            lines.append(
                f"| {r['model']} | {m['peak_bytes'] / MIB:.1f} | "
                + " | ".join(f"{by.get(c, 0) / MIB:.1f}" for c in MEASURED)
                + f" | {by.get('saved residual', 0) / m['peak_bytes']:.1%} |"
            )
    lines += [
        "",
        "Commands that made the reports: " + "; ".join(f"`{command(r['model'])}`" for r in rows),
        "",
    ]
    for r in rows:
        lines.append(
            f"Largest saved residuals of {r['model']} (bytes, shape, producing op): "
            + "; ".join(f"{b / MIB:.0f} MiB {s} ({op})" for b, s, op in r["largest_residuals"])
        )
        lines.append("")
    lines.append("![breakdown](breakdown.png)")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.8))
    names = [f"{r['model']} (b{r['batch_size']})" for r in rows]
    left = [0.0] * len(rows)
    for key, label in COMPONENTS:
        shares = [100 * r["components"][key]["share"] for r in rows]
        ax.barh(names, shares, left=left, label=label)
        for i, (x, w) in enumerate(zip(left, shares, strict=True)):
            if w > 4:
                ax.text(x + w / 2, i, f"{w:.0f}%", ha="center", va="center", fontsize=8)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the analytic training memory (%)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    ax.set_title("RQ1: where training memory goes (fp32, no technique)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    rows = [breakdown(load_or_run_report(model)) for model in MODELS]
    with open(os.path.join(OUT, "breakdown.json"), "w") as f:
        json.dump({"command": "python experiments/rq1_breakdown.py", "rows": rows}, f, indent=1)
    with open(os.path.join(OUT, "breakdown.md"), "w") as f:
        f.write(to_markdown(rows) + "\nMade by: `python experiments/rq1_breakdown.py`\n")
    plot(rows, os.path.join(OUT, "breakdown.png"))
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
