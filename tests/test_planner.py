"""``lowmem plan``: budgets, envelopes, the search's answers verified by compiling them."""

from __future__ import annotations

import json

import jax
import pytest

import lowmem_jax as lm
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.core.units import parse_bytes
from lowmem_jax.planning import descent as plan_descent
from lowmem_jax.planning import planner
from lowmem_jax.planning import search as plan_search
from lowmem_jax.planning.envelope import ENVELOPES
from lowmem_jax.planning.space import axes_in
from lowmem_jax.techniques.factorize import FactorConfig
from lowmem_jax.techniques.sparsity import report_sparsity
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
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-3MiB", "0MiB", "12 parsecs", "1e3"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        parse_bytes(text)


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
        "powersgd gradient compression": lm.Plan(shard="dp", grad_compression="powersgd"),
    }
    assert report.why_outside(config(lm.Plan(shard="dp"))) is None  # the same step, spread
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
    printed = capsys.readouterr()
    result = json.loads(printed.out)
    assert "lowmem plan: wrn-10-1, budget 8.0 MiB" in printed.err  # the search's log
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
    monkeypatch.setattr(plan_descent, "_EXTRA_COMPILES", 1)  # the message is the point
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
    it. The probe that turns out to be the answer is listed once. Without probes the class is
    rejected, and the answer comes from the compiles made before giving up."""
    space = {"remat": ("none",), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "optimizer_state": ("auto",)}  # fmt: skip
    work = lm.workload(MODEL, 8)
    budget = analyze_model(MODEL, 8, lm.Plan()).xla["total_bytes"]
    init = plan_search.Search.__init__

    def borrowing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # as if compiled
        self.calibration[plan_search.calibration_key(lm.Plan(remat="full"))] = 5.0

    monkeypatch.setattr(plan_search.Search, "__init__", borrowing)
    result = planner.plan_for_budget(work, budget, space=space)
    assert result.plan == lm.Plan() and result.xla["total_bytes"] == budget
    assert [c["verdict"] for c in result.considered] == ["chosen"]
    monkeypatch.setattr(planner, "_PROBES", 0)
    lines = []
    result = planner.plan_for_budget(work, budget, space=space, log=lines.append)
    assert result.plan == lm.Plan() and [c["verdict"] for c in result.considered] == ["chosen"]
    assert "  fp32: the class's least-memory plan is predicted over budget" in lines
    assert not any("a probe" in line for line in lines)


def test_objective_time_answers_the_fastest_of_the_timed_plans(monkeypatch):
    """``objective="time"``: the first plan that fits in each of the cheapest classes is run
    and timed; the answer is the one with the least median step time, and each timed entry of
    ``considered`` says its time. With ``flops`` nothing is timed and the answer is the first
    of them."""
    space = {"remat": ("none", "full"), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "optimizer_state": ("auto",)}  # fmt: skip
    work = lm.workload(MODEL, 8)
    budget = analyze_model(MODEL, 8, lm.Plan()).xla["total_bytes"]  # both classes fit
    by_flops = planner.plan_for_budget(work, budget, space=space)
    assert by_flops.plan == lm.Plan() and by_flops.step_seconds is None
    assert all("step_seconds" not in c for c in by_flops.considered)
    by_time = planner.plan_for_budget(
        work, budget, space=space, objective="time", time_candidates=2, repeats=1
    )
    timed = {" ".join(c["argv"]): c for c in by_time.considered if "step_seconds" in c}
    assert len(timed) == 2  # remat none and remat full, one microbatch each
    chosen = [c for c in by_time.considered if c["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["step_seconds"] == by_time.step_seconds
    assert by_time.step_seconds == min(c["step_seconds"] for c in timed.values())
    assert by_time.xla["total_bytes"] <= budget
    with pytest.raises(ValueError, match="objective='speed'; allowed values"):
        planner.plan_for_budget(work, budget, space=space, objective="speed")


def _axes(**space) -> dict[str, tuple]:
    base = {"remat": ("none", "full", "blocks"), "factorize": (None,),
            "precision": ("fp32", "mixed_fp16"), "sparsity": (0.0,),
            "optimizer_state": ("auto",)}  # fmt: skip
    return axes_in(ENVELOPES["any"], 8, {**base, **space})


def test_neighbours_change_one_setting_or_one_block():
    """WRN-10-1 runs three stacks of one block: from ``remat full`` at fp32 on one
    microbatch, one block to ``dots`` or ``none`` (six schedules), or one step along the
    precision or microbatch axis."""
    search = plan_search.Search(lm.workload(MODEL, 8), 1, ENVELOPES["any"], None, None)
    got = plan_descent._neighbours(search, _axes(microbatches=(1, 2)), lm.Plan(remat="full"))
    schedules = {"blocks:dots,full*2", "blocks:none,full*2", "blocks:full,dots,full",
                 "blocks:full,none,full", "blocks:full*2,dots", "blocks:full*2,none"}  # fmt: skip
    assert {p.remat for p in got if p.remat != "full"} == schedules
    assert all(p.precision == "fp32" and p.microbatches == 1 for p in got if p.remat != "full")
    same = [p for p in got if p.remat == "full"]
    assert set(same) == {lm.Plan(remat="full", precision="mixed_fp16"),
                         lm.Plan(remat="full", microbatches=2)}  # fmt: skip
    # Back to one policy throughout: the named one.
    back = plan_descent._neighbours(search, _axes(), lm.Plan(remat="blocks:dots,full*2"))
    assert "full" in {p.remat for p in back}


def test_before_giving_up_a_descent_reaches_a_plan_the_prediction_ranked_out(monkeypatch):
    """A landscape of compiled totals (compiles faked) where the only plan under the budget
    is two changes away from the least compiled plan: the descent moves to the neighbour that
    compiles smaller, then to the one that fits, and that is the answer. Far over the budget
    (more than ``_DESCENT_REACH``) it does not start."""
    totals = {("full", "fp32"): 110, ("full", "mixed_fp16"): 105,
              ("blocks:full*2,none", "mixed_fp16"): 100}  # fmt: skip
    monkeypatch.setattr(plan_descent, "_EXTRA_COMPILES", 0)

    def search_with(budget: int) -> plan_search.Search:
        search = plan_search.Search(lm.workload(MODEL, 8), budget, ENVELOPES["any"], None, None)

        def compile(plan):
            total = totals.get((plan.remat, plan.precision), 200)
            return search.compiled.setdefault(plan, {"total_bytes": total, "source": "fake"})

        search.compile = compile
        search.flops = lambda plan: 1.0
        search.predict = lambda plan, bound=False: 0
        compile(lm.Plan(remat="full"))
        return search

    search = search_with(100)
    found = plan_descent.descend(search, _axes())
    assert found == lm.Plan(remat="blocks:full*2,none", precision="mixed_fp16")
    steps = [c for c in search.considered if "a descent step" in c["verdict"]]
    assert steps[-1]["verdict"] == "fits (compiled, a descent step)"
    assert len(search.compiled) == 1 + len(steps) <= 1 + plan_descent._DESCENT_COMPILES
    far = search_with(int(110 / plan_descent._DESCENT_REACH) - 1)
    assert plan_descent.descend(far, _axes()) is None and len(far.compiled) == 1


def test_a_deferred_class_is_probed_only_for_a_real_saving(monkeypatch):
    """A class rejected only through a borrowed calibration (here: ``remat none``, borrowed
    5x too high) is deferred. When a costlier class (``dots``) fits and would cost less than
    ``_PROBE_GAIN`` more FLOPs, its answer stands without a compile of the deferred class; with
    no tolerance the deferred class is probed first and is the answer."""
    space = {"remat": ("none", "dots"), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "optimizer_state": ("auto",)}  # fmt: skip
    work = lm.workload(MODEL, 8)
    budget = analyze_model(MODEL, 8, lm.Plan()).xla["total_bytes"]
    ratio = plan_search.Search.ratio

    def borrowed_too_high(self, plan, bound):
        unseen = plan_search.calibration_key(plan) not in self.calibration
        return 5.0 if plan.remat == "none" and unseen and bound else ratio(self, plan, bound)

    monkeypatch.setattr(plan_search.Search, "ratio", borrowed_too_high)
    result = planner.plan_for_budget(work, budget, space=space)
    assert result.plan == lm.Plan(remat="dots")
    assert 1.0 < result.flops_overhead < 1 + planner._PROBE_GAIN
    none = [c for c in result.considered if "--remat" not in c["argv"]]
    assert none and all(c["xla_total_bytes"] is None for c in none)  # never compiled
    monkeypatch.setattr(planner, "_PROBE_GAIN", 0.0)
    result = planner.plan_for_budget(work, budget, space=space)
    assert result.plan == lm.Plan() and result.flops_overhead == pytest.approx(1.0)


@pytest.mark.parametrize(
    "more, message",
    [(None, "devices must be an int >= 1, got 0"),
     (1, "JAX sees {} cpu device(s) and the planner lays its plans over all of them")],
)  # fmt: skip
def test_plan_over_devices_it_cannot_have_exits_2_with_one_line(capsys, more, message):
    """Over several devices the planner compiles over every device JAX sees: a count it cannot
    have (JAX has started, with fewer) is refused before anything compiles."""
    visible = len(jax.devices())  # started: no more host devices can be had
    devices = "0" if more is None else str(visible + more)
    message = message.format(visible)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", MODEL, "--budget", "4MiB", "--devices", devices])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_budget_below_the_least_state_is_refused_before_compiling(monkeypatch):
    """--budget 1KiB compiled for minutes before its error: a budget under the arguments'
    bytes at their smallest (parameters, optimizer state and batch, which XLA's total always
    holds) is refused at once, naming that floor."""

    def refuse(self, plan):
        raise AssertionError("compiled for a budget that cannot fit")

    monkeypatch.setattr(plan_search.Search, "compile", refuse)
    work = lm.workload(MODEL, 8)
    with pytest.raises(planner.NoPlanFits, match=r"budget 0\.001 MiB is below .* nothing was"):
        planner.plan_for_budget(work, 1024)


def test_outside_the_report_s_envelope_the_planner_compresses_activations():
    """Compressed activations are a storage axis (lowmem_jax.techniques.activations): outside
    the report's envelope a budget that float32 residuals miss gets the mildest format that
    fits, with no remat (no recomputed FLOPs); inside it the axis is ``none`` only. An axis the
    space leaves out (here the optimizer state) stays off."""
    space = {"remat": ("none",), "factorize": (None,), "precision": ("fp32",),
             "sparsity": (0.0,), "activations": ("none", "int8", "int2")}  # fmt: skip
    work = lm.workload(MODEL, 8)
    totals = {fmt: analyze_model(MODEL, 8, lm.Plan(activations=fmt)).xla["total_bytes"]
              for fmt in ("none", "int8")}  # fmt: skip
    assert totals["int8"] < totals["none"]
    budget = (totals["int8"] + totals["none"]) // 2
    result = planner.plan_for_budget(work, budget, envelope="any", space=space)
    assert result.plan == lm.Plan(activations="int8") and result.xla["total_bytes"] <= budget
    assert result.argv[-2:] == ["--activations", "int8"]
    axes = axes_in(ENVELOPES["report"], 8, space)
    assert axes["activations"] == ("none",) and axes["optimizer_state"] == ("auto",)
    with pytest.raises(planner.NoPlanFits):
        planner.plan_for_budget(work, budget, envelope="report", space=space)


def test_the_storage_axes_are_the_registry_s():
    """Every registered axis that is neither a compute class nor the microbatch count is
    searched inside a class, with no planner code naming it: the mildest-first points are the
    product of their values (the technique-free point first, then one technique at a time),
    and a class's corners take each value of an ``each`` axis and the last of a ``last`` one."""
    import math

    from lowmem_jax.planning.space import class_corners, mildest_first, storage_axes
    from lowmem_jax.techniques import TECHNIQUES

    axes = axes_in(ENVELOPES["any"], 8, planner.SPACE)
    storage = storage_axes(axes)
    registered = [t.axis for t in TECHNIQUES if t.axis is not None and t.axis.storage]
    assert [a.key for a in storage] == [a.key for a in registered]
    assert {"precision", "activations", "sparsity", "optimizer_state"} <= {a.key for a in storage}
    points = mildest_first(axes)
    assert len(points) == math.prod(len(axes[a.key]) for a in storage)
    assert points[0] == {a.key: axes[a.key][0] for a in storage}
    changed = [sum(p[a.key] != axes[a.key][0] for a in storage) for p in points]
    assert changed == sorted(changed) and changed[1] == 1
    corners = class_corners(axes, {"remat": "full", "factorize": None}, 2)
    for axis in storage:
        seen = {axis.value(plan) for plan in corners}
        assert seen == (set(axes[axis.key]) if axis.corner == "each" else {axes[axis.key][-1]})
