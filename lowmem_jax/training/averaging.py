"""The element-wise mean of checkpoints (fairseq ``average_checkpoints.py``): of pytrees
(:func:`average_checkpoints`), or of the newest ``n`` checkpoints of a
:class:`~lowmem_jax.training.checkpointing.Checkpointer` directory
(:func:`average_last_checkpoints`; ``lowmem train --average-last``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.training.checkpointing import Checkpointer, checkpoint_steps

__all__ = ["average_checkpoints", "average_last_checkpoints"]

PyTree = Any


def average_checkpoints(trees: Sequence[PyTree]) -> PyTree:
    """The element-wise mean of ``N`` pytrees of one structure (fairseq
    ``average_checkpoints.py``).

    Floating leaves: ``sum_i p_i / N`` accumulated in float32 (float64 stays float64) and cast
    back to the leaf's dtype; integer leaves: ``sum_i p_i // N`` (as fairseq).

    Raises:
      ValueError: for an empty sequence or pytrees of different structures or shapes.
    """
    trees = list(trees)
    if not trees:
        raise ValueError("trees must hold at least one pytree")
    structure = jax.tree.structure(trees[0])
    for i, tree in enumerate(trees[1:], 1):
        if jax.tree.structure(tree) != structure:
            raise ValueError(f"trees[{i}] has a different structure than trees[0]")
    n = len(trees)

    def mean(*leaves):
        shapes = {jnp.shape(x) for x in leaves}
        if len(shapes) != 1:
            raise ValueError(f"leaf shapes differ across trees: {sorted(shapes)}")
        dtype = jnp.result_type(leaves[0])
        if jnp.issubdtype(dtype, jnp.floating):
            acc = jnp.promote_types(dtype, jnp.float32)
            return (sum(jnp.asarray(x, acc) for x in leaves) / n).astype(dtype)
        return (sum(jnp.asarray(x) for x in leaves) // n).astype(dtype)

    return jax.tree.map(mean, *trees)


def average_last_checkpoints(
    checkpointer: Checkpointer | str | os.PathLike,
    target: Any,
    n: int,
    params: Callable[[Any], PyTree] = lambda state: state.params,
) -> tuple[PyTree, list[int]]:
    """Restores the newest ``n`` checkpoints and averages ``params(state)`` of each.

    Args:
      checkpointer: a :class:`Checkpointer` or its directory.
      target: the saved structure (a ``TrainState`` or its ``jax.eval_shape``).
      n: how many of the newest checkpoints to average (fairseq ``--num-epoch-checkpoints``).
      params: what to average of a restored state (default its stored ``params``; a sparse run
        averages the materialized dense weights, ``lambda s: lm.model_params(s, tx)``).

    Returns:
      ``(params, steps)``: the averaged parameters and the steps averaged (ascending).

    Raises:
      ValueError: for ``n < 1``.
      FileNotFoundError: if the directory holds fewer than ``n`` checkpoints.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    own = not isinstance(checkpointer, Checkpointer)
    if own:
        checkpointer = Checkpointer(str(checkpointer), keep=max(n, 1))
    try:
        steps = checkpoint_steps(checkpointer.directory)[-n:]
        if len(steps) < n:
            raise FileNotFoundError(
                f"average of the last n={n} checkpoints needs {n}, found {len(steps)} in "
                f"{checkpointer.directory}"
            )
        trees = [params(checkpointer.restore(target, step=s)) for s in steps]
    finally:
        if own:
            checkpointer.close()
    return average_checkpoints(trees), steps
