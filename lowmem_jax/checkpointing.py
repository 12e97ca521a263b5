"""Periodic, atomic, keep-N checkpoints of a train state with Orbax, and exact resumption.

A checkpoint holds the whole :class:`~lowmem_jax.TrainState` pytree: parameters, optimizer state,
model state (BatchNorm statistics), loss-scale state, step and skip counters and the PRNG key.
Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-write leaves the previous checkpoint intact. Restoring needs the state's structure (an
abstract ``jax.eval_shape`` state is enough); static configuration such as the loss scale's
floor travels in that structure, not in the files.

Resuming is exact when the data order is a function of the step (the tasks of
:mod:`lowmem_jax.loop` seed each epoch's permutation and skip the batches already consumed): the
resumed run then applies the same updates in the same order as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lowmem_jax.metrics_writer import MetricsWriter

__all__ = [
    "Checkpointer",
    "resume_or_start",
    "checkpoint_steps",
    "average_checkpoints",
    "average_last_checkpoints",
    "param_checksum",
]

PyTree = Any


class Checkpointer:
    """Saves every ``every`` steps into ``directory``, keeping the newest ``keep``.

    Args:
      directory: where step subdirectories go (created if missing).
      every: save when ``step % every == 0`` (and whenever ``save(..., force=True)``).
      keep: how many checkpoints to keep (oldest deleted first).
    """

    def __init__(self, directory: str, *, every: int = 100, keep: int = 3):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self.every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                save_interval_steps=1,  # the interval is decided here, see save()
                enable_async_checkpointing=False,  # a save returns once it is on disk
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves ``state`` as ``step`` if due (or forced); returns whether it saved."""
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False
        return bool(self._manager.save(step, args=ocp.args.StandardSave(state), force=True))

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restores ``step`` (default: the latest) into the structure of ``target``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self._manager.restore(step, args=ocp.args.StandardRestore(target))

    def close(self) -> None:
        self._manager.close()


def resume_or_start(
    state: Any,
    checkpoint_dir: str | None,
    *,
    every: int,
    keep: int,
    resume: bool,
    tensorboard: bool = True,
) -> tuple[Checkpointer | None, Any, MetricsWriter | None]:
    """The training loops' checkpoint set-up: ``(checkpointer, state, metrics)``.

    Without ``checkpoint_dir``: ``(None, state, None)``. With it: a :class:`Checkpointer`, the
    newest checkpoint restored into ``state``'s structure when ``resume`` (``state`` itself when
    there is none yet), and a :class:`~lowmem_jax.metrics_writer.MetricsWriter` for per-epoch or
    per-eval records in ``checkpoint_dir`` (``metrics.jsonl``, and TensorBoard event files
    unless ``tensorboard=False``), opened at the restored step: records after it are dropped
    (JSON) or purged (TensorBoard). A loop keeps nothing lost or duplicated by writing a step's
    record before saving that step's checkpoint.
    """
    if not checkpoint_dir:
        return None, state, None
    checkpointer = Checkpointer(checkpoint_dir, every=every, keep=keep)
    if resume and checkpointer.latest_step() is not None:
        state = checkpointer.restore(state)
    metrics = MetricsWriter(checkpoint_dir, start_step=int(state.step), tensorboard=tensorboard)
    return checkpointer, state, metrics


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in a :class:`Checkpointer` directory, ascending.

    Orbax names each step's directory by the step; in-progress writes carry a temporary suffix
    and are not listed.
    """
    if not os.path.isdir(directory):
        return []
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


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


def param_checksum(params: PyTree) -> str:
    """sha256 of the parameters' bytes in tree order: equal iff bitwise-equal parameters."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()
