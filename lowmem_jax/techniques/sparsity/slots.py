"""Finding the optimizer slots that mirror the parameters, in ANY optax state.

A *mirror* is a subtree of the optimizer state whose tree structure equals the parameters' and
whose leaves have the parameters' shapes (dtypes may differ): SGD's momentum ``trace``, Adam's
``mu`` and ``nu``, the inner state of ``inject_hyperparams``, a user's own transform... No list
of state classes is involved, so new optimizers work unchanged. (A single-array parameter tree
makes every same-shaped array a mirror.) A quantized slot
(:class:`lowmem_jax.codecs.quantization.Quantized`, of an int8 / int4 stored state) is one leaf of
its parameter's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.codecs import quantization
from lowmem_jax.codecs.state_format import is_quantized

PyTree = Any

__all__ = ["mirror_predicate", "find_mirrors", "map_mirrors", "zero_where", "values"]


def mirror_predicate(params: PyTree) -> Callable[[Any], bool]:
    """``is_mirror(node) -> bool`` for subtrees shaped like ``params``."""
    treedef = jax.tree.structure(params)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]

    def is_mirror(node) -> bool:
        if jax.tree.structure(node, is_leaf=is_quantized) != treedef:
            return False
        leaves = jax.tree.leaves(node, is_leaf=is_quantized)
        return all(
            hasattr(x, "shape") and tuple(x.shape) == s for x, s in zip(leaves, shapes, strict=True)
        )

    return is_mirror


def find_mirrors(state: PyTree, params: PyTree) -> list[PyTree]:
    """Every mirror of ``params`` in ``state``, outermost first, in tree order."""
    is_mirror = mirror_predicate(params)
    found = []
    jax.tree.map(lambda x: found.append(x) if is_mirror(x) else None, state, is_leaf=is_mirror)
    return found


def map_mirrors(fn: Callable[[PyTree], PyTree], state: PyTree, params: PyTree) -> PyTree:
    """``state`` with ``fn(mirror)`` in place of every mirror of ``params``."""
    is_mirror = mirror_predicate(params)
    return jax.tree.map(lambda x: fn(x) if is_mirror(x) else x, state, is_leaf=is_mirror)


def zero_where(slot: Any, keep: jax.Array) -> Any:
    """``slot`` (an array, or a quantized int8 / int4 one: reset in its codes) with the
    elements not kept zeroed."""
    if is_quantized(slot):
        return quantization.zero_where(slot, keep)
    return jnp.where(keep, slot, jnp.zeros_like(slot))


def values(slot: Any) -> jax.Array:
    """A slot's values (a quantized slot decoded to float32)."""
    return quantization.dequantize(slot) if is_quantized(slot) else slot
