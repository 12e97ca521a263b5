"""The device mesh a step is laid out over, and where each leaf of a pytree lives on it:
which axis of an array is split over which mesh axis, in which memory.

The step is one ``jax.jit`` program over the global arrays (SPMD): XLA's partitioner inserts the
collectives the shardings imply, so a global reduction (the loss, the gradients' finiteness, a
sparse layer's top-k budget, BatchNorm's statistics) means the same on every device as on one.

**How a leaf is partitioned** (:func:`leaf_spec`). ZeRO
(:mod:`lowmem_jax.techniques.shard`) partitions the flat concatenation of all
parameters; here each array is partitioned along one of its own axes (no flattening, so a
layer's slices stay arrays XLA can gather per layer): the largest axis divisible by ``N``
(the last of equal ones). A leaf with no such axis (a scalar, a ``[3]`` vector) stays
replicated; :func:`partitioned_fraction` says how many bytes that leaves whole.

The batch is split along its leading axis (:func:`batch_spec`): device ``d`` holds examples
``[d B/N, (d+1) B/N)``.

**Memory kinds** (:data:`MEMORY_KINDS`): a sharding also says which memory of its devices holds
the array: ``device`` (the accelerator's) or ``pinned_host`` (page-locked host memory the
accelerator reads by DMA). Inside a jitted step, ``jax.device_put(x, named(mesh, specs,
kind))`` moves a value between them (:func:`to_memory`). XLA:CPU has one physical memory, so
there the move is a copy and saves nothing.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "AXIS",
    "MEMORY_KINDS",
    "data_mesh",
    "device_mesh",
    "leaf_spec",
    "tree_specs",
    "batch_spec",
    "data_devices",
    "shards_in_batch",
    "named",
    "merge_shardings",
    "left_open",
    "constrain",
    "replicate",
    "to_memory",
    "check_memory_kind",
    "partitioned_fraction",
    "set_cpu_devices",
]

PyTree = Any
AXIS = "data"
MEMORY_KINDS = ("device", "pinned_host")


def set_cpu_devices(count: int, *, require: bool = True) -> None:
    """Makes at least ``count`` devices visible: asks XLA:CPU for ``count`` host devices
    (``jax_num_cpu_devices``) if JAX has not started its backends yet; otherwise checks that
    enough devices are already there. Other backends ignore the option. ``require=False``
    only asks (for a caller that then uses what :func:`jax.devices` has).

    Raises:
      ValueError: ``require`` and JAX runs with fewer than ``count`` devices.
    """
    if count < 1:
        raise ValueError(f"devices must be >= 1, got {count}")
    if count > 1 and count > jax.config.jax_num_cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:  # the backends have started: whatever they have must do
            pass
    if require and len(jax.devices()) < count:
        raise ValueError(
            f"devices={count}: JAX has already started with {len(jax.devices())} "
            f"{jax.default_backend()} device(s); ask for host devices before anything runs on "
            "JAX (lowmem --devices does, as does lowmem_jax.core.mesh.set_cpu_devices)"
        )


def data_mesh(devices: int = 0) -> Mesh:
    """A one-axis mesh (``"data"``) over the first ``devices`` visible devices (``0``: all).

    Raises:
      ValueError: more devices than JAX sees, naming how to get more on CPU.
    """
    return device_mesh({AXIS: devices})


def device_mesh(axes: dict[str, int]) -> Mesh:
    """A mesh with the named ``axes`` (``"data"`` first, one device wide where ``axes`` has
    none, the others in the order given) over the first visible devices; a size of ``0``
    takes every visible device the other axes leave (at most one axis may).

    Raises:
      ValueError: more devices than JAX sees, naming how to get more on CPU.
    """
    visible = jax.devices()
    axes = {AXIS: 1, **axes}
    fixed = math.prod(size for size in axes.values() if size)
    sizes = {name: size or len(visible) // fixed for name, size in axes.items()}
    count = math.prod(sizes.values())
    names = sorted(sizes, key=lambda name: name != AXIS)
    if count < 1 or count > len(visible):
        needs = ", ".join(f"{name}={axes[name]}" for name in names)
        what = (f"devices={axes[AXIS]}" if len(axes) == 1
                else f"the mesh ({needs}) needs {max(count, fixed)} devices")  # fmt: skip
        raise ValueError(
            f"{what}: JAX sees {len(visible)} {jax.default_backend()} device(s); on CPU, "
            "`lowmem ... --devices N` (or lowmem_jax.core.mesh.set_cpu_devices(N) before JAX "
            "starts) gives N host devices"
        )
    grid = np.asarray(visible[:count]).reshape([sizes[name] for name in names])
    return Mesh(grid, tuple(names))


def leaf_spec(shape: tuple[int, ...], num_shards: int, axis_name: str = AXIS) -> PartitionSpec:
    """The spec that splits an array of ``shape`` over ``num_shards`` (the mesh axis
    ``axis_name``) along its largest axis divisible by ``num_shards`` (the last of equal ones);
    replicated (``P()``) if none is."""
    if num_shards <= 1:
        return PartitionSpec()
    best = None
    for axis, size in enumerate(shape):
        if size % num_shards == 0 and (best is None or size >= shape[best]):
            best = axis
    if best is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * best), axis_name)


def tree_specs(tree: PyTree, num_shards: int, partition: bool = True) -> PyTree:
    """A :class:`PartitionSpec` per leaf of ``tree`` (arrays or shapes): :func:`leaf_spec`, or
    replicated for every leaf when ``partition`` is false."""
    return jax.tree.map(
        lambda x: leaf_spec(tuple(x.shape), num_shards) if partition else PartitionSpec(), tree
    )


def batch_spec(batch: PyTree) -> PyTree:
    """Every batch leaf split along its leading (example) axis."""
    return jax.tree.map(lambda _: PartitionSpec(AXIS), batch)


def data_devices(mesh: Mesh | None) -> int:
    """The devices a batch is split over: the size of ``mesh``'s ``data`` axis (1 without a
    mesh or that axis; a pipeline's stages all see the same examples)."""
    return 1 if mesh is None else dict(mesh.shape).get(AXIS, 1)


def shards_in_batch(mesh: Mesh | None) -> int:
    """How many devices' shards a batch traced here holds: :func:`data_devices`, or 1 inside
    a ``shard_map`` over the ``data`` axis (there the batch is one device's)."""
    if mesh is None or AXIS in jax.sharding.get_abstract_mesh().manual_axes:
        return 1
    return data_devices(mesh)


def check_memory_kind(kind: str, name: str = "memory_kind") -> None:
    """Raises ``ValueError`` naming ``name`` and :data:`MEMORY_KINDS` unless ``kind`` is one."""
    if kind not in MEMORY_KINDS:
        raise ValueError(f"Unknown {name}={kind!r}; allowed values: {list(MEMORY_KINDS)}")


def named(mesh: Mesh, specs: PyTree, memory_kind: str | None = None) -> PyTree:
    """``NamedSharding(mesh, spec, memory_kind=memory_kind)`` per spec of ``specs``
    (``None``: the devices' default memory)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def constrain(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """``jax.lax.with_sharding_constraint`` of every leaf of ``tree`` to its spec (inside a
    jitted function: XLA lays the value out so, communicating where it must)."""
    return jax.lax.with_sharding_constraint(tree, named(mesh, specs))


def merge_shardings(state: PyTree, layouts: list[PyTree], mesh: Mesh) -> PyTree:
    """One ``NamedSharding`` per leaf of ``state`` (arrays or shapes) from several trees of
    them over ``mesh`` (one per technique that lays the state out, in order): each dimension
    split over every axis the layouts split it over (the earlier layout's axis major) where
    the dimension divides by their product, else over the earlier layouts' axes alone; the
    first memory kind a layout names."""

    def merged(leaf, *shardings):
        dims: list[list[str]] = [[] for _ in leaf.shape]
        for sharding in shardings:
            for dim, entry in enumerate(sharding.spec):
                names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n]
                split = math.prod(mesh.shape[n] for n in dims[dim] + names)
                if names and leaf.shape[dim] % split == 0:
                    dims[dim] += names
        while dims and not dims[-1]:
            dims.pop()
        spec = PartitionSpec(*(tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims))
        # A sharding made without a kind reports the device's: only host memory is a choice.
        kind = next((s.memory_kind for s in shardings if s.memory_kind not in (None, "device")),
                    None)  # fmt: skip
        return NamedSharding(mesh, spec, memory_kind=kind)

    return jax.tree.map(merged, state, *layouts)


def left_open(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    """``spec`` with every dimension it leaves whole ``UNCONSTRAINED`` (left to XLA, e.g. to
    another mesh axis's split) for a value of ``ndim`` dimensions."""
    dims = tuple(spec) + (None,) * (ndim - len(spec))
    return PartitionSpec(*(PartitionSpec.UNCONSTRAINED if d is None else d for d in dims))


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree`` whole on every device of ``mesh`` (:func:`constrain` to ``P()``): inside a
    jitted function, XLA all-gathers what is partitioned, and the transpose reduce-scatters
    the gradient. Inside a ``shard_map`` (a pipeline's stages), whole over the axes it leaves
    to XLA."""
    whole = jax.tree.map(lambda _: PartitionSpec(), tree)
    if jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.with_sharding_constraint(tree, whole)  # against the map's own mesh
    return constrain(tree, mesh, whole)


def to_memory(tree: PyTree, mesh: Mesh, specs: PyTree, memory_kind: str) -> PyTree:
    """``tree`` laid out by ``specs`` in ``memory_kind`` (:data:`MEMORY_KINDS`) of the mesh's
    devices: inside a jitted function, a transfer XLA schedules (host <-> device)."""
    return jax.device_put(tree, named(mesh, specs, memory_kind))


def partitioned_fraction(tree: PyTree, num_shards: int) -> float:
    """The fraction of ``tree``'s bytes that :func:`leaf_spec` partitions (1.0 for an empty
    tree)."""
    total = part = 0
    for x in jax.tree.leaves(tree):
        size = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        total += size
        if leaf_spec(tuple(x.shape), num_shards) != PartitionSpec():
            part += size
    return part / total if total else 1.0
