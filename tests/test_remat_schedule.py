"""Per-block remat schedules: the dynamic program against brute force, the costs against the
analytic count of the whole step."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.planning import search as plan_search
from lowmem_jax.planning.envelope import ENVELOPES
from lowmem_jax.planning.search import Search
from lowmem_jax.techniques.remat import schedule as rs
from lowmem_jax.workloads import workload


@st.composite
def block_costs(draw):
    stacks = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = len(stacks)
    saving = st.floats(-100.0, 0.0, allow_nan=False)
    extra = st.floats(0.0, 50.0, allow_nan=False)
    dbytes = {"none": (0.0,) * n}
    dflops = {"none": (0.0,) * n}
    for policy in ("dots", "full"):
        dbytes[policy] = tuple(draw(st.lists(saving, min_size=n, max_size=n)))
        dflops[policy] = tuple(draw(st.lists(extra, min_size=n, max_size=n)))
    return rs.BlockCosts(stacks, 1000.0, 5000.0, dbytes, dflops)


def _every_schedule(costs: rs.BlockCosts) -> list[rs.Schedule]:
    blocks = sum(costs.stacks)
    return [
        rs.predict(costs, p) for p in itertools.product(("none", "dots", "full"), repeat=blocks)
    ]


@settings(max_examples=60, deadline=None)
@given(block_costs(), st.floats(0.0, 1.0))
def test_the_dynamic_program_finds_the_least_recompute_of_every_schedule(costs, where):
    """For any activation budget, the least FLOPs among the Pareto schedules equals the least
    among all 3**blocks schedules (brute force), and no schedule beats a Pareto one on both."""
    every = _every_schedule(costs)
    front = rs.pareto_schedules(costs)
    lo, hi = min(s.bytes for s in every), max(s.bytes for s in every)
    budget = lo + where * (hi - lo)
    best = min(s.flops for s in every if s.bytes <= budget + 1e-9)
    chosen = rs.least_recompute(front, budget + 1e-9)
    assert chosen.flops == pytest.approx(best, abs=1e-6)
    for s in front:
        assert not any(o.bytes < s.bytes - 1e-9 and o.flops < s.flops - 1e-9 for o in every)
    assert rs.least_recompute(front, lo - 1.0) is None


def test_rescaled_costs_match_the_uniform_counts():
    costs = rs.BlockCosts(
        (1, 3),
        100.0,
        0.0,
        {"none": (0.0, 0.0), "full": (-10.0, -20.0)},
        {"none": (0, 0), "full": (1, 1)},
    )
    half = rs.rescale(costs, 50.0, {"full": 15.0})  # full throughout: 100 - 70 -> 50 - 35
    assert rs.predict(half, ("full",) * 4).bytes == pytest.approx(15.0)
    assert rs.predict(half, ("full", "none", "none", "none")).bytes == pytest.approx(45.0)


def test_a_schedules_predicted_costs_match_the_whole_step_count():
    """WRN-10-2 (3 blocks), batch 4 at 8x8: the costs measured per stack predict a mixed
    schedule's analytic activation bytes and FLOPs, each traced whole, closely."""
    work = workload("wrn-10-2", 4, image_size=8)
    search = Search(work, 1, ENVELOPES["any"], None, None)
    fp32 = plan_search.settings(lm.Plan(), "activations")  # fp32, no compression, remat none
    costs = search.family_costs("remat", plan_search._with(fp32, "remat", None))
    assert costs.stacks == (1, 1, 1)
    assert all(d < 0 for d in costs.dbytes["full"]) and all(f > 0 for f in costs.dflops["full"])
    policies = ("full", "none", "dots")
    predicted = rs.predict(costs, policies)
    name = lm.techniques.remat.schedule_name(policies)
    traced = search._activations(plan_search._with(fp32, "remat", name), 1)
    assert predicted.bytes == pytest.approx(traced, rel=0.02)
    assert predicted.flops == pytest.approx(search.flops(lm.Plan(remat=name)), rel=1e-3)
    front = search.family_classes("remat", {"factorize": None})
    assert front and all(point["remat"].startswith("blocks:") for _, point in front)
