"""The tables and figure of a :mod:`gpu_validate` run: ratios to ``plain``, a markdown table per
model, a bar chart, and the files written after each configuration."""

from __future__ import annotations

import json
from typing import Any

PLAIN = "plain"
MIB = 2.0**20


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's figures over ``plain``'s (the first row), where both were measured."""
    plain = rows[0]
    for r in rows:
        ok = "error" not in r and "error" not in plain
        r["reduction_xla_vs_plain"] = (
            plain["xla"]["total_bytes"] / r["xla"]["total_bytes"] if ok else None
        )
        # Only peaks the steps set: one reached before (compile, initialisation) is not theirs.
        peaks = ok and step_raised_peak(r) and step_raised_peak(plain)
        r["reduction_runtime_vs_plain"] = (
            plain["runtime_peak_bytes"] / r["runtime_peak_bytes"] if peaks else None
        )
        r["time_vs_plain"] = r["step_seconds"] / plain["step_seconds"] if ok else None


def step_raised_peak(r: dict[str, Any]) -> bool:
    peak = r["runtime_peak_bytes"]
    return bool(peak) and peak > (r["runtime_peak_after_init_bytes"] or 0)


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['name']:45s} ERROR {r['error']}"
    peak = r["runtime_peak_bytes"]
    return (
        f"{r['name']:45s} XLA total {r['xla']['total_bytes'] / MIB:8.1f} MiB  runtime peak "
        f"{_fmt(peak and peak / MIB, '.1f', ' MiB')}  step {1e3 * r['step_seconds']:.1f} ms"
    )


def to_markdown(result: dict[str, Any]) -> str:
    src = f"XLA:{result['backend'].upper()}"
    lines = [
        f"# The report grid run on {result['device']}",
        "",
        f"Each configuration in a fresh process; {src} columns are compiled figures (total = "
        "argument + output + temp - alias); `runtime peak` is `peak_bytes_in_use` of the device "
        "after the steps (state and batch included; "
        + ("not kept by the CPU backend, hence n/a" if result["backend"] == "cpu" else "runtime")
        + f"); step time is the median of {result['repeats']} steps after a warm-up. Ratios are "
        "against `plain` (a Flax/Optax step with no technique) in the same run."
        + (
            " `step raised the peak`: no where the process had reached its peak before the "
            f"step ran, during {result['before_step']}: the step's own peak is at most that, "
            "and its runtime reduction is n/a."
            if result.get("before_step")
            else ""
        )
        + (
            f" {result['jobs']} configurations ran at once: they compiled concurrently (XLA's "
            "GPU autotuning runs kernels while it compiles) and took turns, under a lock, for "
            "the timed steps."
            if result.get("jobs", 1) > 1
            else ""
        ),
        "",
        f"Made by: `{result['command']}`",
        *(f"\n{note}" for note in result.get("notes", [])),
    ]
    for model in result["models"]:
        lines += [
            "",
            f"## `{model['model']}`, batch {model['batch_size']}",
            "",
            f"| config | {src} total MiB | runtime peak MiB | step raised the peak "
            f"| reduction ({src}) | reduction (runtime) | ms / step | time / plain |",
            "|---|---:|---:|:-:|---:|---:|---:|---:|",
        ]
        for r in model["configs"]:
            if "error" in r:
                lines.append(f"| {r['name']} | error: {r['error']} | | | | | | |")
                continue
            peak = r["runtime_peak_bytes"]
            raised = "n/a" if peak is None else ("yes" if step_raised_peak(r) else "no")
            lines.append(
                f"| {r['name']} | {r['xla']['total_bytes'] / MIB:.1f} | "
                f"{_fmt(peak and peak / MIB, '.1f')} | {raised} | "
                f"{_fmt(r['reduction_xla_vs_plain'], '.2f', 'x')} | "
                f"{_fmt(r['reduction_runtime_vs_plain'], '.2f', 'x')} | "
                f"{1e3 * r['step_seconds']:.1f} | {_fmt(r['time_vs_plain'], '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = f"XLA:{result['backend'].upper()}"
    models = result["models"]
    height = max(len(m["configs"]) for m in models) * 0.3 + 1.5
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), height), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in model["configs"] if "error" not in r]
        names = [r["name"] for r in rows]
        ax.barh(names, [r["xla"]["total_bytes"] / MIB for r in rows], label=f"{src} total")
        peaks = [(r["runtime_peak_bytes"] or 0) / MIB for r in rows]
        if any(peaks):
            ax.scatter(peaks, names, color="k", marker="|", s=200, zorder=3, label="runtime peak")
        ax.set_xscale("log")
        ax.set_xlabel("MiB (log)")
        ax.invert_yaxis()
        ax.set_title(f"{model['model']}, batch {model['batch_size']}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Training step memory on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result, plans, rows, stem: str, *, plot_too: bool) -> None:
    """``result`` with the rows measured so far, in grid order (``plain`` first)."""
    result["models"] = []
    for model, batch_size, names in plans:
        done = [rows[model, name] for name in names if (model, name) in rows]
        if done and done[0]["name"] == PLAIN:
            add_ratios(done)
        result["models"].append({"model": model, "batch_size": batch_size, "configs": done})
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(result))
    if plot_too:
        plot(result, stem + ".png")
