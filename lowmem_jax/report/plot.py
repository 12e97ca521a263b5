"""The plots of a ``lowmem report``: the memory breakdown per configuration and the memory
reduction against FLOPs (and a plot per technique's section, e.g. per-device bytes by stage)."""

from __future__ import annotations

import os
from typing import Any

from lowmem_jax.core.units import MIB
from lowmem_jax.techniques import report_sections

__all__ = ["plot_report"]


def _breakdown_bars(ax, rows: list[dict[str, Any]], src: str) -> None:
    """Stacked analytic components per row on a linear axis, the XLA total as a tick."""
    names = [r["name"] for r in rows]
    left = [0.0] * len(rows)
    parts = [
        ("model_bytes", "model"),
        ("optimizer_bytes", "optimizer"),
        ("activation_bytes", "activations"),
        ("dense_weight_bytes", "dense weights"),
        ("input_bytes", "inputs"),
    ]
    for key, label in parts:
        widths = [r["analytic"][key] / MIB for r in rows]
        ax.barh(names, widths, left=left, label=f"{label} (analytic)")
        left = [a + b for a, b in zip(left, widths, strict=True)]
    totals = [r["xla"]["total_bytes"] / MIB for r in rows]
    ax.scatter(totals, names, color="k", marker="|", s=200, zorder=3, label=f"total ({src})")
    ax.set_xlim(0, 1.05 * max([*left, *totals]))
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.grid(axis="x", alpha=0.3)


def _number_points(ax, points: list[tuple[float, float]]) -> None:
    """Labels points with their 1-based numbers; points within 12 px of each other share one
    label (``"3,5"``), and a label overlapping an earlier one moves up or down until it does
    not. The names go in a numbered list beside the axes, so no name is drawn over another."""
    from matplotlib.text import Text

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    display = ax.transData.transform(points)
    clusters: list[list[int]] = []
    for i in sorted(range(len(points)), key=lambda i: tuple(display[i])):
        for members in clusters:
            if abs(display[members[0]] - display[i]).max() < 12:
                members.append(i)
                break
        else:
            clusters.append([i])
    placed = []
    for members in clusters:
        label = ",".join(str(i + 1) for i in sorted(members))
        text = ax.annotate(label, points[members[0]], xytext=(5, 3), textcoords="offset points",
                           fontsize=7)  # fmt: skip
        text.update_positions(renderer)
        box = Text.get_window_extent(text, renderer)
        for k in range(1, 40):
            if not any(box.overlaps(other) for other in placed):
                break
            dy = (box.height + 1) * ((k + 1) // 2) * (1 if k % 2 else -1) * 72 / fig.dpi
            text.set_position((5, 3 + dy))
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer)
        placed.append(box)


def plot_report(result: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    src = result["xla_source"]
    title = f"{result['model']}, batch {result['batch_size']}"
    paths = []

    # Breakdown on linear axes (a log axis makes the largest component look like half the bar):
    # every row, then the rows below a tenth of the largest total on their own scale.
    largest = max(max(r["analytic"]["total_bytes"], r["xla"]["total_bytes"]) for r in rows)
    small = [r for r in rows if max(r["analytic"]["total_bytes"], r["xla"]["total_bytes"])
             < largest / 10]  # fmt: skip
    panels = [(rows, f"Training memory breakdown: {title}")]
    if small:
        panels.append((small, "zoom: rows below a tenth of the largest"))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(11 * len(panels) / 1.4, 0.38 * len(rows) + 1.5), squeeze=False
    )
    for ax, (panel_rows, panel_title) in zip(axes[0], panels, strict=True):
        _breakdown_bars(ax, panel_rows, src)
        ax.set_title(panel_title, fontsize=10)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "breakdown.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (ax, names) = plt.subplots(1, 2, figsize=(13, 7.5), gridspec_kw={"width_ratios": [2.4, 1]})
    reference = "plain" if "reduction_xla_vs_plain" in rows[0] else "baseline"
    key = "reduction_xla_vs_plain" if reference == "plain" else "reduction_xla"
    colors = {}
    for group in sorted({r["group"] for r in rows}):
        sel = [r for r in rows if r["group"] == group]
        dots = ax.scatter(
            [r["flops_overhead"] for r in sel], [r[key] for r in sel], label=group, s=40
        )
        colors[group] = dots.get_facecolor()[0]
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per step / baseline (analytic, jaxpr)")
    ax.set_ylabel(f"memory reduction vs {reference}, {src} total bytes (x)")
    ax.set_title(f"Memory vs compute: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.margins(x=0.15, y=0.15)
    names.axis("off")
    for i, r in enumerate(rows):
        names.text(0, 1 - i / max(len(rows), 30), f"{i + 1:2d}  {r['name']}", fontsize=7.5,
                   color=colors[r["group"]], va="top", family="monospace")  # fmt: skip
    fig.tight_layout()
    _number_points(ax, [(r["flops_overhead"], r[key]) for r in rows])
    paths.append(os.path.join(out_dir, "tradeoff.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for key, section in report_sections().items():
        if result.get(key):
            paths.append(os.path.join(out_dir, f"{key}.png"))
            section.plot(result[key], title, paths[-1])
    return paths
