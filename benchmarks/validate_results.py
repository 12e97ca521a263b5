"""The tables and figure of a :mod:`gpu_validate` run: ratios to ``plain``, a markdown table per
model, a bar chart, and the files written after each configuration.

Several runs on one device (e.g. one per model, each in its own call) become one result file::

    python benchmarks/validate_results.py --out benchmarks/results/validate_gpu_headline \
        --note "..." run1/validate_gpu.json run2/validate_gpu.json

Each run's sections keep their own ``plain`` row and ratios, and name the command that made them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
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
            if (result.get("jobs") or 1) > 1
            else ""
        ),
        "",
        f"Made by: `{result['command']}`",
        *(f"\n{note}" for note in result.get("notes", [])),
    ]
    for model in result["models"]:
        lines += ["", f"## `{model['model']}`, batch {model['batch_size']}", ""]
        if "made_by" in model:  # a section of a merged file: its own run
            lines += [f"Made by: `{model['made_by']}` ({model['jobs']} configurations at once; "
                      "ratios against this run's `plain`)", ""]  # fmt: skip
        lines += [
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
                f"{_fmt(r.get('reduction_xla_vs_plain'), '.2f', 'x')} | "
                f"{_fmt(r.get('reduction_runtime_vs_plain'), '.2f', 'x')} | "
                f"{1e3 * r['step_seconds']:.1f} | {_fmt(r.get('time_vs_plain'), '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

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
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels overlap
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


def merge(runs: list[dict[str, Any]], notes: list[str], command: str) -> dict[str, Any]:
    """Runs of :mod:`gpu_validate` on one device as one result; each section keeps its run's
    ``plain``, ratios and command (``made_by``, ``jobs``); a merged file may be one of the runs.

    Raises:
      ValueError: the runs name different devices, backends or JAX versions.
    """
    keys = ("backend", "device", "jax_version", "repeats", "before_step")
    differing = [k for k in keys if len({json.dumps(run.get(k)) for run in runs}) > 1]
    if differing:
        raise ValueError(f"the runs differ in {differing}: merge runs of one device only")
    result = {k: runs[0].get(k) for k in keys}
    # A merged file merges again: its sections keep their commands and its notes come first.
    earlier = [note for run in runs for note in run.get("notes", [])]
    result.update(command=command, jobs=None, notes=earlier + notes, models=[])
    for run in runs:
        for model in run["models"]:
            made = {"made_by": run["command"], "jobs": run["jobs"]}
            result["models"].append({**made, **model})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Merge gpu_validate runs of one device.")
    parser.add_argument("runs", nargs="+", help="validate_<backend>.json files")
    parser.add_argument("--out", required=True, help="output stem: <out>.json, .md, .png")
    parser.add_argument("--note", action="append", default=[], help="a paragraph (repeatable)")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            print(f"validate_results.py: error: runs: cannot read {path}: {e}", file=sys.stderr)
            return 2
    notes = " --note ..." * len(args.note)  # the notes are in the file itself
    runs_named = shlex.join(args.runs)
    command = f"python benchmarks/validate_results.py --out {args.out}{notes} {runs_named}"
    try:
        result = merge(runs, args.note, command)
    except ValueError as e:
        print(f"validate_results.py: error: runs: {e}", file=sys.stderr)
        return 2
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(result))
    plot(result, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
