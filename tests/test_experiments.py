"""The study's machinery: pairing by seed, resumable runs, the RQ4 mapping and greedy search."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import types

import pytest

from experiments import rq4_search, study
from lowmem_jax.compose.plan import Plan
from lowmem_jax.report.grid import standard_grid
from lowmem_jax.techniques.factorize import FactorConfig
from lowmem_jax.training.checkpointing import checkpoint_steps
from lowmem_jax.training.loop import TrainConfig


def _record(name, seed, value, technique="precision"):
    return {
        "name": name,
        "technique": technique,
        "setting": name,
        "seed": seed,
        "metric": "test_accuracy",
        "value": value,
        "train_seconds": 1.0,
    }


def test_summarize_pairs_each_variant_with_the_baseline_of_the_same_seed():
    records = {
        "baseline_seed0": _record("baseline", 0, 0.90, "baseline"),
        "baseline_seed1": _record("baseline", 1, 0.80, "baseline"),
        "x_seed0": _record("x", 0, 0.91),
        "x_seed1": _record("x", 1, 0.78),
        "x_seed2": _record("x", 2, 0.50),  # no baseline for seed 2: not paired
    }
    rows = {r["name"]: r for r in study.summarize(records)}
    d = rows["x"]["delta_vs_baseline"]
    assert d["mean"] == pytest.approx((0.01 - 0.02) / 2)
    assert d["min"] == pytest.approx(-0.02) and d["max"] == pytest.approx(0.01)
    assert rows["x"]["value"]["mean"] == pytest.approx((0.91 + 0.78 + 0.50) / 3)
    assert rows["baseline"]["delta_vs_baseline"]["mean"] == 0.0


def test_corrected_t_interval_widens_the_naive_one_for_overlapping_training_sets():
    from scipy import stats

    deltas = [0.01, -0.02, 0.0, 0.005, -0.01, 0.02, -0.005, 0.0, 0.01, -0.015]
    low, high = study.corrected_t_interval(deltas, test_fraction=0.2)
    mean, sd, n = sum(deltas) / 10, stats.tstd(deltas), 10
    half = stats.t.ppf(0.975, n - 1) * sd * (1 / n + 0.2 / 0.8) ** 0.5
    assert (low, high) == pytest.approx((mean - half, mean + half))
    naive = stats.t.interval(0.95, n - 1, loc=mean, scale=stats.sem(deltas))
    assert low < naive[0] and high > naive[1]
    with pytest.raises(ValueError, match="at least 2"):
        study.corrected_t_interval([0.1], 0.2)


def test_summarize_cv_pools_each_seeds_folds_and_pairs_each_split():
    def rec(name, seed, fold, correct, n=100):
        r = _record(name, seed, correct / n, "baseline" if name == "baseline" else "combined")
        return {**r, "fold": fold, "folds": 2, "test_examples": n}

    records = {
        study.run_key(r["name"], r["seed"], r["fold"]): r
        for r in [
            rec("baseline", 0, 0, 90),
            rec("baseline", 0, 1, 47, n=50),
            rec("baseline", 1, 0, 80),
            rec("baseline", 1, 1, 85),
            rec("x", 0, 0, 89),
            rec("x", 0, 1, 45, n=50),
            rec("x", 1, 0, 82),  # seed 1 fold 1 missing: no pooled figure, 3 pairs
        ]
    }
    rows = {r["name"]: r for r in study.summarize_cv(records)}
    assert rows["baseline"]["pooled_by_seed"] == {0: pytest.approx((90 + 47) / 150), 1: 0.825}
    assert rows["baseline"]["delta_vs_baseline"] is None
    x = rows["x"]
    assert x["pooled_by_seed"] == {0: pytest.approx((89 + 45) / 150), 1: None}
    d = x["delta_vs_baseline"]
    assert d["pairs"] == 3 and d["mean"] == pytest.approx((-0.01 - 0.04 + 0.02) / 3)
    low, high = study.corrected_t_interval([-0.01, -0.04, 0.02], 0.5)
    assert d["ci95"] == [pytest.approx(low), pytest.approx(high)]
    assert study.run_key("x", 1, 0) == "x_seed1_fold0" and study.run_key("x", 1) == "x_seed1"


@pytest.mark.slow
def test_run_variants_trains_once_and_resumes(tmp_path, monkeypatch):
    tiny = TrainConfig(model="wrn-10-1", image_size=8, epochs=1, batch_size=64, progress=False)
    monkeypatch.setattr(
        study, "base_config", lambda task, seed: dataclasses.replace(tiny, seed=seed)
    )
    variants = [
        study.Variant("baseline", "baseline", "fp32"),
        study.Variant(  # fine-tunes the baseline of its seed, decomposed
            "lowrank",
            "decomposed",
            "low-rank 25%",
            Plan(factorize=FactorConfig("lowrank")),
            decompose=True,
        ),
    ]
    first = study.run_variants("digits", variants, [0], str(tmp_path), log=None)
    assert set(first) == {"baseline_seed0", "lowrank_seed0"}
    assert all(0.0 <= r["value"] <= 1.0 and r["steps"] == 22 for r in first.values())
    assert first["lowrank_seed0"]["decompose"] and not first["baseline_seed0"]["decompose"]
    assert checkpoint_steps(tmp_path / "checkpoints" / "baseline_seed0") == [22]
    assert first["lowrank_seed0"]["param_count"] < first["baseline_seed0"]["param_count"]
    monkeypatch.setattr(
        study, "train_once", lambda *a, **k: pytest.fail("retrained a finished run")
    )
    again = study.run_variants("digits", variants, [0], str(tmp_path), log=None)
    assert again == json.loads(json.dumps(first))


def test_full_size_settings_match_the_memory_grid():
    by_name = {v.name: v for v in study.single_variants("digits")}
    assert rq4_search.full_size("digits", by_name["mb8"]) == (
        "microbatch 8",
        {"microbatches": 16},
        None,
    )
    assert by_name["dsr90"].plan.sparsity.algorithm == "dsr"  # the sparsity is in the plan
    row, plan, sparse = rq4_search.full_size("digits", by_name["dsr90"])
    assert row == "sparse 90% dsr" and plan == {} and sparse.density == pytest.approx(0.1)
    assert rq4_search.full_size("digits", by_name["state_int8"]) == (
        "state int8",
        {"optimizer_state": "int8"},
        None,
    )
    row, plan, sparse = rq4_search.full_size("digits", by_name["dsr90_int8"])
    assert row == "sparse 90% dsr + state int8" and plan == {"optimizer_state": "int8"}
    for task in study.TASKS:  # every single technique maps to a row of the grid, or to none
        batch = rq4_search.MODELS[rq4_search.MODEL_OF[task]][0]
        grid = {name for name, _, _ in standard_grid(batch)}
        for v in study.single_variants(task):
            if v.technique != "baseline":
                assert rq4_search.full_size(task, v)[0] in grid | {None}, v.name
    by_name = {v.name: v for v in study.single_variants("translation")}
    # 8 microbatches of the CPU batch -> at most 12.5 of the 100 rows -> 10 rows, k = 10
    assert rq4_search.full_size("translation", by_name["k8"]) == (
        "microbatch 10",
        {"microbatches": 10},
        None,
    )


def test_greedy_search_adds_what_lowers_xla_memory_and_stops(tmp_path, monkeypatch):
    rq2 = tmp_path / "rq2"
    runs = rq2 / "digits" / "runs"
    runs.mkdir(parents=True)
    values = {
        "baseline": 0.95,
        "mixed_fp16": 0.95,
        "fp16": 0.90,
        "mb8": 0.949,
        "remat_full": 0.95,
        "dsr90": 0.948,
    }  # fp16 is 5 points worse: not admissible at 0.5
    techniques = {v.name: v.technique for v in study.single_variants("digits")}
    for name, value in values.items():
        (runs / f"{name}_seed0.json").write_text(
            json.dumps(_record(name, 0, value, techniques[name]))
        )
    monkeypatch.setattr(rq4_search, "RQ2", str(rq2))
    MiB = 2**20
    single = {
        "baseline": 500,
        "mixed_fp16": 400,
        "fp16": 250,
        "microbatch 8": 100,
        "remat full": 200,
        "sparse 90% dsr": 480,
    }
    rows = [
        {
            "name": n,
            "xla": {"total_bytes": b * MiB, "source": "XLA:CPU"},
            "analytic": {"total_bytes": b * MiB},
            "flops": 1.0,
        }
        for n, b in single.items()
    ]
    monkeypatch.setattr(rq4_search, "load_or_run_report", lambda model: {"configs": rows})

    def fake_analyze(model, batch, plan, seq_len=40):
        sparse = plan.sparsity
        mib = 500.0
        mib *= 0.8 if plan.precision == "mixed_fp16" else 1.0
        mib *= 0.2 if plan.microbatches == 16 else 1.0
        mib *= 0.5 if plan.remat == "full" else 1.0
        mib += 30 if sparse is not None else 0  # rewiring temp: never worth it here
        return types.SimpleNamespace(
            xla={"total_bytes": mib * MiB}, analytic={"total_bytes": mib * MiB}, flops=1.0
        )

    monkeypatch.setattr(rq4_search, "analyze_model", fake_analyze)
    result = rq4_search.search("digits", tolerance=0.5, log=lambda *_: None)
    verdicts = {v["name"]: v["admissible"] for v in result["verdicts"]}
    assert verdicts["fp16"] is False and verdicts["mb8"] and verdicts["dsr90"]
    assert result["chosen"] == ["mb8", "remat_full", "mixed_fp16"]
    assert result["full_size"]["plan"] == {
        "microbatches": 16,
        "remat": "full",
        "precision": "mixed_fp16",
    }
    assert result["full_size"]["reduction_xla"] == pytest.approx(500 / (500 * 0.8 * 0.2 * 0.5))
    assert result["full_size"]["sparse"] is None
    assert os.path.basename(rq4_search.OUT) == "rq4"


def test_envelope_accuracy_trains_the_plans_of_the_memory_rows_it_quotes():
    from experiments import envelope_accuracy
    from experiments.memory_reports import MODELS
    from lowmem_jax.report.grid import model_grid

    for task, (model, _, _) in envelope_accuracy.TASKS.items():
        batch = MODELS[model][0]
        grid = {name: plan for name, _, plan in model_grid(model, batch)}
        for variant, row in envelope_accuracy.variants(task):
            if row is None or row == "plain":
                assert row is None or variant.plan == Plan()
                continue
            full, cpu = grid[row], variant.plan  # the row exists and its settings are trained
            same = ("precision", "remat", "input_dtype", "optimizer_state")
            assert [getattr(cpu, f) for f in same] == [getattr(full, f) for f in same], row
            assert (cpu.sparsity is None) == (full.sparsity is None), row
            if full.sparsity is not None:
                assert cpu.sparsity.algorithm == full.sparsity.algorithm
                assert full.sparsity.algorithm in ("dsr", "static"), row
                assert cpu.sparsity.density == pytest.approx(full.sparsity.density)
                assert cpu.sparsity.compressed and cpu.sparsity.distribution == "uniform"
            if task in envelope_accuracy.IMAGES:  # the same batch, so the same microbatch size
                assert cpu.microbatches == full.microbatches, row


def test_the_headline_s_step_costs_are_of_the_rows_it_shows():
    # experiments/headline_cost.py timed exactly the rows the headline shows, and each row's
    # FLOPs ratio is the committed memory report's count over the plain step's.
    from experiments import envelope_accuracy
    from experiments.headline_cost import PATH
    from experiments.memory_reports import load_or_run_report

    with open(PATH) as f:
        costs = json.load(f)["tasks"]
    with open(os.path.join(envelope_accuracy.OUT, "accuracy.json")) as f:
        accuracy = json.load(f)["tasks"]
    for task in envelope_accuracy.REPORTS:  # the benchmarks the headline shows
        report = load_or_run_report(envelope_accuracy.TASKS[task][0])
        shown = [name for name, _ in envelope_accuracy.headline_rows(task, report, accuracy)]
        assert [r["name"] for r in costs[task]] == shown
        flops = {r["name"]: r["flops"] for r in report["configs"]}
        for r in costs[task]:
            assert r["flops_ratio"] == pytest.approx(flops[r["name"]] / flops["plain"])
            lo, hi = r["time_ratio_range"]
            assert 0 < lo <= r["time_ratio"] <= hi


def test_the_fashion_mnist_figures_quoted_are_the_committed_runs():
    from experiments import envelope_accuracy

    with open(os.path.join(envelope_accuracy.OUT, "accuracy.json")) as f:
        rows = {r["name"]: r for r in json.load(f)["tasks"]["fashion"]}
    base, inside = rows["baseline"]["by_seed"], rows["in_envelope"]["by_seed"]
    deltas = ", ".join(f"{100 * (inside[s] - base[s]):+.2f}" for s in sorted(inside))
    measured = pathlib.Path(__file__).resolve().parents[1] / "docs" / "measured.md"
    page = " ".join(measured.read_text().split())
    low, high = (100 * b for b in (min(base.values()), max(base.values())))
    assert f"reaches {low:.2f}-{high:.2f}% after one epoch" in page
    assert f"**{envelope_accuracy.delta_text(rows['in_envelope'], 'fashion')} points**" in page
    assert f"seed {deltas};" in page
    assert f"{rows['in_envelope']['skipped_steps']} steps skipped" in page
    best = rows["best"]["by_seed"]  # the any-envelope row
    per_seed = ", ".join(f"{100 * best[s]:.2f}" for s in sorted(best))
    deltas = ", ".join(f"{100 * (best[s] - base[s]):+.2f}" for s in sorted(best))
    assert (
        f"**{envelope_accuracy.delta_text(rows['best'], 'fashion')} points** ({per_seed}%;" in page
    )
    assert f"per seed {deltas}; {rows['best']['skipped_steps']} steps skipped" in page
