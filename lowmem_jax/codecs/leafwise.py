"""A tree-wide optimizer update run one group of parameter leaves at a time.

An optax ``update(grads, state, params)`` maps whole pytrees; most (``adam``, ``sgd``,
``lion``, ``adafactor``, ``lamb``...) are *separable*: leaf ``i`` of the updates and of the
state's parameter-shaped subtrees depends only on leaf ``i`` of the inputs and on the state's
shared leaves (step counts, injected hyperparameters). Such an update can run on one group of
leaves at a time, with every other leaf replaced by an empty placeholder (``float32[0]``), and
its results stitched back together: the same numbers, but a caller that decodes the state
before and encodes it after each group (:mod:`lowmem_jax.techniques.optimizer_state.quantized`)
holds one group's decoded arrays at a time instead of the whole state's.

* :func:`mirrors` splits a state into its parameter-shaped subtrees (*mirrors*: their structure
  is the parameters') and its shared leaves. Structure alone, unlike
  :func:`lowmem_jax.techniques.sparsity.slots.mirror_predicate` (which also matches shapes):
  Adafactor's factored rows and a group's empty placeholders are mirrors here. A node of a type
  declared with :func:`unit` stands for one parameter leaf (e.g. a second moment stored as its row
  and column means): it sits at its parameter's position, whatever leaves it holds.
* :func:`separability` decides from the update's jaxpr (traced on shapes, nothing runs) whether
  it is separable: a forward data-flow pass gives each output the set of parameter positions it
  reads (``pjit``, ``custom_jvp`` and the like are entered; other higher-order primitives count
  as reading all their operands). A global-norm clip or a finiteness check over all gradients
  is not separable: the caller updates the whole tree at once and says why.
* :func:`groups` packs leaves, in order, into groups of at most the largest leaf's size, so that
  the peak holds one group's transients and the number of groups (traces) stays small.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lowmem_jax.core.base import PyTree

__all__ = ["Mirrors", "mirrors", "separability", "groups", "placeholder", "unit", "is_unit"]


_UNITS: set[type] = set()


def unit(cls: type) -> type:
    """Class decorator: a pytree node of type ``cls`` in an optimizer state stands for one
    parameter leaf (:class:`Mirrors` keeps it whole at its parameter's position)."""
    _UNITS.add(cls)
    return cls


def is_unit(node: Any) -> bool:
    """Whether ``node`` is of a type declared with :func:`unit`."""
    return type(node) in _UNITS


def placeholder(x: Any, dtype: Any = None, ndim: int | None = None) -> Any:
    """The empty stand-in for a leaf outside the group: ``dtype[0, ..., 0]`` with ``x``'s rank
    (``ndim`` where given; at least one axis), default ``x.dtype``; ``None`` stays. A NumPy
    constant: nothing is traced for it, and the update's operations on it, reductions over its
    axes included, trace as operations on an empty array."""
    if dtype is None:
        if x is None or not hasattr(x, "dtype"):
            return x
        dtype = x.dtype
    return _empty(np.dtype(dtype), max(np.ndim(x) if ndim is None else ndim, 1))


@functools.cache
def _empty(dtype: np.dtype, ndim: int) -> np.ndarray:
    return np.zeros((0,) * ndim, dtype)


class Mirrors:
    """A state's outer leaves (``outer``: each a mirror subtree or a shared leaf) and, for each
    outer leaf, its leaves (a mirror's in parameter order, each a leaf or a :func:`unit`; a
    shared leaf as a one-item list)."""

    def __init__(self, state: PyTree, params_def, is_leaf: Callable[[Any], bool] | None):
        self.params_def = params_def
        self.is_leaf = is_leaf = _or_unit(is_leaf)

        def is_mirror(node) -> bool:
            return jax.tree.structure(node, is_leaf=is_leaf) == params_def

        def stop(node) -> bool:
            return is_leaf(node) or is_mirror(node)

        outer, self.outer_def = jax.tree.flatten(state, is_leaf=stop)
        self.kinds = [is_mirror(node) for node in outer]
        self.leaves = [
            params_def.flatten_up_to(node) if mirror else [node]
            for node, mirror in zip(outer, self.kinds, strict=True)
        ]

    def rebuild(self, leaves: Sequence[list]) -> PyTree:
        """The state with outer leaf ``k``'s leaves replaced by ``leaves[k]``."""
        outer = [
            self.params_def.unflatten(new) if mirror else new[0]
            for new, mirror in zip(leaves, self.kinds, strict=True)
        ]
        return jax.tree.unflatten(self.outer_def, outer)


def _or_unit(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    return lambda node: is_unit(node) or (is_leaf is not None and is_leaf(node))


def mirrors(state: PyTree, params_def, is_leaf: Callable[[Any], bool] | None = None) -> Mirrors:
    """``state`` split into parameter-shaped subtrees and shared leaves (see :class:`Mirrors`)."""
    return Mirrors(state, params_def, is_leaf)


def _sub_jaxpr(eqn):
    """The one sub-jaxpr an equation calls with its own operands (``pjit``, ``custom_jvp_call``,
    ``remat``, ``closed_call``...), or ``None`` (no sub-jaxpr, or a loop or a branch)."""
    found = []
    for value in eqn.params.values():
        jaxpr = getattr(value, "jaxpr", value)
        if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
            found.append(jaxpr)
    if len(found) != 1:
        return None
    jaxpr = found[0]
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr


def _reads(jaxpr, inputs: list[int]) -> list[int]:
    """For each output of ``jaxpr``: the union (bitmask) of the masks of the inputs it reads."""
    env: dict[Any, int] = {v: m for v, m in zip(jaxpr.invars, inputs, strict=True)}

    def read(atom) -> int:
        return env.get(atom, 0) if not hasattr(atom, "val") else 0

    for eqn in jaxpr.eqns:
        masks = [read(a) for a in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            outs = _reads(sub, masks)
        else:
            union = 0
            for m in masks:
                union |= m
            outs = [union] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return [read(v) for v in jaxpr.outvars]


def separability(
    update: Callable, grads: PyTree, state: PyTree, params: PyTree | None
) -> str | None:
    """``None`` when ``update(grads, state, params) -> (updates, new_state)`` is separable over
    the leaves of ``grads``; otherwise why not, in a few words. Traced on shapes only."""
    params_def = jax.tree.structure(grads)
    count = params_def.num_leaves
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (grads, state))
    params_shape = (
        None
        if params is None
        else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    )
    closed, out_shape = jax.make_jaxpr(update, return_shape=True)(*shapes, params_shape)

    def position_masks(tree) -> list[int]:
        split = mirrors(tree, params_def)
        return [  # a unit's every leaf is its parameter's
            (1 << i) if mirror else 0
            for leaves, mirror in zip(split.leaves, split.kinds, strict=True)
            for i, node in enumerate(leaves)
            for _ in jax.tree.leaves(node)
        ]

    own = [1 << i for i in range(count)]
    inputs = own + position_masks(state) + ([] if params is None else own)
    outputs = _reads(closed.jaxpr, inputs)
    updates_def = jax.tree.structure(out_shape[0])
    if updates_def != params_def:
        return "its updates are not shaped like the gradients"
    wanted = own + position_masks(out_shape[1])
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    for got, allowed in zip(outputs, wanted, strict=True):
        extra = got & ~allowed
        if extra:
            reads = [names[i] for i in range(count) if extra >> i & 1]
            more = f" and {len(reads) - 1} more" if len(reads) > 1 else ""
            return f"an output reads the leaf {reads[0]}{more}"
    return None


def groups(sizes: Sequence[int], capacity: int | None = None) -> list[list[int]]:
    """Leaf indices ``0 .. len(sizes) - 1`` packed in order into groups of at most ``capacity``
    elements (default: the largest size; a larger leaf is a group of its own)."""
    limit = max(sizes, default=0) if capacity is None else capacity
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if out and total + size <= limit:
            out[-1].append(i)
            total += size
        else:
            out.append([i])
            total = size
    return out
