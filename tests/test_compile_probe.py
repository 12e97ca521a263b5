"""benchmarks/compile_probe.py: JAX's compile events added to the test running, summed per
file, and a one-line error where no worker wrote anything."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BENCHMARKS, load_benchmark


def test_a_compile_and_its_trace_count_against_the_running_test(monkeypatch, tmp_path):
    probe = load_benchmark("compile_probe")
    monkeypatch.setenv("COMPILE_PROBE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "SMALL", 60.0)  # every program here is small, however busy
    jax.monitoring.register_event_duration_secs_listener(probe._listener)
    try:
        probe._CURRENT["test"] = "tests/test_x.py::test_a"
        # A constant of this run's: a program the persistent cache cannot hold from another.
        unique = float(time.time_ns() % 1_000_003)
        jax.jit(lambda x: jnp.sin(x) * unique)(np.arange(7.0))
    finally:
        jax.monitoring.unregister_event_duration_listener(probe._listener)
    probe.pytest_sessionfinish(None)
    (written,) = tmp_path.glob("probe_*.json")
    stats = json.loads(written.read_text())["tests/test_x.py::test_a"]
    assert stats["compiles"] == stats["small"] == 1
    assert stats["compile_s"] > 0 and stats["trace_s"] > 0 and stats["lower_s"] > 0
    # The small program is charged, with its lowering, to the test function that asked for it.
    (callers,) = tmp_path.glob("callers_*.json")
    asked = "(the test, flax or jax) <- test_compile_probe.py:" + (
        "test_a_compile_and_its_trace_count_against_the_running_test"
    )
    n, seconds = json.loads(callers.read_text())[asked]
    assert n == 1 and seconds == pytest.approx(stats["compile_s"] + stats["lower_s"])
    summary = probe.summarize(
        {"tests/test_x.py::test_a": stats, "tests/test_x.py::test_b": stats}, {asked: [n, seconds]}
    )
    assert summary["files"]["tests/test_x.py"]["compiles"] == 2 * stats["compiles"]
    markdown = probe.to_markdown(summary, "note")
    assert "| tests/test_x.py |" in markdown and f"| {asked} | 1 |" in markdown


def test_no_probe_files_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    probe = load_benchmark("compile_probe")
    monkeypatch.setenv("COMPILE_PROBE_DIR", str(tmp_path))
    assert probe.main(["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no probe_*.json" in err


def test_the_figures_quoted_are_the_committed_run_s():
    root = BENCHMARKS.parent
    run = json.loads((root / "benchmarks/results/compile_probe_cold.json").read_text())
    t = run["totals"]
    commands = " ".join((root / "docs/commands.md").read_text().split())
    assert (f"{t['compile_s']:.0f} s of the workers' time in {t['compiles']:,} XLA compiles, "
            f"{t['small_s']:.0f} s of it in {t['small']:,} programs") in commands  # fmt: skip
    assert f"{t['trace_s']:.0f} s tracing" in commands
    md = (root / "benchmarks/results/compile_probe_cold.md").read_text()
    assert md == load_benchmark("compile_probe").to_markdown(run, run["note"])
