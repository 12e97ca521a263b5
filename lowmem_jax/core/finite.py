"""The skip rule's pieces: whether a tree is finite, and a choice between two trees, without a
host sync (the step keeps the old state where anything it would apply is not finite)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowmem_jax.core.base import PyTree

__all__ = ["all_finite", "select_tree"]


def all_finite(tree: PyTree) -> jax.Array:
    """A scalar bool array: True iff every element of every floating leaf is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Leafwise ``where(pred, on_true, on_false)`` for a scalar bool ``pred``; no host sync."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
