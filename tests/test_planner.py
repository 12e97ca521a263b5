"""``lowmem plan``: budgets, envelopes, the search's answers verified by compiling them."""

from __future__ import annotations

import json

import pytest

import lowmem_jax as lm
from lowmem_jax import cli, planner
from lowmem_jax.envelope import ENVELOPES, report_sparsity
from lowmem_jax.factorization import FactorConfig
from lowmem_jax.workloads import analyze_model

MIB = 2**20
MODEL, BATCH = "wrn-10-1", 16  # baseline: ~11.3 MiB by XLA:CPU


@pytest.fixture
def small_space(monkeypatch):
    """Two settings per axis (the mildest and a strong one): the same search, fewer plans to
    count and compile, so the end-to-end tests stay cheap."""
    space = {
        "remat": ("none", "full"),
        "factorize": (None,),
        "precision": ("fp32", "mixed_fp16"),
        "sparsity": (0.0, 0.7),
        "optimizer_state": ("auto", "int8"),
    }
    monkeypatch.setattr(planner, "SPACE", space)


@pytest.mark.parametrize(
    "text, expected",
    [("48MiB", 48 * MIB), ("1.5 GiB", int(1.5 * 2**30)), ("500MB", 500 * 10**6), ("1024", 1024),
     ("2kib", 2048)],
)  # fmt: skip
def test_parse_bytes(text, expected):
    assert planner.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-3MiB", "0MiB", "12 parsecs", "1e3"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        planner.parse_bytes(text)


def test_envelopes_say_why_a_plan_is_outside():
    def config(plan: lm.Plan) -> dict:
        return {"batch_size": 128, **plan.to_dict()}

    report, anything = ENVELOPES["report"], ENVELOPES["any"]
    inside = lm.Plan(precision="mixed_fp16", microbatches=16, remat="full",
                     sparsity=report_sparsity(0.7), optimizer_state="int8")  # fmt: skip
    assert report.why_outside(config(inside)) is None
    outside = {
        "precision fp16": lm.Plan(precision="fp16"),
        "microbatches of 4 examples": lm.Plan(microbatches=32),
        "sparsity 90%": lm.Plan(sparsity=report_sparsity(0.9)),
        "optimizer state int4": lm.Plan(optimizer_state="int4"),
        "factorized layers": lm.Plan(factorize=FactorConfig()),
    }
    for reason, plan in outside.items():
        assert reason in report.why_outside(config(plan))
        assert anything.why_outside(config(plan)) is None


def test_a_budget_the_baseline_fits_gets_the_baseline(small_space):
    baseline = analyze_model(MODEL, BATCH, lm.Plan()).xla["total_bytes"]
    result = planner.plan_for_model(MODEL, BATCH, baseline)
    assert result.plan == lm.Plan() and result.flops_overhead == pytest.approx(1.0)
    assert result.xla["total_bytes"] == baseline
    assert result.considered[-1]["verdict"] == "chosen"


@pytest.mark.slow
def test_plan_json_gives_flags_whose_compiled_step_fits(capsys, tmp_path, small_space):
    """The issue's checks at test scale: ``lowmem plan --json``, then ``lowmem analyze`` with
    its ``argv`` compiles to at most the budget; a budget that microbatches alone meet gets no
    recomputation (FLOPs overhead 1.00)."""
    budget = 8 * MIB  # the baseline is ~11.3 MiB; two microbatches take ~6.4
    plot = tmp_path / "considered.png"
    assert cli.main(["plan", "--model", MODEL, "--batch-size", str(BATCH), "--budget", "8MiB",
                     "--json", "--plot", str(plot)]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert plot.stat().st_size > 0
    assert set(result) >= {"plan", "argv", "xla", "flops_overhead", "considered"}
    assert result["xla"]["total_bytes"] <= budget
    assert result["flops_overhead"] == pytest.approx(1.0, abs=1e-3)
    assert result["plan"]["remat"] == "none" and result["plan"]["microbatches"] > 1
    assert cli.main(["analyze", *result["argv"], "--json"]) == 0
    analyzed = json.loads(capsys.readouterr().out)
    assert analyzed["xla"]["total_bytes"] == result["xla"]["total_bytes"] <= budget
    assert analyzed["config"]["microbatches"] == result["plan"]["microbatches"]
    assert ENVELOPES["report"].why_outside(analyzed["config"]) is None


@pytest.mark.slow
def test_a_budget_below_every_plan_names_the_smallest(capsys, small_space, monkeypatch):
    monkeypatch.setattr(planner, "_EXTRA_COMPILES", 1)  # the message is the point, not the least
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", MODEL, "--batch-size", str(BATCH), "--budget", "1MiB"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no plan in the 'report' envelope fits 1.0 MiB" in err
    assert "the smallest budget that can work is" in err and "lowmem analyze --model" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", MODEL, "--budget", "lots"])
    assert exit_info.value.code == 2
    assert "budget 'lots' is not a positive size" in capsys.readouterr().err


@pytest.mark.slow
def test_train_with_a_memory_budget_trains_the_planned_step(capsys):
    common = ["train", "--model", MODEL, "--image-size", "8", "--no-progress", "--json"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*common, "--memory-budget", "8MiB", "--precision", "fp16"])
    assert exit_info.value.code == 2
    assert "--memory-budget chooses the techniques; it takes no --precision" in (
        capsys.readouterr().err
    )
    # A budget the fp32 step fits: the plan is the fp32 step with no technique.
    assert cli.main([*common, "--epochs", "1", "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert "memory budget 1024.0 MiB: no technique" in out.err
    assert summary["plan"]["precision"] == "fp32" and summary["plan"]["microbatches"] == 1
    assert summary["plan"]["remat"] == "none" and summary["steps"] > 0


def test_a_budget_between_remat_none_and_full_gets_a_per_block_schedule(monkeypatch):
    """WRN-10-1 batch 8 (one microbatch in the report envelope), fp32 only: halfway between
    the compiled totals of remat none and full, the answer is a ``blocks:`` schedule of the
    dynamic program, its compiled step fits, and it recomputes less than ``full``."""
    space = {"remat": ("none", "full", "blocks"), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "optimizer_state": ("auto",)}  # fmt: skip
    monkeypatch.setattr(planner, "SPACE", space)
    none = analyze_model(MODEL, 8, lm.Plan()).xla["total_bytes"]
    full = analyze_model(MODEL, 8, lm.Plan(remat="full"))
    budget = (none + full.xla["total_bytes"]) // 2
    result = planner.plan_for_model(MODEL, 8, budget)
    assert result.plan.remat.startswith("blocks:"), result.plan.remat
    assert result.xla["total_bytes"] <= budget
    assert 1.0 < result.flops_overhead < full.flops / result.reference_flops
    out = analyze_model(MODEL, 8, lm.Plan(remat=result.plan.remat))
    assert out.xla["total_bytes"] == result.xla["total_bytes"]


def test_a_class_a_borrowed_ratio_rejects_is_probed_by_a_compile(monkeypatch):
    """XLA's overhead over the analytic count differs between remat policies, so a ratio
    borrowed from other settings can put a class over budget when it fits: before rejecting
    it, the planner compiles a corner whose analytic count fits (a probe), which calibrates
    it. The probe that turns out to be the answer is listed once. Without probes the same
    search finds nothing."""
    space = {"remat": ("none",), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "optimizer_state": ("auto",)}  # fmt: skip
    work = lm.workload(MODEL, 8)
    budget = analyze_model(MODEL, 8, lm.Plan()).xla["total_bytes"]
    init = planner._Search.__init__

    def borrowing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.calibration[("full", None, "fp32", None, "auto")] = 5.0  # as if compiled

    monkeypatch.setattr(planner._Search, "__init__", borrowing)
    result = planner.plan_for_budget(work, budget, space=space)
    assert result.plan == lm.Plan() and result.xla["total_bytes"] == budget
    assert [c["verdict"] for c in result.considered] == ["chosen"]
    monkeypatch.setattr(planner, "_PROBES", 0)
    with pytest.raises(planner.NoPlanFits, match="the smallest budget that can work is"):
        planner.plan_for_budget(work, budget, space=space)
