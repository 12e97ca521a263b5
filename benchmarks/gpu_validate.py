"""The report grid run for real on the backend JAX has: compiled bytes, runtime peak, step time.

For each model and each configuration (``plain``, then the rows of
:func:`lowmem_jax.report_grid.standard_grid`), in a fresh Python process (the runtime peak is a
per-process high-water mark): build the step exactly as ``lowmem analyze`` does
(:func:`lowmem_jax.workloads.build`, or :func:`~lowmem_jax.workloads.build_plain` for ``plain``),
initialise a state on a random batch of the workload's shapes, compile, run one warm-up step and
``--repeats`` timed steps, and record

* XLA's compiled figures (source ``XLA:<BACKEND>``; total = argument + output + temp - alias);
* the runtime peak, ``device.memory_stats()["peak_bytes_in_use"]`` after the steps (source
  ``runtime``): every buffer the process held at once on the device, state and batch included;
  and, before the step ran, the bytes in use and the peak initialisation reached (a runtime
  peak no higher than that was set by initialising, not by the step);
* with ``--inspect``, XLA's buffers at the compiled step's peak by category (``lm.inspect``).
  The CPU backend keeps no such statistic; there the field is ``null`` and says so;
* the measured step time (median of ``--repeats``), and each figure's ratio to ``plain``
  measured in the same run.

A configuration that fails (e.g. out of memory) is recorded with its error and the run goes on.

Usage::

    python benchmarks/gpu_validate.py --out-dir benchmarks/results            # both models
    python benchmarks/gpu_validate.py --out-dir /tmp/v --models wrn-28-2 --configs plain,baseline

Writes ``<out-dir>/validate_<backend>.{json,md,png}``; on a GPU, commit them as
``benchmarks/results/validate_gpu.*`` (the device is named inside).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

# The models of the committed memory reports (their default batches: 128 images, 100 x 40 tokens).
MODELS = ("wrn-28-2", "dynamicconv-iwslt")
PLAIN = "plain"
MIB = 2.0**20
_WORKER = "--worker"
_RESULT_MARK = "GPU_VALIDATE_RESULT "


def grid_names(model: str, batch_size: int) -> list[str]:
    """``plain`` and the names of the standard report grid for ``model`` at ``batch_size``."""
    return [PLAIN, *(name for name, _, _ in _grid(model, batch_size))]


def _grid(model: str, batch_size: int):
    from lowmem_jax.report_grid import model_grid

    return model_grid(model, batch_size)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process (the worker): see the module docstring."""
    import jax

    from lowmem_jax.cli import _use_compilation_cache
    from lowmem_jax.memory import xla_memory
    from lowmem_jax.step_timing import time_step
    from lowmem_jax.workloads import build, build_plain, workload

    # Only where asked for (the tests): a cached executable makes compile_seconds meaningless.
    _use_compilation_cache(os.environ.get("LOWMEM_CACHE_DIR", ""))

    work = workload(
        spec["model"], spec["batch_size"], seq_len=spec["seq_len"], image_size=spec["image_size"]
    )
    if spec["name"] == PLAIN:
        setup = build_plain(work)
    else:
        plans = {name: plan for name, _, plan in _grid(spec["model"], spec["batch_size"])}
        setup = build(work, plans[spec["name"]])
    device = jax.devices()[0]
    batch = setup.example_batch()
    state = setup.init_state(batch)
    jax.block_until_ready(state)
    # Before the step: the state and batch in use, and the peak initialisation reached; a
    # runtime peak no higher after the steps was set by initialisation, not by the step.
    at_init = device.memory_stats()
    start = time.perf_counter()
    compiled = setup.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    timed = time_step(compiled, state, batch, spec["repeats"])
    stats = device.memory_stats()
    inspected = None
    if spec.get("inspect"):  # XLA's buffers at the compiled step's peak (lm.inspect)
        from lowmem_jax.inspector import inspect

        found = inspect(setup.step, setup.abstract_state(), setup.abstract_batch())
        inspected = {"peak_bytes": found.peak_bytes, "by_category": found.by_category(),
                     "reconciliation": found.reconciliation}  # fmt: skip
    return {
        "name": spec["name"],
        "config": setup.config,
        "xla": xla_memory(compiled),
        "runtime_peak_bytes": None if stats is None else int(stats["peak_bytes_in_use"]),
        "runtime_in_use_after_init_bytes": None
        if at_init is None
        else int(at_init["bytes_in_use"]),
        "runtime_peak_after_init_bytes": None
        if at_init is None
        else int(at_init["peak_bytes_in_use"]),  # fmt: skip
        "inspected": inspected,
        "compile_seconds": compile_s,
        "step_seconds": timed.median,
        "step_seconds_all": timed.seconds,
        "loss": float(timed.metrics["loss"]),
    }


def run_fresh(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`measure` in a new process; a failure becomes ``{"name", "error"}``."""
    cmd = [sys.executable, os.path.abspath(__file__), _WORKER, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": spec["name"], "error": f"timed out after {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"name": spec["name"], "error": f"exit {proc.returncode}: {tail[:300]}"}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's figures over ``plain``'s (the first row), where both were measured."""
    plain = rows[0]
    for r in rows:
        ok = "error" not in r and "error" not in plain
        r["reduction_xla_vs_plain"] = (
            plain["xla"]["total_bytes"] / r["xla"]["total_bytes"] if ok else None
        )
        peaks = ok and r["runtime_peak_bytes"] and plain["runtime_peak_bytes"]
        r["reduction_runtime_vs_plain"] = (
            plain["runtime_peak_bytes"] / r["runtime_peak_bytes"] if peaks else None
        )
        r["time_vs_plain"] = r["step_seconds"] / plain["step_seconds"] if ok else None


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def _summary(r: dict[str, Any]) -> str:
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
        "against `plain` (a Flax/Optax step with no technique) in the same run.",
        "",
        f"Made by: `{result['command']}`",
    ]
    for model in result["models"]:
        lines += [
            "",
            f"## `{model['model']}`, batch {model['batch_size']}",
            "",
            f"| config | {src} total MiB | runtime peak MiB | reduction ({src}) "
            "| reduction (runtime) | ms / step | time / plain |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in model["configs"]:
            if "error" in r:
                lines.append(f"| {r['name']} | error: {r['error']} | | | | | |")
                continue
            peak = r["runtime_peak_bytes"]
            lines.append(
                f"| {r['name']} | {r['xla']['total_bytes'] / MIB:.1f} | "
                f"{_fmt(peak and peak / MIB, '.1f')} | "
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


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="where validate_<backend>.* go")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated model names (default: {','.join(MODELS)}; any `lowmem` model)",
    )
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated config names (default: plain and the whole report grid)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="default: 128 for wrn-*, 100 for dynamicconv-*"
    )
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument(
        "--inspect",
        action="store_true",
        help="also record XLA's buffers at each compiled step's peak by category (lm.inspect: "
        "one more compile per configuration)",
    )
    args = parser.parse_args(argv)
    for flag in ("batch_size", "seq_len", "image_size", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_WORKER]:  # one configuration, in the process run_fresh started
        print(_RESULT_MARK + json.dumps(measure(json.loads(argv[1]))), flush=True)
        return 0
    args = _parse(argv)
    import jax

    from lowmem_jax.workloads import workload

    models = [m for m in args.models.split(",") if m]
    plans = []
    for model in models:
        try:
            work = workload(model, args.batch_size, seq_len=args.seq_len)
        except ValueError as e:
            print(f"gpu_validate.py: error: --models: {e}", file=sys.stderr)
            return 2
        names = grid_names(model, work.batch_size)
        wanted = [c for c in args.configs.split(",") if c] or names
        unknown = [c for c in wanted if c not in names]
        if unknown:
            print(
                f"gpu_validate.py: error: unknown --configs {unknown} for {model}; allowed "
                f"values: {names}",
                file=sys.stderr,
            )
            return 2
        plans.append((model, work.batch_size, [PLAIN, *(c for c in wanted if c != PLAIN)]))

    device = jax.devices()[0]
    result: dict[str, Any] = {
        "backend": jax.default_backend(),
        "device": f"{device.device_kind} ({jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "jax_version": jax.__version__,
        "repeats": args.repeats,
        "command": "python benchmarks/gpu_validate.py " + " ".join(argv),
        "models": [],
    }
    for model, batch_size, names in plans:
        rows = []
        for name in names:
            spec = {
                "model": model,
                "batch_size": batch_size,
                "seq_len": args.seq_len,
                "image_size": args.image_size,
                "repeats": args.repeats,
                "name": name,
                "inspect": args.inspect,
            }
            rows.append(run_fresh(spec, args.timeout))
            print(f"{model} {_summary(rows[-1])}", flush=True)
        add_ratios(rows)
        result["models"].append({"model": model, "batch_size": batch_size, "configs": rows})

    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"validate_{result['backend']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(result))
    plot(result, stem + ".png")
    print(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
