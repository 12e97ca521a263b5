"""Before :func:`lowmem_jax.planning.planner.plan_for_budget` gives up: a local search for a plan
whose compiled total is smaller than any the class search compiled.

Near the least feasible total the analytic count ranks plans wrongly: it sums the residuals
a step saves, where XLA's peak holds one block's recomputed residuals at a time (the last
block's remat barely moves it), so the plan that compiles smallest need not be one the search
predicted smallest, nor one of the dynamic program's schedules.
"""

from __future__ import annotations

import dataclasses

from lowmem_jax.compose.plan import Plan
from lowmem_jax.planning.search import AXES, Search, plan_of

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
    microbatch count, and, where the search expands a compute axis' family
    (:class:`~lowmem_jax.core.technique.Family`) and the model has what it is built on, the
    family's members one change away (remat: one block of a stack moved to another of
    ``none`` / ``dots`` / ``full``)."""
    moving = [a for a in AXES if a.key in axes and not a.compute]
    here = {a.key: _rounded(a.value(plan)) for a in moving}
    compute = {a.key: getattr(plan, a.field) for a in AXES if a.key in axes and a.compute}
    plans = []
    for axis in moving:
        values = [_rounded(v) for v in axes[axis.key]]
        if here[axis.key] not in values:
            continue
        i = values.index(here[axis.key])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                plans.append(plan_of({**here, axis.key: axes[axis.key][j], **compute}))
    for axis in AXES:
        if axis.family is None or axis.family.value not in axes.get(axis.key, ()):
            continue
        structure = axis.family.structure(search.work.model)
        if structure is not None:
            for value in axis.family.neighbours(structure, getattr(plan, axis.field)):
                plans.append(dataclasses.replace(plan, **axis.plan_fields(value)))
    return list(dict.fromkeys(plans))


def _rounded(value):
    """A float rounded to 6 places (a sparsity from a density), anything else as it is."""
    return round(value, 6) if isinstance(value, float) else value
