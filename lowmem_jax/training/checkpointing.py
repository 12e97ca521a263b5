"""Periodic, atomic, keep-N checkpoints of a train state with Orbax, and exact resumption.

A checkpoint holds the whole :class:`~lowmem_jax.TrainState` pytree: parameters, optimizer state,
model state (BatchNorm statistics), loss-scale state, step and skip counters and the PRNG key.
Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-write leaves the previous checkpoint intact. Restoring needs the state's structure (an
abstract ``jax.eval_shape`` state is enough); static configuration such as the loss scale's
floor travels in that structure, not in the files.

A checkpoint that does not restore (a truncated or garbled array file, unreadable metadata) is
moved aside to ``<step>.corrupt`` with a warning naming the step and the cause, and the next
older one is tried (:meth:`Checkpointer.restore_newest`); if none restores, a
:class:`CheckpointError` names the directory and each step's cause.

Resuming is exact when the data order is a function of the step (the tasks of
:mod:`lowmem_jax.training.loop` seed each epoch's permutation and skip the batches already
consumed): the resumed run then applies the same updates in the same order as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from lowmem_jax.core.paths import ensure_directory
from lowmem_jax.training.metrics_writer import MetricsWriter

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "check_directory",
    "resume_or_start",
    "checkpoint_steps",
    "param_checksum",
    "tree_checksum",
    "restore_model",
]

PyTree = Any


class CheckpointError(RuntimeError):
    """No checkpoint in a directory restores; the message names each step and its cause."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that reads but holds another state than the one asked for (other leaves
    or shapes): made by another configuration, not corrupt."""


def _cause(err: BaseException) -> str:
    """The root cause of ``err`` on one line: ``Type: first line`` of the innermost exception
    (Orbax wraps TensorStore's errors in messages that print the whole array spec)."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


@contextlib.contextmanager
def _unraisable_silenced():
    """Orbax abandons the other arrays' read coroutines when one read fails; their errors
    would print as "Exception ignored" tracebacks when collected. The failure is reported once,
    by the caller."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = hook


def check_directory(directory: str | os.PathLike, *, resume: bool = False) -> None:
    """Checks, before anything is built, that ``directory`` can hold checkpoints.

    Creates it when missing (unless ``resume``).

    Raises:
      NotADirectoryError: ``directory`` is a file.
      PermissionError: it cannot be created or written.
      FileNotFoundError: ``resume`` and it holds no checkpoint (a mistyped path, or a run that
        never saved): resuming would silently start from step 0.
    """
    path = os.path.abspath(directory)
    if resume and not checkpoint_steps(path):
        where = "does not exist" if not os.path.exists(path) else "holds no checkpoint"
        if os.path.exists(path) and not os.path.isdir(path):
            where = "is a file, not a directory"
        raise FileNotFoundError(
            f"resume=True but checkpoint_dir={directory} {where}; leave out --resume to start "
            "a new run there"
        )
    ensure_directory(path, "checkpoint_dir")


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
        """Saves ``state`` as ``step`` if due (or forced); returns whether it saved. The
        state's checksum (:func:`tree_checksum`) goes beside it, in ``<step>.sha256``."""
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False
        saved = bool(self._manager.save(step, args=ocp.args.StandardSave(state), force=True))
        if saved:
            _write_atomically(self._checksum_path(step), tree_checksum(state))
            kept = {str(s) for s in self._manager.all_steps()}
            for name in os.listdir(self.directory):  # those of checkpoints Orbax deleted
                if name.endswith(".sha256") and name[: -len(".sha256")] not in kept:
                    os.remove(os.path.join(self.directory, name))
        return saved

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restores ``step`` (default: the latest) into the structure of ``target``.

        Raises:
          CheckpointError: the restored values fail the checksum saved with them (a flipped
            bit that the array files' format does not detect).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(target))
        why = _difference(_paths_and_shapes(restored), _paths_and_shapes(target))
        if why is not None:  # Orbax restores the saved shapes whatever the target's
            raise CheckpointMismatchError(why)
        path = self._checksum_path(step)
        if os.path.exists(path):  # checkpoints saved before checksums restore unchecked
            with open(path) as f:
                expected = f.read().strip()
            if tree_checksum(restored) != expected:
                raise CheckpointError(f"its values fail the checksum saved with them ({path})")
        return restored

    def _checksum_path(self, step: int) -> str:
        return os.path.join(self.directory, f"{step}.sha256")

    def _mismatch(self, target: Any, step: int) -> str | None:
        """Why ``step``'s saved tree has other leaves or shapes than ``target``'s, from its
        metadata; ``None`` when they agree or the metadata cannot be read (corruption, not a
        mismatch)."""
        try:
            saved = _paths_and_shapes(self._manager.item_metadata(step))
        except Exception:  # noqa: BLE001 - unreadable metadata is the corrupt case
            return None
        return _difference(saved, _paths_and_shapes(target))

    def restore_newest(self, target: Any) -> Any:
        """Restores the newest checkpoint that restores into the structure of ``target``.

        A checkpoint that fails (truncated or garbled array files, bad metadata) is moved aside
        to ``<step>.corrupt`` (kept for inspection; a later save of that step writes afresh)
        with a ``RuntimeWarning`` naming the step and the cause, and the next older is tried.

        Raises:
          FileNotFoundError: the directory holds no checkpoint.
          CheckpointError: none of its checkpoints restores.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        failures = []
        for step in steps:
            try:
                with _unraisable_silenced():
                    return self.restore(target, step)
            except Exception as err:  # noqa: BLE001 - any failure to read is a bad checkpoint
                why = str(err) if isinstance(err, CheckpointMismatchError) else None
                why = why or self._mismatch(target, step)
                if why is not None:  # the command differs from the run: nothing is moved
                    raise CheckpointError(
                        f"checkpoint step {step} in {self.directory} holds a state of another "
                        f"structure than this command builds ({why}): it was made by another "
                        "configuration; resume with that one's settings (nothing was moved)"
                    ) from err
                failures.append(f"step {step} ({_cause(err)})")
                aside = self._move_aside(step)
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} does not restore "
                    f"({_cause(err)}); moved to {aside}, trying the next older",
                    RuntimeWarning,
                    stacklevel=2,
                )
        raise CheckpointError(f"no checkpoint in {self.directory} restores: " + "; ".join(failures))

    def _move_aside(self, step: int) -> str:
        source = os.path.join(self.directory, str(step))
        target, n = source + ".corrupt", 1
        while os.path.exists(target):
            target, n = f"{source}.corrupt-{n}", n + 1
        os.rename(source, target)
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.close()


def tree_checksum(tree: PyTree) -> str:
    """SHA-256 over every leaf's shape, dtype and bytes, in tree order (host copies)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        array = np.asarray(leaf)
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _difference(saved: dict[str, tuple | None], wanted: dict[str, tuple | None]) -> str | None:
    """How a saved tree's leaves and shapes differ from the wanted ones, or ``None``."""
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        return f"leaves only in this command's state: {missing[:3]}; only saved: {extra[:3]}"
    for path, shape in wanted.items():
        if saved[path] is not None and shape is not None and tuple(saved[path]) != tuple(shape):
            return f"{path} saved with shape {tuple(saved[path])}, {tuple(shape)} here"
    return None


def _paths_and_shapes(tree: Any) -> dict[str, tuple | None]:
    """``{"params/w": shape}`` of a tree's leaves (a state, or Orbax's metadata of one)."""

    def name(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): getattr(v, "shape", None) for path, v in leaves}


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
    newest checkpoint that restores into ``state``'s structure when ``resume``
    (:meth:`Checkpointer.restore_newest`; a directory without a checkpoint is an error, see
    :func:`check_directory`), and a :class:`~lowmem_jax.training.metrics_writer.MetricsWriter` for
    per-epoch or per-eval records in ``checkpoint_dir`` (``metrics.jsonl``, and TensorBoard
    event files unless ``tensorboard=False``), opened at the restored step: records after it
    are dropped (JSON) or purged (TensorBoard). A loop keeps nothing lost or duplicated by
    writing a step's record before saving that step's checkpoint.
    """
    if not checkpoint_dir:
        return None, state, None
    check_directory(checkpoint_dir, resume=resume)
    checkpointer = Checkpointer(checkpoint_dir, every=every, keep=keep)
    if resume:
        try:
            state = checkpointer.restore_newest(state)
        except Exception:
            checkpointer.close()
            raise
    metrics = MetricsWriter(checkpoint_dir, start_step=int(state.step), tensorboard=tensorboard)
    return checkpointer, state, metrics


def restore_model(directory: str | os.PathLike) -> tuple[PyTree, PyTree, int]:
    """``(params, model_state, step)`` of the newest checkpoint in ``directory``, as saved (no
    target structure needed: e.g. a dense model's parameters to decompose).

    Raises:
      FileNotFoundError: ``directory`` holds no checkpoint.
      CheckpointError: the newest checkpoint does not restore, or holds no train state.
    """
    steps = checkpoint_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {os.path.abspath(directory)}")
    manager = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        with _unraisable_silenced():
            tree = manager.restore(steps[-1], args=ocp.args.StandardRestore())
    except Exception as err:  # noqa: BLE001 - any failure to read is a bad checkpoint
        raise CheckpointError(
            f"checkpoint step {steps[-1]} in {directory} does not restore ({_cause(err)})"
        ) from err
    finally:
        manager.close()
    if not isinstance(tree, dict) or "params" not in tree:
        raise CheckpointError(f"checkpoint step {steps[-1]} in {directory} holds no train state")
    return tree["params"], tree.get("model_state") or {}, steps[-1]


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints in a :class:`Checkpointer` directory, ascending.

    Orbax names each step's directory by the step; in-progress writes carry a temporary suffix
    and are not listed.
    """
    if not os.path.isdir(directory):
        return []
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def param_checksum(params: PyTree) -> str:
    """sha256 of the parameters' bytes in tree order: equal iff bitwise-equal parameters."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()
