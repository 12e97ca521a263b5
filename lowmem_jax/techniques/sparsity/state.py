"""The sparse optimizer's state: its type, and where it sits in a (wrapped) optimizer state."""

from __future__ import annotations

from typing import NamedTuple

import jax

from lowmem_jax.core.base import PyTree

__all__ = ["SparseState", "find_state"]


class SparseState(NamedTuple):
    """The sparse optimizer's state (a pytree).

    Attributes:
      inner_state: the inner transform's state (its slots shaped like the stored parameters).
      pattern: ``{leaf_key: pattern}``, where each sparse leaf's non-zeros are: bool masks
        ``[*shape]`` (masked storage) or int32 flat positions ``[capacity]`` (compressed;
        ``size`` in unused slots), see :mod:`.storage`.
      count: int32 scalar, optimizer steps applied.
      threshold: float32 scalar, DSR's ``H`` (unused otherwise).
      rng: uint32 ``[2]`` raw key for random regrowth (``fold_in(rng, count)``).
    """

    inner_state: PyTree
    pattern: dict[str, jax.Array]
    count: jax.Array
    threshold: jax.Array
    rng: jax.Array


def find_state(tree: PyTree) -> SparseState:
    """The one :class:`SparseState` in ``tree`` (an optimizer state, possibly wrapped).

    Raises:
      ValueError: if ``tree`` holds none or several.
    """
    if isinstance(tree, SparseState):
        return tree
    found = []
    jax.tree.map(
        lambda x: found.append(x) if isinstance(x, SparseState) else None,
        tree,
        is_leaf=lambda x: isinstance(x, SparseState),
    )
    if len(found) != 1:
        raise ValueError(f"expected exactly one SparseState in opt_state, found {len(found)}")
    return found[0]
