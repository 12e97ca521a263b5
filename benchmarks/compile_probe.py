"""Where the test suite's time goes to XLA: compiles and traces per test, from JAX's own events.

A pytest plugin (one JSON per xdist worker) and a summary of what the workers wrote::

    PYTHONPATH=benchmarks python -m pytest -q -n 2 --dist worksteal -p compile_probe
    python benchmarks/compile_probe.py --out benchmarks/results/compile_probe_cold

For a cold run, point ``TMPDIR`` at an empty directory first (the suite's persistent
compilation cache lives there). ``COMPILE_PROBE_DIR`` (default ``$TMPDIR/compile_probe``) is
where the workers write. Each backend compile (``/jax/core/compile/backend_compile_duration``)
and each trace to a jaxpr (``.../jaxpr_trace_duration``) is added to the test running at the
time, and each lowering to StableHLO (``.../jaxpr_to_mlir_module_duration``); compiles under
:data:`SMALL` seconds are counted apart (op-by-op programs: eager ``jnp`` calls compile one
program per primitive and shape), and each is charged, with its lowering, to the code that asked
for it: the innermost frames in ``lowmem_jax/`` and in ``tests/`` (the summary's callers table
says where jitting a function, or not calling it eagerly, would save the most). JAX records
tracing for outermost traces only. CLI subprocesses are not seen.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

#: Compiles shorter than this (seconds) count as small (op-by-op programs, tiny jits).
SMALL = 0.15
_CURRENT: dict[str, str] = {"test": "(outside a test)"}
_STATS: dict[str, dict[str, float]] = {}
_CALLERS: dict[str, list[float]] = {}  # caller -> [small programs, lower + compile seconds]
_LAST_LOWER = [0.0]
KEYS = ("compiles", "compile_s", "small", "small_s", "trace_s", "lower_s")


def _out_dir() -> str:
    return os.environ.get("COMPILE_PROBE_DIR") or os.path.join(
        tempfile.gettempdir(), "compile_probe"
    )


def _caller() -> str:
    """``library function <- test function`` of the code that asked for the program."""
    frame, library = sys._getframe(2), None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if library is None and "/lowmem_jax/" in path and "site-packages" not in path:
            library = f"{path.split('/lowmem_jax/')[1]}:{name}"
        if "/tests/" in path:
            return f"{library or '(the test, flax or jax)'} <- {path.split('/tests/')[1]}:{name}"
        frame = frame.f_back
    return f"{library or '?'} <- ?"


def _listener(event: str, duration: float, **_: object) -> None:
    kind = event.rsplit("/", 1)[-1]
    if kind not in ("backend_compile_duration", "jaxpr_trace_duration",
                    "jaxpr_to_mlir_module_duration"):  # fmt: skip
        return
    s = _STATS.setdefault(_CURRENT["test"], dict.fromkeys(KEYS, 0))
    if kind == "jaxpr_trace_duration":
        s["trace_s"] += duration
        return
    if kind == "jaxpr_to_mlir_module_duration":
        s["lower_s"] += duration
        _LAST_LOWER[0] = duration
        return
    s["compiles"] += 1
    s["compile_s"] += duration
    if duration < SMALL:
        s["small"] += 1
        s["small_s"] += duration
        entry = _CALLERS.setdefault(_caller(), [0, 0.0])
        entry[0] += 1
        entry[1] += duration + _LAST_LOWER[0]


def pytest_configure(config) -> None:  # noqa: ARG001 -- pytest's hook signature
    import jax

    jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_setup(item) -> None:
    _CURRENT["test"] = item.nodeid


def pytest_sessionfinish(session) -> None:  # noqa: ARG001
    os.makedirs(_out_dir(), exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(_out_dir(), f"probe_{worker}.json"), "w") as f:
        json.dump(_STATS, f)
    with open(os.path.join(_out_dir(), f"callers_{worker}.json"), "w") as f:
        json.dump(_CALLERS, f)


def summarize(
    stats: dict[str, dict[str, float]], callers: dict[str, list[float]] | None = None, top: int = 15
) -> dict:
    """Totals, per test file, the ``top`` tests by small-compile time and the ``top`` callers
    of small programs by their lowering + compile seconds."""
    totals = {k: sum(s[k] for s in stats.values()) for k in KEYS}
    files: dict[str, dict[str, float]] = {}
    for test, s in stats.items():
        f = files.setdefault(test.split("::")[0], dict.fromkeys(KEYS, 0))
        for k in KEYS:
            f[k] += s[k]
    order = sorted(files, key=lambda f: -files[f]["compile_s"])
    tests = sorted(stats, key=lambda t: -stats[t]["small_s"])[:top]
    ranked = sorted((callers or {}).items(), key=lambda c: -c[1][1])[:top]
    return {
        "totals": totals,
        "files": {f: files[f] for f in order},
        "top_small": {t: stats[t] for t in tests},
        "small_callers": {c: {"programs": n, "seconds": s} for c, (n, s) in ranked},
    }


def to_markdown(summary: dict, note: str) -> str:
    t = summary["totals"]
    lines = [
        "# The suite's XLA compiles and traces, per test file",
        "",
        note,
        "",
        f"Totals: {t['compiles']:,} compiles, {t['compile_s']:.0f} s; {t['small']:,} of them "
        f"under {SMALL} s ({t['small_s']:.0f} s); tracing {t['trace_s']:.0f} s; lowering "
        f"{t['lower_s']:.0f} s. Seconds summed over the workers (2 workers share 2 cores).",
        "",
        "| file | compiles | compile s | small compiles | small s | trace s | lower s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for f, s in summary["files"].items():
        lines.append(
            f"| {f} | {s['compiles']:,} | {s['compile_s']:.1f} | {s['small']:,} | "
            f"{s['small_s']:.1f} | {s['trace_s']:.1f} | {s['lower_s']:.1f} |"
        )
    lines += ["", "Tests with the most time in small compiles:", ""]
    lines += [f"- {test}: {s['small']:,} small compiles, {s['small_s']:.1f} s"
              for test, s in summary["top_small"].items()]  # fmt: skip
    lines += ["", "Who asks for the small programs (innermost library and test functions):", "",
              "| library function <- test function | programs | lower + compile s |",
              "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {c} | {v['programs']:,} | {v['seconds']:.1f} |"
              for c, v in summary["small_callers"].items()]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output stem: <out>.json, <out>.md")
    parser.add_argument("--note", default="", help="how the run was made (a paragraph)")
    args = parser.parse_args(argv)
    stats: dict[str, dict[str, float]] = {}
    paths = sorted(glob.glob(os.path.join(_out_dir(), "probe_*.json")))
    if not paths:
        print(f"compile_probe.py: error: no probe_*.json in {_out_dir()}", file=sys.stderr)
        return 2
    callers: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as f:
            stats.update(json.load(f))
        worker = os.path.basename(path)[len("probe_") :]
        with open(os.path.join(os.path.dirname(path), "callers_" + worker)) as f:
            for caller, (n, seconds) in json.load(f).items():
                entry = callers.setdefault(caller, [0, 0.0])
                entry[0] += n
                entry[1] += seconds
    summary = summarize(stats, callers)
    with open(f"{args.out}.json", "w") as f:
        json.dump({"note": args.note, **summary}, f, indent=1)
    with open(f"{args.out}.md", "w") as f:
        f.write(to_markdown(summary, args.note))
    print(f"wrote {args.out}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
