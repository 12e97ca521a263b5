"""Before :func:`lowmem_jax.planner.plan_for_budget` gives up: a local search for a plan
whose compiled total is smaller than any the class search compiled.

Near the least feasible total the analytic count ranks plans wrongly: it sums the residuals
a step saves, where XLA's peak holds one block's recomputed residuals at a time (the last
block's remat barely moves it), so the plan that compiles smallest need not be one the search
predicted smallest, nor one of the dynamic program's schedules.
"""

from __future__ import annotations

import dataclasses
import itertools

from lowmem_jax.plan import Plan
from lowmem_jax.plan_search import AXES, Search, plan_of
from lowmem_jax.remat import parse_policy, schedule_name

__all__ = ["descend"]


def descend(search: Search, axes: dict[str, tuple]) -> Plan | None:
    """Before giving up: the least predicted plans not compiled yet are compiled (up to
    :data:`_EXTRA_COMPILES`; one if none was), then, where the least compiled total is within
    :data:`_DESCENT_REACH` of the budget, a local search for a smaller one: the least
    compiled plan's neighbours (:func:`_neighbours`) are compiled, least predicted first,
    moving to the first that compiles smaller, up to :data:`_DESCENT_COMPILES` compiles in
    all. The analytic count misses where XLA's peak lies when most of the step is
    recomputed (a block's recomputation is transient; the last block's is at the peak), so
    the ranking it gives there can be wrong. Returns the plan that fits with the fewest
    FLOPs, if one was found."""
    left = sorted((p for p in search.predicted if p not in search.compiled), key=search.predict)
    for plan in left[: max(_EXTRA_COMPILES, not search.compiled)]:  # one at least
        search.compile(plan)

    def total(plan: Plan) -> int:
        return search.compiled[plan]["total_bytes"]

    if not search.compiled:
        return None
    current = min(search.compiled, key=total)
    compiles = 0
    while search.budget < total(current) <= search.budget * _DESCENT_REACH:
        untried = [n for n in _neighbours(search, axes, current) if n not in search.compiled]
        better = None
        for plan in sorted(untried, key=lambda n: search.predict(n, bound=True)):
            if compiles == _DESCENT_COMPILES:
                break
            search.compile(plan)
            compiles += 1
            verdict = "fits" if total(plan) <= search.budget else "over budget"
            search.note(plan, search.flops(plan), f"{verdict} (compiled, a descent step)")
            if total(plan) < total(current):
                better = plan
                break
        if better is None:
            break
        current = better
    fits = [p for p in search.compiled if total(p) <= search.budget]
    return min(fits, key=search.flops, default=None)


# Before NoPlanFits: compiles of the least predicted plans left, and of a local search.
_EXTRA_COMPILES = 3
_DESCENT_COMPILES = 8
_DESCENT_REACH = 1.10


def _neighbours(search: Search, axes: dict[str, tuple], plan: Plan) -> list[Plan]:
    """The plans one change away from ``plan``: one step along a storage axis or the
    microbatch count, and (where the search has per-block schedules) one block of a stack
    moved to another of ``none`` / ``dots`` / ``full`` (a stack's blocks ordered ``full``,
    ``dots``, ``none``, as the dynamic program writes them)."""
    moving = [a for a in AXES if a.key in axes and not a.compute]
    here = {a.key: _rounded(a.value(plan)) for a in moving}
    plans = []
    for axis in moving:
        values = [_rounded(v) for v in axes[axis.key]]
        if here[axis.key] not in values:
            continue
        i = values.index(here[axis.key])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                o = {**here, axis.key: axes[axis.key][j]}
                plans.append(plan_of({**o, "remat": plan.remat, "factorize": plan.factorize}))
    stacks = getattr(search.work.model, "block_stacks", None)
    spec = parse_policy(plan.remat)
    policies = spec.schedule or (plan.remat,) * (sum(stacks()) if stacks else 0)
    if "blocks" not in axes["remat"] or not stacks or not set(policies) <= set(_ORDER):
        return plans
    starts = list(itertools.accumulate(stacks(), initial=0))
    for a, b in itertools.pairwise(starts):
        for block, other in itertools.product(range(a, b), _ORDER):
            if other == policies[block]:
                continue
            moved = list(policies)
            moved[block] = other
            moved[a:b] = sorted(moved[a:b], key=_ORDER.index)
            name = moved[0] if len(set(moved)) == 1 else schedule_name(moved)
            plans.append(dataclasses.replace(plan, remat=name))
    return list(dict.fromkeys(plans))


_ORDER = ("full", "dots", "none")  # within a stack, as remat_schedule orders a stack's blocks


def _rounded(value):
    """A float rounded to 6 places (a sparsity from a density), anything else as it is."""
    return round(value, 6) if isinstance(value, float) else value
