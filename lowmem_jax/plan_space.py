"""The planner's search space (:mod:`lowmem_jax.planner`): each technique's candidates inside an
accuracy envelope, the settings a user's model cannot take left out, and the least-memory plans
(*corners*) of a compute class."""

from __future__ import annotations

import itertools
from typing import Any

from lowmem_jax.envelope import Envelope
from lowmem_jax.plan import Plan
from lowmem_jax.plan_search import Search, plan_of
from lowmem_jax.techniques import TECHNIQUES

__all__ = ["applicable", "axes_in", "class_corners", "mildest_first"]


def axes_in(envelope: Envelope, batch_size: int, space: dict[str, tuple]) -> dict[str, tuple]:
    """Each registered axis' candidates in ``space`` (an axis whose candidates come from the
    batch size: those ``batch_size`` allows, limited to ``space``'s where it has the key),
    inside ``envelope``."""
    axes = {}
    for technique in TECHNIQUES:
        axis = technique.axis
        if axis is None:
            continue
        values = space[axis.key] if axis.values is not None else axis.space(batch_size)
        if axis.values is None and axis.key in space:
            values = tuple(v for v in values if v in space[axis.key])
        if technique.envelope is not None:
            limit = envelope.limit(technique.name)
            values = tuple(v for v in values if axis.within(v, limit, batch_size))
        axes[axis.key] = values
    return axes


def applicable(search: Search, axes: dict[str, tuple]) -> dict[str, tuple]:
    """A user's model's axes without the settings it refuses (each tried alone: its step built,
    nothing compiled), each left out with its one-line reason in the log (``factorize`` on a
    model with no ``Dense`` / ``Conv`` layer; ``every:K`` remat without scanned stacks)."""
    kept = {}
    for technique in TECHNIQUES:
        axis = technique.axis
        if axis is None or axis.key not in axes:
            continue
        values = axes[axis.key]
        if axis.values is None:  # counts the batch size allows: nothing model-specific
            kept[axis.key] = values
            continue
        # The first value is the technique off (each axis is mildest first); families (remat's
        # per-block schedules) are expanded by the planner from the model's own stacks.
        kept[axis.key] = values[:1] + tuple(
            v for v in values[1:] if v in axis.families or _builds(search, axis.key, v)
        )
    return kept


def _builds(search: Search, key: str, value: Any) -> bool:
    try:
        search.flops(plan_of({key: value}))
    except ValueError as err:
        if search.log:
            search.log(f"  {key}={value!r} left out: {str(err).splitlines()[0]}")
        return False
    return True


def class_corners(axes: dict[str, tuple], remat, factorize, micro: int) -> list[Plan]:
    """The least-memory plans of a class at ``micro`` microbatches: the most sparsity, each
    precision and optimizer-state format (fewer state bits can cost temp bytes, so each)."""
    sparsity = max(axes["sparsity"])
    return [
        plan_of({"remat": remat, "factorize": factorize, "precision": p, "microbatches": micro,
                 "sparsity": sparsity, "optimizer_state": s})
        for p in axes["precision"] for s in axes["optimizer_state"]
    ]  # fmt: skip


def mildest_first(axes: dict[str, tuple]) -> list[tuple]:
    """(precision, sparsity, optimizer_state) combinations: fewest techniques first, then the
    mildest settings (each axis' order)."""
    names = ("precision", "sparsity", "optimizer_state")
    combos = itertools.product(*(range(len(axes[n])) for n in names))
    ordered = sorted(combos, key=lambda idx: (sum(i > 0 for i in idx), sum(idx), idx))
    return [tuple(axes[n][i] for n, i in zip(names, idx, strict=True)) for idx in ordered]
