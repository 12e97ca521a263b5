"""benchmarks/gpu_validate.py on CPU: a tiny grid, each configuration in its own process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import BENCHMARKS, load_benchmark

from lowmem_jax.compose.plan import Plan
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
    argv = ["--out-dir", str(tmp_path), *TINY, "--configs", "baseline", "--inspect", "--jobs", "2"]
    assert gpu_validate.main(argv) == 0
    result = json.loads((tmp_path / "validate_cpu.json").read_text())
    assert (tmp_path / "validate_cpu.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.lock")) and result["jobs"] == 2  # the lock is removed
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
        assert "state.params" in r["inspected"]["top_buffers"]  # which buffers, by source
        assert r["reduction_runtime_vs_plain"] is None
        assert r["step_seconds"] > 0 and r["loss"] > 0
    assert plain["reduction_xla_vs_plain"] == 1.0 and plain["time_vs_plain"] == 1.0
    expected = plain["xla"]["total_bytes"] / baseline["xla"]["total_bytes"]
    assert baseline["reduction_xla_vs_plain"] == pytest.approx(expected)
    table = (tmp_path / "validate_cpu.md").read_text()
    assert "| baseline |" in table and "n/a" in table


@pytest.mark.slow
def test_two_phases_compile_into_the_cache_then_measure_from_it(gpu_validate, tmp_path):
    # What a GPU run does (there the autotuner's buffers stay out of the measuring process).
    spec = {"model": "wrn-10-1", "batch_size": 4, "seq_len": 40, "image_size": 8,
            "repeats": 1, "name": "baseline", "inspect": False, "lock": None}  # fmt: skip
    cache = tmp_path / "cache"
    row = gpu_validate.run_fresh(spec, 300.0, str(cache))
    assert "error" not in row, row
    assert any(cache.iterdir())  # the first process wrote the executables
    assert row["compile_seconds"] > 0 and row["cached_compile_seconds"] > 0
    assert row["xla"] == analyze_model("wrn-10-1", 4, Plan(), image_size=8).xla
    assert row["step_seconds"] > 0 and row["loss"] > 0


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
        (["--configs", "headline"], "step_cost.json has no headline row of wrn-10-1"),
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


def test_headline_configs_are_the_readme_headline_rows_of_each_model(gpu_validate):
    """``--configs headline``: plain, baseline and the rows the README headline shows (the
    committed step_cost.json lists them), every one a row of the model's grid."""
    from experiments.envelope_accuracy import headline_table

    readme_rows = set(re.findall(r"\| `([^`]+)` \|", headline_table()))
    for model, batch_size in (("wrn-28-2", 128), ("dynamicconv-iwslt", 100)):
        names = gpu_validate.headline_names(model)
        assert names[:2] == ["plain", "baseline"] and len(names) >= 4
        assert set(names[2:]) <= readme_rows
        assert set(names) <= set(gpu_validate.grid_names(model, batch_size))
    shown = {n for m in ("wrn-28-2", "dynamicconv-iwslt") for n in gpu_validate.headline_names(m)}
    assert readme_rows <= shown


def test_the_offload_rows_keep_the_optimizer_state_in_host_memory(gpu_validate):
    """``--configs offload``: rows outside the report grid, each a plan that keeps the
    optimizer state in ``pinned_host`` memory between steps; one measured here as a worker
    measures it (on a GPU its runtime peak shows what leaving the state on the host saves)."""
    names = gpu_validate.grid_names("wrn-10-1", 4)
    assert list(gpu_validate.OFFLOAD_ROWS) == names[-len(gpu_validate.OFFLOAD_ROWS) :]
    spec = {"model": "wrn-10-1", "batch_size": 4, "seq_len": 40, "image_size": 8,
            "name": "state in host memory", "repeats": 1}  # fmt: skip
    row = gpu_validate.measure(spec)
    assert row["config"]["optimizer_memory"] == "pinned_host" and row["step_seconds"] > 0
    assert row["loss"] > 0 and row["xla"]["total_bytes"] > 0


def test_help_names_the_output():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--out-dir" in proc.stdout


def _mib(row, key="total"):
    """A row's XLA total (or runtime peak, ``key="peak"``) in MiB as the docs quote it."""
    value = row["xla"]["total_bytes"] if key == "total" else row["runtime_peak_bytes"]
    return f"{value / 2**20:,.1f}"


def _x(row, key="reduction_xla_vs_plain", digits=1):
    """A row's ratio as the docs quote it (``12.3x``)."""
    return f"{row[key]:.{digits}f}x"


def test_the_gpu_figures_quoted_are_the_committed_run_s():
    root = BENCHMARKS.parent
    gpu = json.loads((root / "benchmarks/results/validate_gpu.json").read_text())
    rows = {(m["model"], c["name"]): c for m in gpu["models"] for c in m["configs"]}
    assert "H200" in gpu["device"] and gpu["backend"] == "gpu"

    def mib(model, name):
        return _mib(rows[model, name])

    def x(name):
        return _x(rows["wrn-28-2", name])

    best = "fp16 + mb 2 + remat full + sparse 90% + uint8 input"
    inside = "mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input"
    static = "fp16 + mb 2 + remat full + static sparse 70%"
    measured = " ".join((root / "docs/measured.md").read_text().split())
    assert f"row was {mib('wrn-28-2', best)} MiB (**{x(best)}**" in measured
    assert f"({mib('wrn-28-2', 'plain')} vs" in measured
    dsr70 = "fp16 + mb 2 + remat full + sparse 70%"
    compare = load_benchmark("backend_compare")
    wrn_report = json.loads((root / compare.REPORTS[0]).read_text())
    (wrn,) = compare.compare(gpu, [wrn_report])
    cpu = {r["name"]: r["cpu_total_bytes"] / 2**20 for r in wrn["rows"]}
    assert (f"DSR {mib('wrn-28-2', dsr70)} MiB against a static mask's {mib('wrn-28-2', static)}; "
            f"on XLA:CPU {cpu[dsr70]:.1f} against {cpu[static]:.1f}") in measured  # fmt: skip
    assert f"{mib('wrn-28-2', inside)} MiB ({x(inside)}" in measured
    assert f"{mib('wrn-28-2', static)} MiB ({x(static)}" in measured
    tables = load_benchmark("validate_results")
    md = (root / "benchmarks/results/validate_gpu.md").read_text()
    assert md == tables.to_markdown(gpu)  # the table is the JSON's
    # The comparison table is what backend_compare.py makes of the committed files.
    reports = [json.loads((root / p).read_text()) for p in compare.REPORTS]
    committed = json.loads((root / f"{compare.OUT}.json").read_text())
    assert committed["models"] == json.loads(json.dumps(compare.compare(gpu, reports)))


def _headline_runs() -> dict:
    """The committed headline runs' models, each file checked against its JSON: the run of the
    headline rows of now (validate_gpu_headline.*), the one at 49ad0a3 (the rows of then, after
    the radix select), a8ab060 (kept for its static-mask and state rows) and 75c2b49 (the first,
    kept for its act rows)."""
    root = BENCHMARKS.parent
    tables = load_benchmark("validate_results")
    compare = load_benchmark("backend_compare")
    reports = [json.loads((root / p).read_text()) for p in compare.REPORTS]
    runs = {}
    for stem in ("validate_gpu_headline", "validate_gpu_headline_49ad0a3",
                 "validate_gpu_headline_a8ab060", "validate_gpu_headline_75c2b49"):  # fmt: skip
        run = json.loads((root / f"benchmarks/results/{stem}.json").read_text())
        assert "H200" in run["device"] and run["backend"] == "gpu"
        assert all(m["configs"][0]["name"] == "plain" and "made_by" in m for m in run["models"])
        assert (root / f"benchmarks/results/{stem}.md").read_text() == tables.to_markdown(run)
        vs_cpu = json.loads((root / f"benchmarks/results/{stem}_vs_cpu.json").read_text())
        assert vs_cpu["models"] == json.loads(json.dumps(compare.compare(run, reports)))
        runs[stem] = run["models"]
    return runs


def _config(model, name):
    return next(c for c in model["configs"] if c["name"] == name)


def _config_mib(model, name, key="total"):
    """:func:`_mib` of ``model``'s configuration ``name`` (a run's model section)."""
    return _mib(_config(model, name), key)


def _config_x(model, name, key="reduction_xla_vs_plain"):
    """:func:`_x` of ``model``'s configuration ``name``."""
    return _x(_config(model, name), key)


def test_the_headline_rows_of_now_on_a_gpu_are_quoted_from_their_run():
    root = BENCHMARKS.parent
    wrn, dc = _headline_runs()["validate_gpu_headline"]
    # The README headline's rows, as step_cost.json lists them, are the run's rows.
    cost = json.loads((root / "experiments/results/envelope_accuracy/step_cost.json").read_text())
    for model, task in ((wrn, "digits"), (dc, "translation")):
        names = [c["name"] for c in model["configs"]]
        assert names == ["plain", *(r["name"] for r in cost["tasks"][task])]

    mib, x = _config_mib, _config_x

    inside, best = (r["name"] for r in cost["tasks"]["digits"])
    dc_inside, dc_best, dc_within = (r["name"] for r in cost["tasks"]["translation"])
    runtime = "reduction_runtime_vs_plain"
    readme = " ".join((root / "README.md").read_text().split())
    assert (f"**{x(wrn, best)}** ({mib(wrn, best)} of {mib(wrn, 'plain')} MiB) and "
            f"**{x(dc, dc_best)}** (transformer, {mib(dc, dc_best)} of "
            f"{mib(dc, 'plain')} MiB), in-envelope {x(wrn, inside)} and "
            f"{x(dc, dc_inside)}") in readme  # fmt: skip
    time = [f"{_config(m, n)['time_vs_plain']:.1f}x" for m, n in ((wrn, inside), (dc, dc_inside))]
    assert f"at {time[0]} and {time[1]} the plain step's time there" in readme
    measured = " ".join((root / "docs/measured.md").read_text().split())
    for quoted in (
        f"any-envelope row is {mib(wrn, best)} MiB (**{x(wrn, best)}**",
        f"in-envelope row {mib(wrn, inside)} MiB (**{x(wrn, inside)}**; XLA:CPU 29.2x; runtime "
        f"peak {mib(wrn, inside, 'peak')} of {mib(wrn, 'plain', 'peak')} MiB, "
        f"{x(wrn, inside, runtime)})",
        f"compiles to {mib(dc, 'plain')} MiB there",
        f"{mib(dc, dc_best)} MiB (**{x(dc, dc_best)}**; XLA:CPU 20.5x; runtime peak "
        f"{mib(dc, dc_best, 'peak')} of {mib(dc, 'plain', 'peak')} MiB, "
        f"{x(dc, dc_best, runtime)})",
        f"in-envelope {mib(dc, dc_inside)} (**{x(dc, dc_inside)}**; XLA:CPU 9.0x; runtime "
        f"{x(dc, dc_inside, runtime)})",
        f"{mib(dc, dc_within)} (**{x(dc, dc_within)}**; XLA:CPU 15.4x; runtime "
        f"{x(dc, dc_within, runtime)})",
    ):
        assert quoted in measured, quoted


def _offload_run(stem: str):
    """(run, {(model, config): (section, row)}) of a committed offload run, its table checked."""
    root = BENCHMARKS.parent
    run = json.loads((root / f"benchmarks/results/{stem}.json").read_text())
    assert "H200" in run["device"]
    md = (root / f"benchmarks/results/{stem}.md").read_text()
    assert md == load_benchmark("validate_results").to_markdown(run)
    rows = {(m["model"], c["name"]): (m, c) for m in run["models"] for c in m["configs"]}
    return run, rows


def _mib(row, key="total") -> str:
    value = row["xla"]["total_bytes"] if key == "total" else row["runtime_peak_bytes"]
    return f"{value / 2**20:,.1f}"


def test_the_offload_runs_figures_quoted_are_their_own():
    root = BENCHMARKS.parent
    measured = " ".join((root / "docs/measured.md").read_text().split())
    _, first = _offload_run("validate_gpu_offload_b8fa9e8")
    for model, plain_mib in (("wrn-28-2", "484.9"), ("dynamicconv-iwslt", "2,338.8")):
        m, row = first[model, "state in host memory"]
        assert f"{plain_mib} -> {_mib(row)}" in measured
        assert _mib(m["configs"][0]) == plain_mib
    _, now = _offload_run("validate_gpu_offload")
    dc, row = now["dynamicconv-iwslt", "state and update on the host"]
    plain = dc["configs"][0]
    saved = (plain["xla"]["total_bytes"] - row["xla"]["total_bytes"]) / 2**20
    saved_peak = (plain["runtime_peak_bytes"] - row["runtime_peak_bytes"]) / 2**20
    ratios = [_x(row, key, 2) for key in ("reduction_xla_vs_plain", "reduction_runtime_vs_plain")]
    assert (
        f"the transformer's falls by {saved:.1f} MiB ({ratios[0]}; runtime peak by "
        f"{saved_peak:.1f} MiB, {ratios[1]}) at {row['time_vs_plain']:.1f}x"
    ) in measured
    _, row = now["dynamicconv-iwslt", "state in host memory"]
    saved = (plain["xla"]["total_bytes"] - row["xla"]["total_bytes"]) / 2**20
    assert f"falls {saved:.1f} MiB ({_mib(plain)} -> {_mib(row)}, {_x(row, digits=2)}" in measured
    _, row = now["wrn-28-2", "state in host memory"]
    assert f"(484.9 -> {_mib(row)}: its step is activations)" in measured
    # Weight streaming against the same plan with the weights on the device.
    without, streamed = (
        "remat full + state and update on the host",
        "remat full + weights, state and update on the host",
    )  # noqa: E501
    _, a = now["dynamicconv-iwslt", without]
    _, b = now["dynamicconv-iwslt", streamed]
    saved = (a["xla"]["total_bytes"] - b["xla"]["total_bytes"]) / 2**20
    assert (
        f"{_mib(a)} -> {_mib(b)} MiB ({saved:.1f} MiB less; runtime peak {_mib(a, 'peak')} -> "
        f"{_mib(b, 'peak')})"
    ) in measured
    saved_peak = (a["runtime_peak_bytes"] - b["runtime_peak_bytes"]) / 2**20
    readme = (root / "README.md").read_text()
    assert f"step {saved:.1f} MiB smaller compiled, {saved_peak:.1f} at runtime" in readme
    _, a = now["wrn-28-2", without]
    _, b = now["wrn-28-2", streamed]
    assert f"{_mib(a)} -> {_mib(b)} (runtime {_mib(a, 'peak')} -> {_mib(b, 'peak')})" in measured


def test_the_weight_streaming_probe_s_figures_quoted_are_its_own():
    root = BENCHMARKS.parent
    measured = " ".join((root / "docs/measured.md").read_text().split())
    ws = load_benchmark("weight_streaming")

    def total(r):
        x = r["xla"]
        return (x["argument_size_in_bytes"] + x["output_size_in_bytes"]
                + x["temp_size_in_bytes"] - x["alias_size_in_bytes"]) / 2**20  # fmt: skip

    runs = {}
    for stem in ("weight_streaming_gpu", "weight_streaming_gpu_autotune0"):
        run = json.loads((root / f"benchmarks/results/{stem}.json").read_text())
        assert (root / f"benchmarks/results/{stem}.md").read_text() == ws._table(run)
        rows = runs[stem] = {r["config"]: r for r in run["rows"]}
        for r in rows.values():  # the same arithmetic wherever the weights live
            np.testing.assert_allclose(r["losses"], rows["device"]["losses"], atol=1e-7, rtol=0)
    rows = runs["weight_streaming_gpu"]
    assert f"falls from {total(rows['device']):,.1f} to {total(rows['stream']):.1f} MiB" in measured
    assert f"{total(rows['stream_saved']):.1f} with the move outside" in measured
    stream = rows["stream"]
    # Autotuning while compiling set the peak: the steps did not raise it.
    assert stream["runtime_peak_bytes"] == stream["runtime_peak_after_init_bytes"]
    assert (
        f"the runtime peak, {stream['runtime_peak_bytes'] / 2**20:.1f} MiB, was reached" in measured
    )
    rows = runs["weight_streaming_gpu_autotune0"]
    stream = rows["stream"]
    assert stream["runtime_peak_bytes"] > stream["runtime_peak_after_init_bytes"]  # the step's own
    block = 4 * 2048 * 2048
    assert (
        f"{stream['runtime_peak_bytes'] / 2**20:.1f} MiB "
        f"({stream['runtime_peak_bytes'] / block:.1f} blocks; compiled {total(stream):.1f}) "
        f"against the device-resident step's {rows['device']['runtime_peak_bytes'] / 2**20:,.1f}"
    ) in measured


def test_the_headline_run_of_49ad0a3_s_figures_quoted_are_its_own():
    root = BENCHMARKS.parent
    runs = _headline_runs()
    wrn, dc = runs["validate_gpu_headline_49ad0a3"]
    _, dc_before = runs["validate_gpu_headline_a8ab060"]
    earlier_wrn, _, dc_act = runs["validate_gpu_headline_75c2b49"]

    row, mib, x = _config, _config_mib, _config_x

    best, inside = ("fp16 + mb 2 + remat full + sparse 90% + uint8 input",
                    "mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input")  # fmt: skip
    dc_best, dc_inside, dc_static = ("fp16 + mb 2 + remat full + sparse 90%",
                                     "mb 10 + remat dots + state bf16 + sparse 70%",
                                     "fp16 + mb 2 + remat full + static sparse 70%")  # fmt: skip
    measured = " ".join((root / "docs/measured.md").read_text().split())
    runtime = "reduction_runtime_vs_plain"
    assert row(wrn, best)[runtime] is None  # initialisation set that process's peak
    for quoted in (
        f"any-envelope row is {mib(wrn, best)} MiB (**{x(wrn, best)}**",
        f"in-envelope row {mib(wrn, inside)} MiB (**{x(wrn, inside)}**",
        f"plain {mib(wrn, 'plain', 'peak')} MiB, in-envelope {mib(wrn, inside, 'peak')} "
        f"({x(wrn, inside, runtime)}); the any-envelope row's process peaked at "
        f"{mib(wrn, best, 'peak')} MiB during initialisation",
        f"compiles to {mib(dc, 'plain')} MiB on XLA:GPU",
        f"is {mib(dc, dc_best)} MiB (**{x(dc, dc_best)}**",
        f"runtime peak {mib(dc, dc_best, 'peak')} of {mib(dc, 'plain', 'peak')} MiB, "
        f"{x(dc, dc_best, runtime)})",
        f"static 70% mask {mib(dc_before, dc_static)} MiB ({x(dc_before, dc_static)}",
        f"in-envelope row {mib(dc, dc_inside)} MiB (**{x(dc, dc_inside)}**",
        f"`act int8` {mib(earlier_wrn, 'act int8')} MiB and `act int2` "
        f"{mib(earlier_wrn, 'act int2')} ({x(earlier_wrn, 'act int8')[:-1]}x and "
        f"{x(earlier_wrn, 'act int2')}; `remat full` {mib(earlier_wrn, 'remat full')})",
        f"`act bf16` {mib(dc_act, 'act bf16')} MiB, above plain "
        f"({row(dc_act, 'act bf16')['reduction_xla_vs_plain']:.2f}x",
        f"`act int8` {mib(dc_act, 'act int8')} "
        f"({row(dc_act, 'act int8')['reduction_xla_vs_plain']:.2f}x)",
    ):
        assert quoted in measured, quoted


def test_the_act_and_time_runs_figures_quoted_are_their_own():
    # benchmarks/results/validate_gpu_{act,time}.*: two later calls on one H200, each merged.
    root = BENCHMARKS.parent
    tables = load_benchmark("validate_results")
    compare = load_benchmark("backend_compare")
    reports = [json.loads((root / p).read_text()) for p in compare.REPORTS]
    runs = {}
    for stem in ("validate_gpu_act", "validate_gpu_time", "validate_gpu_transformer_grid"):
        run = json.loads((root / f"benchmarks/results/{stem}.json").read_text())
        assert "H200" in run["device"] and run["backend"] == "gpu"
        assert (root / f"benchmarks/results/{stem}.md").read_text() == tables.to_markdown(run)
        vs_cpu = json.loads((root / f"benchmarks/results/{stem}_vs_cpu.json").read_text())
        assert vs_cpu["models"] == json.loads(json.dumps(compare.compare(run, reports)))
        runs[stem] = {(m["model"], c["name"]): c for m in run["models"] for c in m["configs"]}
    act, time = runs["validate_gpu_act"], runs["validate_gpu_time"]

    def mib(rows, model, name):
        return _mib(rows[model, name])

    def x(rows, model, name):
        return _x(rows[model, name], digits=2)

    dc = "dynamicconv-iwslt"
    measured = " ".join((root / "docs/measured.md").read_text().split())
    for quoted in (
        f"has them at {mib(act, dc, 'act bf16')} MiB ({x(act, dc, 'act bf16')}) and "
        f"{mib(act, dc, 'act int8')} ({x(act, dc, 'act int8')}), `act int2` "
        f"{mib(act, dc, 'act int2')} ({x(act, dc, 'act int2')};",
        f"`remat full` 214.1 then {mib(act, 'wrn-28-2', 'remat full')} MiB",
    ):
        assert quoted in measured, quoted
    inspected = act["wrn-28-2", "plain"]["inspected"]["by_category"]
    assert f"puts {inspected['saved residual'] / 2**20:.1f} of plain's" in measured
    wrn_in, wrn_any = ("mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input",
                       "fp16 + mb 2 + remat full + sparse 90% + uint8 input")  # fmt: skip
    dc_in, dc_static = ("mb 10 + remat dots + state bf16 + sparse 70%",
                        "fp16 + mb 2 + remat full + static sparse 70%")  # fmt: skip
    t = {k: f"{time[k]['time_vs_plain']:.1f}x" for k in time}
    assert (f"rows take {t['wrn-28-2', wrn_in]} (WideResNet) and {t[dc, dc_in]} (transformer) the "
            f"plain step's time and the least-memory rows {t['wrn-28-2', wrn_any][:-1]}x and "
            f"{t[dc, dc_static]}") in measured  # fmt: skip


def _row(name, total, peak=None):
    return {"name": name, "xla": {"total_bytes": total}, "runtime_peak_bytes": peak,
            "runtime_peak_after_init_bytes": None, "step_seconds": 0.01}  # fmt: skip


def test_a_table_written_before_plain_has_finished_shows_no_ratio(tmp_path):
    tables = load_benchmark("validate_results")
    plans = [("m", 4, ["plain", "baseline"])]
    result = {"backend": "gpu", "device": "d", "repeats": 1, "command": "c", "jobs": 2}
    # The first configuration to finish is not plain: its ratios are n/a until plain is in.
    tables.write(result, plans, {("m", "baseline"): _row("baseline", 2**20, 2**21)},
                 str(tmp_path / "v"), plot_too=False)  # fmt: skip
    assert (
        "| baseline | 1.0 | 2.0 | yes | n/a | n/a | 10.0 | n/a |" in (tmp_path / "v.md").read_text()
    )


def test_merged_runs_keep_each_section_s_own_plain_and_command(tmp_path):
    tables = load_benchmark("validate_results")
    runs = []
    for i, plain_bytes in enumerate((4 * 2**20, 8 * 2**20)):
        rows = [_row("plain", plain_bytes, plain_bytes), _row("baseline", 2**20, 2**20)]
        tables.add_ratios(rows)
        run = {"backend": "gpu", "device": "H200", "jax_version": "0.11", "repeats": 5,
               "before_step": "init", "command": f"run {i}", "jobs": 3 + i,
               "models": [{"model": "m", "batch_size": 4, "configs": rows}]}  # fmt: skip
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(run))
        runs.append(str(path))
    out = tmp_path / "merged"
    assert tables.main(["--out", str(out), "--note", "why", *runs]) == 0
    merged = json.loads(out.with_suffix(".json").read_text())
    assert [m["made_by"] for m in merged["models"]] == ["run 0", "run 1"]
    assert [m["configs"][1]["reduction_xla_vs_plain"] for m in merged["models"]] == [4.0, 8.0]
    md = out.with_suffix(".md").read_text()
    assert "Made by: `run 1` (4 configurations at once" in md and "\nwhy\n" in md
    assert out.with_suffix(".png").stat().st_size > 0
    # Merged again with a later run: the earlier sections keep their commands and notes.
    again = tmp_path / "again"
    assert tables.main(["--out", str(again), "--note", "later", str(out.with_suffix(".json")),
                        runs[0]]) == 0  # fmt: skip
    merged_again = json.loads(again.with_suffix(".json").read_text())
    assert [m["made_by"] for m in merged_again["models"]] == ["run 0", "run 1", "run 0"]
    assert merged_again["notes"] == ["why", "later"]
    other = json.loads(open(runs[1]).read())
    other["device"] = "H100"
    (tmp_path / "r1.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"differ in \['device'\]"):
        tables.merge([json.loads(open(p).read()) for p in runs], [], "c")


def test_configs_names_with_a_comma_of_their_own_are_kept_whole():
    gv = load_benchmark("gpu_validate")
    names = gv.grid_names("wrn-28-2", 128)
    streamed = "remat full + weights, state and update on the host"
    assert streamed in names
    got = gv.split_names(f"plain,{streamed},remat full", names)
    assert got == ["plain", streamed, "remat full"]
    assert gv.split_names("plain,,remat full", names) == ["plain", "remat full"]
