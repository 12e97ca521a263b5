"""The report grid run for real on the backend JAX has: compiled bytes, runtime peak, step time.

For each model and each configuration (``plain``, then the rows of
:func:`lowmem_jax.report.grid.standard_grid`), in a fresh Python process (the runtime peak is a
per-process high-water mark): build the step exactly as ``lowmem analyze`` does
(:func:`lowmem_jax.workloads.build`, or :func:`~lowmem_jax.workloads.build_plain` for ``plain``),
initialise a state on a random batch of the workload's shapes, compile, run one warm-up step and
``--repeats`` timed steps, and record

* XLA's compiled figures (source ``XLA:<BACKEND>``; total = argument + output + temp - alias);
* the runtime peak, ``device.memory_stats()["peak_bytes_in_use"]`` after the steps (source
  ``runtime``): every buffer the process held at once on the device, state and batch included;
  and, before the step ran, the bytes in use and the peak initialisation reached (a runtime
  peak no higher than that was set by initialising, not by the step);
* with ``--configs offload``, the rows a single device measures that the report grid lacks:
  the optimizer state kept in host memory between steps (``optimizer_memory="pinned_host"``,
  ZeRO-Offload's placement; XLA:CPU has one memory, so only a GPU's runtime peak shows what
  it saves), alone, with ``remat full``, with its update computed on the host
  (``optimizer_update="host"``), and with the stacked blocks' parameters there too (weight
  streaming, ``weight_memory="pinned_host"``, against the same plan without);
* with ``--inspect``, XLA's buffers at the compiled step's peak by category (``lm.inspect``).
  The CPU backend keeps no such statistic; there the field is ``null`` and says so;
* the measured step time (median of ``--repeats``), and each figure's ratio to ``plain``
  measured in the same run.

On a backend that keeps memory statistics, each configuration runs in two processes: the
first compiles the step and the initialisation into a persistent compilation cache, the
second reads them back and measures. A GPU compile autotunes its kernels, and the
autotuner's scratch buffers would otherwise set the process's peak. ``--jobs N`` measures N
configurations at once: they compile in parallel and take turns, under a file lock, for the
timed steps.

A configuration that fails (e.g. out of memory) is recorded with its error and the run goes on.

Usage::

    python benchmarks/gpu_validate.py --out-dir benchmarks/results            # both models
    python benchmarks/gpu_validate.py --out-dir /tmp/v --models wrn-28-2 --configs plain,baseline
    python benchmarks/gpu_validate.py --out-dir /tmp/v --configs headline --jobs 8 --inspect
    python benchmarks/gpu_validate.py --out-dir /tmp/v --configs offload

Writes ``<out-dir>/validate_<backend>.{json,md,png}``; on a GPU, commit them as
``benchmarks/results/validate_gpu.*`` (the device is named inside).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import validate_results  # noqa: E402
from benchmarks.validate_results import PLAIN  # noqa: E402

# The models of the committed memory reports (their default batches: 128 images, 100 x 40 tokens).
MODELS = ("wrn-28-2", "dynamicconv-iwslt")
_WORKER = "--worker"
_RESULT_MARK = "GPU_VALIDATE_RESULT "


# The README headline's rows per benchmark, with their CPU step costs (experiments/headline_cost.py)
STEP_COST = os.path.join(ROOT, "experiments", "results", "envelope_accuracy", "step_cost.json")
HEADLINE = "headline"
# Rows outside the report grid (plan fields each), measured with plain and baseline by
# ``--configs offload``: where the optimizer state lives between steps.
OFFLOAD = "offload"
OFFLOAD_ROWS = {
    "state in host memory": {"optimizer_memory": "pinned_host"},
    "remat full + state in host memory": {"remat": "full", "optimizer_memory": "pinned_host"},
    "state and update on the host": {"optimizer_memory": "pinned_host", "optimizer_update": "host"},
    "remat full + state and update on the host": {
        "remat": "full",
        "optimizer_memory": "pinned_host",
        "optimizer_update": "host",
    },
    # Weight streaming: the same with every parameter in host memory too.
    "remat full + weights, state and update on the host": {
        "remat": "full",
        "optimizer_memory": "pinned_host",
        "optimizer_update": "host",
        "weight_memory": "pinned_host",
    },
    # The stacks' blocks alone streamed, the layers outside them on the device (the first
    # arrangement: on the H200 the transformer's step was 32.4 MiB smaller so, before a fix
    # that explains at most 15.6 of them).
    "remat full + stacked weights, state and update on the host": {
        "remat": "full",
        "optimizer_memory": "pinned_host",
        "optimizer_update": "host",
        "weight_memory": "pinned_host",
        "streamed_layers": "stacks",
    },
    # Both under the report's mixed float16 over microbatches (4 divides both batches).
    "mixed_fp16 + mb 4 + remat full + state and update on the host": {
        "precision": "mixed_fp16",
        "microbatches": 4,
        "remat": "full",
        "optimizer_memory": "pinned_host",
        "optimizer_update": "host",
    },
    "mixed_fp16 + mb 4 + remat full + weights, state and update on the host": {
        "precision": "mixed_fp16",
        "microbatches": 4,
        "remat": "full",
        "optimizer_memory": "pinned_host",
        "optimizer_update": "host",
        "weight_memory": "pinned_host",
    },
}


def split_names(text: str, names: list[str]) -> list[str]:
    """``--configs``' comma-separated names, a name with a comma of its own (``remat full +
    weights, state and update on the host``) kept whole where the pieces make one."""
    found, piece = [], ""
    for part in text.split(","):
        piece = f"{piece},{part}" if piece else part
        if piece in names or (piece and not any(n.startswith(piece + ",") for n in names)):
            found.append(piece)
            piece = ""
    return found + ([piece] if piece else [])


def headline_names(model: str, path: str = STEP_COST) -> list[str]:
    """``plain``, ``baseline`` and the README headline's rows of ``model`` (as ``step_cost.json``
    lists them): what ``--configs headline`` measures.

    Raises:
      ValueError: the file is missing or has no headline row of ``model``.
    """
    try:
        with open(path) as f:
            cost = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the headline rows from {path}: {e}") from None
    rows = [
        row["name"]
        for task, model_of_task in cost.get("model_of_task", {}).items()
        if model_of_task == model
        for row in cost["tasks"].get(task, [])
    ]
    if not rows:
        raise ValueError(f"{path} has no headline row of {model}; name the configs instead")
    return [PLAIN, "baseline", *rows]


def grid_names(model: str, batch_size: int) -> list[str]:
    """``plain``, the names of the standard report grid for ``model`` at ``batch_size``, then
    :data:`OFFLOAD_ROWS`'."""
    return [PLAIN, *(name for name, _, _ in _grid(model, batch_size) if name != PLAIN)]


def _grid(model: str, batch_size: int):
    """(name, group, plan) of the report grid's rows and :data:`OFFLOAD_ROWS`."""
    from lowmem_jax import Plan
    from lowmem_jax.report.grid import model_grid

    extra = [(name, OFFLOAD, Plan(**fields)) for name, fields in OFFLOAD_ROWS.items()]
    return [*model_grid(model, batch_size), *extra]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process (the worker): see the module docstring."""
    import jax

    from lowmem_jax.analysis.memory import xla_memory
    from lowmem_jax.analysis.timing import time_step
    from lowmem_jax.cli.dispatch import _use_compilation_cache
    from lowmem_jax.workloads import build, build_plain, workload

    # The run's own cache (phase "compile" writes it, phase "measure" reads it), else only where
    # asked for (the tests): a cached executable makes compile_seconds meaningless.
    _use_compilation_cache(spec.get("cache_dir") or os.environ.get("LOWMEM_CACHE_DIR", ""))

    work = workload(
        spec["model"], spec["batch_size"], seq_len=spec["seq_len"], image_size=spec["image_size"]
    )
    if spec["name"] == PLAIN:
        setup = build_plain(work)
    else:
        plans = {name: plan for name, _, plan in _grid(spec["model"], spec["batch_size"])}
        setup = build(work, plans[spec["name"]])
    device = jax.devices()[0]
    # Compiled from shapes, before any buffer exists: with --jobs, workers compile at once.
    start = time.perf_counter()
    compiled = setup.step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    compile_s = time.perf_counter() - start
    batch = setup.example_batch()
    state = setup.init_state(batch)
    jax.block_until_ready(state)
    if spec.get("phase") == "compile":  # the executables are in the cache now
        return {"name": spec["name"], "compile_seconds": compile_s}
    # Before the step: the state and batch in use, and the peak initialisation reached; a
    # runtime peak no higher after the steps was set by initialisation, not by the step.
    at_init = device.memory_stats()
    with _device_lock(spec.get("lock")):  # one worker's timed steps on the device at a time
        timed = time_step(compiled, state, batch, spec["repeats"])
    stats = device.memory_stats()
    inspected = None
    if spec.get("inspect"):  # XLA's buffers at the compiled step's peak (lm.inspect)
        from lowmem_jax.analysis.inspector import inspect

        try:  # the measured row stands without it
            found = inspect(setup.step, setup.abstract_state(), setup.abstract_batch())
            inspected = {"peak_bytes": found.peak_bytes, "by_category": found.by_category(),
                         "reconciliation": found.reconciliation,
                         "top_buffers": found.table(top=12)}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded in the row, never silent
            inspected = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
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


@contextlib.contextmanager
def _device_lock(path: str | None):
    """An exclusive lock on ``path`` (a file) while the body runs; no lock for ``None``."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_fresh(spec: dict[str, Any], timeout: float, cache_dir: str | None = None) -> dict[str, Any]:
    """:func:`measure` in a new process; a failure becomes ``{"name", "error"}``.

    With ``cache_dir`` (a backend that keeps memory statistics), in two processes: the first
    compiles the step and the initialisation into JAX's persistent cache there, the second
    reads them back and measures. Compiling on a GPU runs the autotuner, whose scratch buffers
    would otherwise set the process's peak (hundreds of MiB above a small step's own).
    """
    if cache_dir is None:
        return _run_worker(spec, timeout)
    first = _run_worker({**spec, "cache_dir": cache_dir, "phase": "compile"}, timeout)
    if "error" in first:
        return first
    row = _run_worker({**spec, "cache_dir": cache_dir, "phase": "measure"}, timeout)
    if "error" not in row:  # the compile that ran, not the cache read
        row["compile_seconds"], row["cached_compile_seconds"] = (
            first["compile_seconds"], row["compile_seconds"])  # fmt: skip
    return row


def _run_worker(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), _WORKER, json.dumps(spec)]
    # Each worker takes device memory as it needs it (not 75% up front), so several fit at once
    # and the allocator's peak is the step's own.
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"name": spec["name"], "error": f"timed out after {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    lines = proc.stderr.strip().splitlines() or ["no output"]
    return {"name": spec["name"], "error": f"exit {proc.returncode}: {_error_line(lines)[:300]}",
            "stderr_tail": lines[-25:]}  # fmt: skip


def _error_line(lines: list[str]) -> str:
    """The exception's own line of a traceback (JAX prints a notice after it), else the last."""
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return (errors or lines)[-1]


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
        help="comma-separated config names (default: plain and the whole report grid), or "
        f"'{HEADLINE}': plain, baseline and the README headline's rows of each model",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="default: 128 for wrn-*, 100 for dynamicconv-*"
    )
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="configurations measured at once, each in its own process: they compile in "
        "parallel and take turns (a file lock) for the timed steps",
    )
    parser.add_argument(
        "--lock",
        default=None,
        help="the lock file the timed steps take turns under (default: beside the results, "
        "with --jobs > 1); name the same file in runs that share the device",
    )
    parser.add_argument(
        "--inspect",
        action="store_true",
        help="also record XLA's buffers at each compiled step's peak by category (lm.inspect: "
        "one more compile per configuration)",
    )
    args = parser.parse_args(argv)
    for flag in ("batch_size", "seq_len", "image_size", "repeats", "jobs"):
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
    # This process only names the device: it must not take 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
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
        try:
            headline = headline_names(model) if args.configs == HEADLINE else None
        except ValueError as e:
            print(f"gpu_validate.py: error: --configs {HEADLINE}: {e}", file=sys.stderr)
            return 2
        if args.configs == OFFLOAD:
            headline = [PLAIN, "baseline", *OFFLOAD_ROWS]
        wanted = headline or split_names(args.configs, names) or names
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
    memory_stats = device.memory_stats() is not None
    result: dict[str, Any] = {
        "backend": jax.default_backend(),
        "device": f"{device.device_kind} ({jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "jax_version": jax.__version__,
        "repeats": args.repeats,
        "command": "python benchmarks/gpu_validate.py " + shlex.join(argv),
        "jobs": args.jobs,
        # What a runtime peak no higher than runtime_peak_after_init_bytes was set by.
        "before_step": "initialisation (compiled in an earlier process)" if memory_stats else None,
        "models": [],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"validate_{result['backend']}")
    own_lock = args.lock is None and args.jobs > 1  # made here, removed at the end
    lock = os.path.abspath(stem + ".lock") if own_lock else args.lock and os.path.abspath(args.lock)
    # Where the runtime peak is kept, compile in one process and measure in another.
    cache_dir = tempfile.mkdtemp(prefix="gpu_validate_cache_") if memory_stats else None
    specs = [
        {
            "model": model,
            "batch_size": batch_size,
            "seq_len": args.seq_len,
            "image_size": args.image_size,
            "repeats": args.repeats,
            "name": name,
            "inspect": args.inspect,
            "lock": lock,
        }  # fmt: skip
        for model, batch_size, names in plans
        for name in names
    ]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        running = {pool.submit(run_fresh, spec, args.timeout, cache_dir): spec for spec in specs}
        for done in concurrent.futures.as_completed(running):
            spec = running[done]
            rows[spec["model"], spec["name"]] = done.result()
            print(f"{spec['model']} {validate_results.summary(done.result())}", flush=True)
            # Written after every configuration: a run cut short keeps what it measured.
            validate_results.write(result, plans, rows, stem, plot_too=len(rows) == len(specs))
    if own_lock:
        os.remove(lock)
    if cache_dir:
        shutil.rmtree(cache_dir)
    print(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
