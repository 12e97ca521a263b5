"""A checkpoint directory knows which run it holds: ``run.json`` records the run's identity
(what decides its state's structure and meaning), so a resume of another run, or a new run over
an old one, is refused before anything is built or touched."""

from __future__ import annotations

import json
import os
from typing import Any

from lowmem_jax.core.paths import ensure_directory
from lowmem_jax.training.checkpointing import checkpoint_steps

__all__ = ["RUN_FILE", "RunMismatchError", "check_run"]


#: The file in a checkpoint directory that says which run made it (:func:`check_run`).
RUN_FILE = "run.json"


class RunMismatchError(ValueError):
    """A checkpoint directory holds another run than the command describes (or any run, for a
    new one): nothing in it was touched."""


def check_run(
    directory: str | os.PathLike, identity: dict[str, Any], *, resume: bool, overwrite: bool = False
) -> str | None:
    """Checks that ``directory`` is this run's, before anything is built, and records it.

    ``identity``: what decides the state's structure and meaning (model, data, plan, recipe,
    seed: :meth:`lowmem_jax.training.loop.TrainConfig.identity`), JSON-able; kept in
    ``<directory>/run.json``.

    * ``resume``: the recorded identity must equal ``identity`` (a directory from before run
      files existed is taken as it is, and gets one).
    * a new run: the directory must hold no checkpoint; with ``overwrite`` the old run is moved
      aside whole to ``<directory>.previous`` (``-1``, ``-2``, ... if taken) and its path
      returned.

    Raises:
      RunMismatchError: one line naming the differences (resume) or the checkpoints found and
        the three ways on (a new run); nothing is renamed, deleted or overwritten.
    """
    path = ensure_directory(directory, "checkpoint_dir")
    run_file = os.path.join(path, RUN_FILE)
    identity = json.loads(json.dumps(identity))  # tuples as lists, as read back
    recorded = None
    if os.path.exists(run_file):
        with open(run_file) as f:
            recorded = json.load(f)
    moved = None
    if resume and recorded is not None and recorded != identity:
        keys = sorted(set(recorded) | set(identity))
        diffs = [
            f"{k}: {recorded.get(k)!r} in the run, {identity.get(k)!r} in this command"
            for k in keys
            if recorded.get(k) != identity.get(k)
        ]
        raise RunMismatchError(
            f"checkpoint_dir={directory} holds a run of another configuration "
            f"({'; '.join(diffs)}): resume it with its own settings, or start this one in "
            "another checkpoint_dir"
        )
    steps = checkpoint_steps(path)
    if not resume and steps:
        if not overwrite:
            raise RunMismatchError(
                f"checkpoint_dir={directory} already holds a run (checkpoints at steps "
                f"{', '.join(map(str, steps))}): pass --resume to continue it, choose another "
                "--checkpoint-dir, or pass --overwrite to move it aside and start afresh"
            )
        moved, n = path + ".previous", 1
        while os.path.exists(moved):
            moved, n = f"{path}.previous-{n}", n + 1
        os.rename(path, moved)
        ensure_directory(path, "checkpoint_dir")
    if recorded != identity or moved:
        tmp = run_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(identity, f, indent=1, sort_keys=True)
        os.replace(tmp, run_file)  # atomic: a killed write leaves the old file or none
    return moved
