"""The planner's search space (:mod:`lowmem_jax.planning.planner`): each technique's candidates
inside an accuracy envelope, the settings a user's model cannot take left out, and the least-memory
plans (*corners*) of a compute class."""

from __future__ import annotations

import itertools
import shlex
from typing import Any

import jax

from lowmem_jax.analysis import memory
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.technique import Axis
from lowmem_jax.planning.envelope import Envelope
from lowmem_jax.planning.search import AXES, COMPUTE, MIB, SPLIT, NoPlanFits, Search, plan_of
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.builder import build

__all__ = [
    "applicable",
    "axes_in",
    "class_corners",
    "class_name",
    "compute_classes",
    "least_stored",
    "mildest_first",
    "most_microbatches",
    "named_class",
    "over_devices",
    "refuse_below_the_least_state",
    "storage_axes",
]


def axes_in(envelope: Envelope, batch_size: int, space: dict[str, tuple]) -> dict[str, tuple]:
    """Each registered axis' candidates in ``space`` (an axis whose candidates come from the
    batch size: those ``batch_size`` allows, limited to ``space``'s where it has the key; an
    axis ``space`` leaves out: its technique off, a plan's default), inside ``envelope``."""
    axes = {}
    for technique in TECHNIQUES:
        axis = technique.axis
        if axis is None:
            continue
        values = axis.space(batch_size)
        if axis.values is not None:
            values = space.get(axis.key, (axis.value(Plan()),))
        if axis.values is None and axis.key in space:
            values = tuple(v for v in values if v in space[axis.key])
        if technique.envelope is not None:
            limit = envelope.limit(technique.name)
            values = tuple(v for v in values if axis.within(v, limit, batch_size))
        axes[axis.key] = values
    return axes


def applicable(
    search: Search, axes: dict[str, tuple], keys: tuple[str, ...] | None = None
) -> dict[str, tuple]:
    """A user's model's axes without the settings it refuses (each tried alone: its step built,
    nothing compiled), each left out with its one-line reason in the log (``factorize`` on a
    model with no ``Dense`` / ``Conv`` layer; ``every:K`` remat without scanned stacks; a
    pipeline's stages that divide none of its stacks); ``keys``: only those axes tried."""
    kept = {}
    for technique in TECHNIQUES:
        axis = technique.axis
        if axis is None or axis.key not in axes:
            continue
        values = axes[axis.key]
        if axis.values is None or (keys is not None and axis.key not in keys):
            kept[axis.key] = values  # microbatches: counts the batch size allows
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


def storage_axes(axes: dict[str, tuple]) -> list[Axis]:
    """The storage axes of ``axes`` in the registry's order: those that neither make a compute
    class nor come from the batch size (:class:`~lowmem_jax.core.technique.Axis`)."""
    return [axis for axis in AXES if axis.key in axes and axis.storage]


def class_corners(axes: dict[str, tuple], point: dict[str, Any], micro: int) -> list[Plan]:
    """The least-memory plans of the compute class ``point`` (``{compute axis: value}``) at
    ``micro`` microbatches: each storage axis at its last value, or at each value where fewer
    stored bytes can cost temporaries (:attr:`Axis.corner`; e.g. the most sparsity, each
    precision and optimizer-state format)."""
    storage = storage_axes(axes)
    values = [axes[a.key] if a.corner == "each" else axes[a.key][-1:] for a in storage]
    split = SPLIT.key  # the microbatch count
    return [
        plan_of({**point, split: micro, **{a.key: v for a, v in zip(storage, combo, strict=True)}})
        for combo in itertools.product(*values)
    ]


def mildest_first(axes: dict[str, tuple]) -> list[dict[str, Any]]:
    """The points of the storage axes (``{axis key: value}``): fewest techniques first, then
    the mildest settings (each axis' order), ties in the registry's order."""
    keys = [a.key for a in storage_axes(axes)]
    combos = itertools.product(*(range(len(axes[k])) for k in keys))
    ordered = sorted(combos, key=lambda idx: (sum(i > 0 for i in idx), sum(idx), idx))
    return [{k: axes[k][i] for k, i in zip(keys, idx, strict=True)} for idx in ordered]


def compute_classes(search: Search, axes: dict[str, tuple]) -> list[tuple[float, dict[str, Any]]]:
    """``(FLOPs, point)`` of every compute class, cheapest first: a point of the compute axes
    (:attr:`Axis.compute`), a family's value expanded into its members
    (:meth:`Search.family_classes`)."""
    classes = []
    # The last registered compute axis outermost (remat, then factorize): ties keep this order.
    keys = [axis.key for axis in reversed(COMPUTE) if axis.key in axes]
    for values in itertools.product(*(axes[key] for key in keys)):
        point = dict(zip(keys, values, strict=True))
        family = next((a for a in COMPUTE if a.key in point and point[a.key] in a.families), None)
        if family is not None:
            classes += search.family_classes(family.key, point)
        else:
            classes.append((search.flops(plan_of(point)), point))
    return sorted(classes, key=lambda c: c[0])


def least_stored(axes: dict[str, tuple]) -> list[Plan]:
    """The plans among which the step's arguments are the least: each axis that changes the
    stored bytes at its last value where later values store no more
    (:attr:`Axis.stored_falls`), else at each of its values."""
    stored = [a for a in AXES if a.key in axes and a.values is not None and "stored" in a.parts]
    choices = [axes[a.key][-1:] if a.stored_falls else axes[a.key] for a in stored]
    keys = [a.key for a in stored]
    return [plan_of(dict(zip(keys, c, strict=True))) for c in itertools.product(*choices)]


def refuse_below_the_least_state(search: Search, axes: dict[str, tuple]) -> None:
    """Refuses, before anything compiles, a budget under what the step's arguments alone take
    at their smallest (:func:`least_stored`: e.g. each precision at the most sparsity, the
    last state format and factorization the search allows): the stored parameters, optimizer
    state and batch (one device's shards over a mesh). XLA's total (argument + output + temp -
    alias) is never below its arguments.

    Raises:
      NoPlanFits: naming the least argument bytes and the plan that has them.
    """
    least, smallest = None, None
    for plan in least_stored(axes):
        setup = build(search.work, plan, recipe=search.recipe)
        held = (setup.abstract_state(), setup.abstract_batch())
        total = memory.tree_bytes(held, per_device=True)
        if least is None or total < least:
            least, smallest = total, plan
    if least > search.budget:
        raise NoPlanFits(
            f"budget {search.budget / MIB:.3f} MiB is below what the step's arguments alone take "
            f"at their smallest in the {search.envelope.name!r} envelope: {least / MIB:.3f} MiB "
            f"of parameters, optimizer state and batch (`lowmem analyze "
            f"{shlex.join(search.argv(smallest))}`); nothing was compiled"
        )


def over_devices(space: dict[str, tuple], batch_size: int, devices: int) -> dict[str, tuple]:
    """``space`` over ``devices`` devices (a budget per device): each axis that lays the step
    out over a mesh (:attr:`Axis.over_devices`) at its values for that many, unless ``space``
    names it, and the microbatch counts that divide one device's examples at the most data
    devices (so every mesh of the search can split its share).

    Raises:
      ValueError: JAX sees another number of devices, or they do not divide the batch.
    """
    visible = len(jax.devices())
    if visible != devices:
        raise ValueError(
            f"devices={devices}: JAX sees {visible} {jax.default_backend()} device(s) and the "
            f"planner lays its plans over all of them (on CPU, `lowmem plan --devices "
            f"{devices}` asks for that many host devices; elsewhere make only those visible)"
        )
    if batch_size % devices:
        raise ValueError(f"devices={devices} must divide batch_size={batch_size}")
    out = dict(space)
    for axis in AXES:
        if axis.over_devices is not None:
            out.setdefault(axis.key, axis.over_devices(devices))
    counts = SPLIT.space(batch_size // devices)
    out[SPLIT.key] = tuple(m for m in out.get(SPLIT.key, counts) if m in counts)
    return out


def most_microbatches(axes: dict[str, tuple]) -> int:
    return max(axes[SPLIT.key])


def named_class(point: dict[str, Any]) -> bool:
    """No compute axis of the class is at a family's member (:class:`Family`)."""
    return not any(a.family and a.key in point and point[a.key] not in a.values for a in COMPUTE)


def class_name(point: dict[str, Any]) -> str:
    """``"remat none, factorize None"``: each compute axis' key and value (a factorization by
    its method)."""
    return ", ".join(f"{k} {getattr(v, 'method', v)}" for k, v in point.items())
