"""Periodic, atomic, keep-N checkpoints of a train state with Orbax, and exact resumption.

A checkpoint holds the whole :class:`~lowmem_jax.TrainState` pytree: parameters, optimizer state,
model state (BatchNorm statistics), loss-scale state, step and skip counters and the PRNG key.
Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-write leaves the previous checkpoint intact. Restoring needs the state's structure (an
abstract ``jax.eval_shape`` state is enough); static configuration such as the loss scale's
floor travels in that structure, not in the files.

Resuming is exact when the data order is a function of the step (``run.py`` seeds each epoch's
permutation and skips the batches already consumed): the resumed run then applies the same
updates in the same order as an uninterrupted one.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from lowmem_jax.metrics_writer import MetricsWriter

__all__ = ["Checkpointer", "resume_or_start"]


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
