"""How a sparse layer is kept in the train state: masked (dense + mask) or compressed.

Each sparse leaf has a *pattern*, the part of the optimizer state that says where its non-zeros
are, and a *stored* form in the train state's ``params``:

==============  =====================================  =========================================
storage         pattern                                stored parameter
==============  =====================================  =========================================
masked          bool ``[*shape]`` (1 byte per weight)  the dense leaf, zero off the mask
compressed      int32 ``[capacity]`` flat positions,   the values ``[capacity]``, zero in
                ``size`` in unused slots               unused slots
==============  =====================================  =========================================

A *slot* is one element of the stored leaf flattened: a dense position (masked) or a capacity
slot (compressed). Both classes answer the same questions, so the sparse optimizer
(:mod:`.transform`) never asks which storage it has:

* :meth:`~Storage.capacity`: non-zeros a layer may hold (``size`` or ``capacity``);
* :meth:`~Storage.pattern`, :meth:`~Storage.store`: a dense mask and leaf -> pattern, stored leaf;
* :meth:`~Storage.materialize`: stored leaf -> dense leaf (compressed: a scatter, transient);
* :meth:`~Storage.materialize_blockwise`: the same for a leaf of stacked blocks, which the
  block loop densifies one block at a time (compressed: :class:`CompressedStack`);
* :meth:`~Storage.materialize_lazy`: the same for any other leaf, densified where the model
  reads it (compressed: :class:`CompressedLeaf`);
* :meth:`~Storage.live`: bool per slot, which slots hold a non-zero weight;
* :meth:`~Storage.gather`: a dense gradient -> the stored layout;
* :meth:`~Storage.rewire`: one prune-and-regrow update in this storage
  (:func:`~.algorithms.rewire` on dense masks, :func:`~.algorithms.rewire_compressed` on slots,
  which select the same weights).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowmem_jax.core.base import BlockwiseLeaf, LazyLeaf
from lowmem_jax.techniques.sparsity import algorithms

__all__ = [
    "LeafSpec",
    "Storage",
    "MaskedStorage",
    "CompressedStorage",
    "CompressedStack",
    "CompressedLeaf",
    "CompressedBlock",
    "MASKED",
    "COMPRESSED",
]


class LeafSpec(NamedTuple):
    """One sparse leaf.

    Attributes:
      key: ``"a/b/kernel"``, the leaf's path (the keys of ``SparseState.pattern``).
      shape: the dense shape.
      size: ``prod(shape)``.
      budget: non-zeros at initialisation (from ``density`` and ``distribution``).
      capacity: compressed storage length ``min(size, ceil(capacity_factor * budget))``.
    """

    key: str
    shape: tuple[int, ...]
    size: int
    budget: int
    capacity: int


class Storage:
    """The interface of :class:`MaskedStorage` and :class:`CompressedStorage` (module doc).

    Flat arrays are per layer: ``[size]`` dense, ``[capacity(spec)]`` stored.
    """

    name: str

    def capacity(self, spec: LeafSpec) -> int:
        raise NotImplementedError

    def pattern(self, mask: jax.Array, spec: LeafSpec) -> jax.Array:
        """The pattern of a dense bool ``mask [*shape]``."""
        raise NotImplementedError

    def store(self, leaf: jax.Array, pattern: jax.Array, spec: LeafSpec) -> jax.Array:
        """The stored form of a dense ``leaf`` under ``pattern``."""
        raise NotImplementedError

    def materialize(self, stored: jax.Array, pattern: jax.Array, spec: LeafSpec) -> jax.Array:
        """The dense leaf ``[*shape]`` of a stored one."""
        raise NotImplementedError

    def materialize_blockwise(
        self, stored: jax.Array, pattern: jax.Array, spec: LeafSpec
    ) -> jax.Array | BlockwiseLeaf:
        """A leaf of ``L`` stacked blocks (``[L, *block_shape]``) as the block loop reads it:
        here the dense leaf; a storage that can build one block's weights from the stored
        form alone returns a :class:`~lowmem_jax.core.base.BlockwiseLeaf`."""
        return self.materialize(stored, pattern, spec)

    def materialize_lazy(
        self, stored: jax.Array, pattern: jax.Array, spec: LeafSpec
    ) -> jax.Array | LazyLeaf:
        """A leaf as the step's loss hands it to the model: here the dense leaf; a storage
        whose dense form is worth building only where a layer reads it returns a
        :class:`~lowmem_jax.core.base.LazyLeaf`."""
        return self.materialize(stored, pattern, spec)

    def live(self, pattern: jax.Array, spec: LeafSpec) -> jax.Array:
        """bool ``[capacity]``: the slots that hold a non-zero weight."""
        raise NotImplementedError

    def gather(self, dense: jax.Array, pattern: jax.Array, spec: LeafSpec) -> jax.Array:
        """A flat dense ``[size]`` array (a gradient) in the stored layout, 0 off the pattern."""
        raise NotImplementedError

    def rewire(
        self,
        how: algorithms.Rewiring,
        *,
        specs: tuple[LeafSpec, ...],
        values: list[jax.Array],
        patterns: list[jax.Array],
        live: list[jax.Array],
    ) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
        """One update (``how``: its ``grads`` dense and flat, its ``momentum`` flat and
        stored) from the flat stored ``values`` after this step's update.

        Returns ``(keep, new patterns, threshold)``: per layer, bool ``[capacity]`` the slots
        whose weights survive with their values and optimizer slots (every other slot is zeroed:
        pruned, or regrown at 0), then the new patterns and DSR's threshold.
        """
        raise NotImplementedError

    def nnz(self, pattern: jax.Array, spec: LeafSpec) -> jax.Array:
        """int32: the non-zeros the pattern allows."""
        return self.live(pattern, spec).sum(dtype=jnp.int32)


class MaskedStorage(Storage):
    """Dense weights and a bool mask: more memory than dense training; the reference."""

    name = "masked"

    def capacity(self, spec):
        return spec.size

    def pattern(self, mask, spec):
        return jnp.asarray(mask, bool).reshape(spec.shape)

    def store(self, leaf, pattern, spec):
        return jnp.where(pattern, leaf, 0)

    def materialize(self, stored, pattern, spec):
        return stored

    def live(self, pattern, spec):
        return pattern.reshape(-1)

    def gather(self, dense, pattern, spec):
        return jnp.where(self.live(pattern, spec), dense, 0)

    def rewire(self, how, *, specs, values, patterns, live):
        caps = tuple(s.size for s in specs)
        out = algorithms.rewire(how, weights=values, masks=live, caps=caps)
        masks = [m.reshape(s.shape) for m, s in zip(out.masks, specs, strict=True)]
        return out.survivors, masks, out.threshold


class CompressedStorage(Storage):
    """Values ``[capacity]`` and int32 indices ``[capacity]``: memory in proportion to the
    non-zeros (the capacity is fixed per layer, see ``SparseConfig.capacity_factor``).

    Slots are stable: a surviving weight keeps its slot, a regrown weight takes a freed one, so
    masked and compressed storage follow the same trajectory."""

    name = "compressed"

    def capacity(self, spec):
        return spec.capacity

    def pattern(self, mask, spec):
        (idx,) = jnp.nonzero(mask.reshape(-1), size=spec.capacity, fill_value=spec.size)
        return idx.astype(jnp.int32)

    def store(self, leaf, pattern, spec):
        return self.gather(leaf.reshape(-1), pattern, spec)

    def materialize(self, stored, pattern, spec):
        return _scatter(stored, pattern, spec.size).reshape(spec.shape)

    def materialize_blockwise(self, stored, pattern, spec):
        return CompressedStack(stored, pattern, spec.shape)

    def materialize_lazy(self, stored, pattern, spec):
        return CompressedLeaf(stored, pattern, spec.shape)

    def live(self, pattern, spec):
        return pattern < spec.size

    def gather(self, dense, pattern, spec):
        # Unused slots hold index `size`: out of range, so they read 0.
        return dense.at[pattern].get(mode="fill", fill_value=0)

    def rewire(self, how, *, specs, values, patterns, live):
        # Per layer, in the [capacity] slots; dense [n] temporaries one layer at a time.
        sizes = tuple(s.size for s in specs)
        out = algorithms.rewire_compressed(how, values=values, indices=patterns, sizes=sizes)
        return out.survivors, out.indices, out.threshold


def _scatter(values: jax.Array, positions: jax.Array, size: int) -> jax.Array:
    """Flat ``[size]``: ``values`` at ``positions``, 0 elsewhere; positions outside
    ``[0, size)`` are dropped (unused slots, other blocks' weights).

    The positions in range are distinct, and the others are made distinct (``size + slot``), so
    the scatter may promise unique indices: JAX's derivative of a scatter that cannot (and
    XLA:CPU's lowering of one) tracks which update won with dense int32 maps of the layer.

    The zeros it writes into are computed from ``positions`` (``min(|p_0|, 0)``, always 0; a
    block's positions may be negative), so XLA cannot share one zero array among scatters: a
    shared one is copied per scatter, and XLA:CPU schedules those copies (each layer's dense
    weights) at the start of the step, which keeps every layer's dense weights live at once.
    """
    slot = jnp.arange(positions.shape[0], dtype=jnp.int32)
    distinct = jnp.where((positions >= 0) & (positions < size), positions, size + slot)
    zero = jnp.minimum(jnp.abs(positions[0]), 0).astype(values.dtype)
    zeros = jnp.broadcast_to(zero, (size,))
    return zeros.at[distinct].set(values, mode="drop", unique_indices=True)


class _Compressed:
    """``values`` ``[capacity]`` at the flat positions ``indices`` of a dense ``shape`` (a
    pytree: the arrays are children, so casts and gradients reach them)."""

    def __init__(self, values: jax.Array, indices: jax.Array, shape: tuple[int, ...]):
        self.values, self.indices, self.shape = values, indices, tuple(shape)

    @property
    def dtype(self):
        return self.values.dtype

    def tree_flatten(self):
        return (self.values, self.indices), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(*children, shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, capacity={self.values.shape[0]})"


@jax.tree_util.register_pytree_node_class
class CompressedStack(_Compressed, BlockwiseLeaf):
    """A compressed leaf of ``L`` stacked blocks: ``values`` ``[capacity]`` at the flat
    positions ``indices`` of the dense ``shape = [L, *block_shape]``. Block ``i`` holds the
    positions ``[i * n, (i + 1) * n)``, ``n = prod(block_shape)``; :meth:`block` scatters
    the ``[capacity]`` values into ``[n]`` fresh zeros, dropping the other blocks' (O(capacity)
    work per block; its gradient w.r.t. ``values`` is a gather)."""

    def block(self, index):
        n = math.prod(self.shape[1:])
        local = self.indices - jnp.asarray(index, jnp.int32) * n
        return _scatter(self.values, local, n).reshape(self.shape[1:])

    def dense(self) -> jax.Array:
        """All blocks, ``[L, *block_shape]``."""
        return _scatter(self.values, self.indices, math.prod(self.shape)).reshape(self.shape)


@jax.tree_util.register_pytree_node_class
class CompressedLeaf(_Compressed, LazyLeaf):
    """A compressed leaf, ``values`` ``[capacity]`` at the flat positions ``indices`` of the
    dense ``shape``, densified (a scatter into zeros, O(size)) where the model reads it: Linen's
    ``self.param`` unboxes it (a ``flax.core.meta.AxisMetadata``), NNX layers index it
    (``kernel[...]``), ``jnp`` converts it through ``__jax_array__``. Under remat the layer's
    backward pass scatters again instead of keeping the dense weights from the forward pass; its
    gradient w.r.t. ``values`` is a gather.

    A Linen transform that maps over the leaf's leading axis (``nn.scan``, ``nn.vmap``) gets a
    :class:`CompressedBlock` per block (:meth:`remove_axis`); one that slices the arrays
    themselves (``nnx.scan``, ``jax.lax.scan``) fails on this leaf, and the step then hands the
    model :meth:`sliceable` forms instead (:func:`lowmem_jax.core.base.differentiated_loss`)."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dense(self) -> jax.Array:
        size = math.prod(self.shape)
        return _scatter(self.values, self.indices, size).reshape(self.shape)

    def add_axis(self, index, params):
        raise ValueError("a compressed sparse leaf cannot be stacked by a transform")

    def remove_axis(self, index, params):
        """What a transform that maps over the leading axis (``nn.scan``, ``nn.vmap``) slices:
        a :class:`CompressedBlock` per block, the compressed arrays closed over."""
        block = self.sliceable() if index == 0 else None
        if block is None:
            raise ValueError(f"a compressed sparse leaf is sliced on axis 0 only, not {index}")
        return block

    def sliceable(self) -> CompressedBlock | None:
        """Every block at once: a :class:`CompressedBlock` whose only child, the block index
        ``[L]``, is what a transform that slices the arrays (``nnx.scan``) slices; ``None`` for
        a scalar (no leading axis)."""
        if not self.shape:
            return None
        return CompressedBlock(jnp.arange(self.shape[0], dtype=jnp.int32), self, self.shape)


@jax.tree_util.register_pytree_node_class
class CompressedBlock(LazyLeaf):
    """Block ``index`` of a :class:`CompressedLeaf` of stacked blocks (``stack``), as a
    transform that maps over the leaf's leading axis hands it to each block: the only child is
    ``index`` (``[L]`` outside the transform, which slices it to a scalar), and the stack's
    compressed arrays are closed over (aux data, compared by identity). Densified like
    :meth:`CompressedStack.block` where the layer reads it, O(capacity) per block."""

    def __init__(self, index: jax.Array, stack: CompressedLeaf, stack_shape: tuple[int, ...]):
        self.index, self.stack, self.stack_shape = index, stack, tuple(stack_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack_shape[1:] if jnp.ndim(self.index) == 0 else self.stack_shape

    @property
    def dtype(self):
        return self.stack.values.dtype

    def tree_flatten(self):
        return (self.index,), (self.stack, self.stack_shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def dense(self) -> jax.Array:
        if jnp.ndim(self.index) != 0:  # restacked by the transform: every block
            return self.stack.dense()
        return CompressedStack(self.stack.values, self.stack.indices, self.stack_shape).block(
            self.index
        )

    def add_axis(self, index, params):
        return self  # the transform stacked ``index`` back

    def remove_axis(self, index, params):
        raise ValueError("a block of a compressed sparse leaf cannot be sliced again")


MASKED = MaskedStorage()
COMPRESSED = CompressedStorage()
