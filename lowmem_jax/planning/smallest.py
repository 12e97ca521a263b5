"""The least memory a workload trains in inside an envelope (:func:`smallest_plan`): the
planner's least-memory plans of every compute class, compiled, the smallest kept."""

from __future__ import annotations

import itertools
from typing import Any

from lowmem_jax.compose.plan import Plan
from lowmem_jax.planning.envelope import ENVELOPES
from lowmem_jax.planning.planner import SPACE
from lowmem_jax.planning.search import COMPUTE, Search, plan_name
from lowmem_jax.planning.space import applicable, axes_in, class_corners
from lowmem_jax.workloads.definition import Workload

__all__ = ["smallest_plan"]


def smallest_plan(
    work: Workload, envelope: str, compiles: int = 6, space: dict | None = None
) -> tuple[Plan, dict[str, Any]]:
    """(the plan, a JSON-able summary): the least memory ``work`` trains in inside
    ``envelope``, as far as this search goes: the least-memory plans (corners) of every compute
    class the model can take (each remat policy and factorization at the most microbatches and
    sparsity, each precision and state format; :mod:`lowmem_jax.planning.space`), the
    ``compiles`` with the least predicted bytes compiled (XLA on the default backend), the least
    compiled total kept. The summary: the plan's name, its technique flags (``argv``;
    :func:`~lowmem_jax.compose.flags.plan_from_argv` gives the plan back) and fields, its
    compiled ``total_bytes`` and ``xla`` figures, how many plans were compiled, the corners the
    model refused and the settings left out as inapplicable."""
    env = ENVELOPES[envelope]
    search = Search(work, 2**62, env, None, None)
    axes = applicable(search, axes_in(env, work.batch_size, space or SPACE))
    # Families (remat's per-block schedules) need a bundled model's scanned stacks: left out.
    keys = [a.key for a in COMPUTE]
    values = [[v for v in axes[a.key] if v not in a.families] for a in COMPUTE]
    corners = [
        plan
        for combo in itertools.product(*values)
        for plan in class_corners(
            axes, dict(zip(keys, combo, strict=True)), max(axes["microbatches"])
        )
    ]
    predicted = {}
    for plan in set(corners):
        try:
            predicted[plan] = search.predict(plan)
        except ValueError:  # a combination the model refuses (its one line is the planner's)
            continue
    for plan in sorted(predicted, key=predicted.get)[:compiles]:
        search.compile(plan)
        search.executables.pop(plan, None)  # kept by a search for timing: not needed here
    best = min(search.compiled, key=lambda p: search.compiled[p]["total_bytes"])
    return best, {
        "plan": plan_name(best),
        "fields": best.to_dict(),
        "total_bytes": search.compiled[best]["total_bytes"],
        "xla": search.compiled[best],
        "compiled": len(search.compiled),
        "refused_corners": len(set(corners)) - len(predicted),
        "left_out": {
            k: [
                repr(v)
                for v in axes_in(env, work.batch_size, space or SPACE)[k]
                if v not in axes[k]
            ]
            for k in axes
        },  # fmt: skip
    }
