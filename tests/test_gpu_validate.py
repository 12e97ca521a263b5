"""benchmarks/gpu_validate.py on CPU: a tiny grid, each configuration in its own process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, load_benchmark

from lowmem_jax.plan import Plan
from lowmem_jax.workloads import analyze_model

SCRIPT = BENCHMARKS / "gpu_validate.py"
TINY = ["--models", "wrn-10-1", "--batch-size", "4", "--image-size", "8", "--repeats", "1"]


@pytest.fixture(scope="module")
def gpu_validate():
    return load_benchmark("gpu_validate")


@pytest.mark.slow
def test_tiny_grid_on_cpu_measures_each_config_as_lowmem_analyze_compiles_it(
    gpu_validate, tmp_path
):
    argv = ["--out-dir", str(tmp_path), *TINY, "--configs", "baseline", "--inspect"]
    assert gpu_validate.main(argv) == 0
    result = json.loads((tmp_path / "validate_cpu.json").read_text())
    assert (tmp_path / "validate_cpu.png").stat().st_size > 0
    assert result["backend"] == "cpu" and result["command"].startswith("python benchmarks/")
    (model,) = result["models"]
    plain, baseline = model["configs"]
    assert (plain["name"], baseline["name"]) == ("plain", "baseline")  # plain always runs first
    assert plain["config"]["plain"] is True and baseline["config"]["precision"] == "fp32"
    # The step each process ran compiles to the figures `lowmem analyze` reports for it.
    assert baseline["xla"] == analyze_model("wrn-10-1", 4, Plan(), image_size=8).xla
    assert plain["xla"] == analyze_model("wrn-10-1", 4, None, image_size=8).xla
    for r in (plain, baseline):
        assert r["runtime_peak_bytes"] is None  # the CPU backend keeps no memory statistics
        assert r["runtime_peak_after_init_bytes"] is None  # no statistics on CPU
        assert 0 < r["inspected"]["peak_bytes"] <= r["xla"]["total_bytes"]
        assert r["inspected"]["by_category"]["parameter"] > 0
        assert r["reduction_runtime_vs_plain"] is None
        assert r["step_seconds"] > 0 and r["loss"] > 0
    assert plain["reduction_xla_vs_plain"] == 1.0 and plain["time_vs_plain"] == 1.0
    expected = plain["xla"]["total_bytes"] / baseline["xla"]["total_bytes"]
    assert baseline["reduction_xla_vs_plain"] == pytest.approx(expected)
    table = (tmp_path / "validate_cpu.md").read_text()
    assert "| baseline |" in table and "n/a" in table


def test_a_config_that_fails_is_recorded_and_the_run_goes_on(gpu_validate, tmp_path):
    args = ["--out-dir", str(tmp_path), *TINY, "--configs", "baseline", "--timeout", "0.01"]
    assert gpu_validate.main(args) == 0
    rows = json.loads((tmp_path / "validate_cpu.json").read_text())["models"][0]["configs"]
    assert [r["error"] for r in rows] == ["timed out after 0.01 s"] * 2
    assert all(r["reduction_xla_vs_plain"] is None for r in rows)
    assert "error: timed out" in (tmp_path / "validate_cpu.md").read_text()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--configs", "remat nonsense"], "unknown --configs ['remat nonsense'] for wrn-10-1"),
        (["--models", "resnet-50"], "--models: Unknown model='resnet-50'"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, match):
    base = ["--out-dir", str(tmp_path), "--models", "wrn-10-1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *base, *args], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert match in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


def test_help_names_the_output():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--out-dir" in proc.stdout
