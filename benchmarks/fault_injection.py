"""Fault injection on a checkpoint directory: what the user sees, and whether every good
checkpoint survives.

A small train-state-like tree is saved at steps 1, 2 and 3 (lowmem_jax.training.checkpointing, Orbax
underneath), once; each case copies that directory, injects one fault, then does what a user
does next (resume; start a run), and records:

* ``sees``: the outcome (the step restored, or the one-line error) and any warning;
* ``restored_as_saved``: the values restored equal those saved at that step (no silent
  corruption);
* ``intact``: every checkpoint not damaged by the fault is still there, unrenamed and
  byte-identical; a damaged one is moved aside to ``<step>.corrupt`` (kept), never deleted.

Cases: a write killed mid-way (Orbax's temporary directory left behind); each file of the newest
checkpoint truncated; each file with one byte flipped; a full disk during a save; a second run
pointed at the directory; a resume with each identity field changed (device count included).

    python benchmarks/fault_injection.py --out-dir benchmarks/results

writes ``fault_injection.json`` and ``fault_injection.md`` there.
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any
from unittest import mock

import numpy as np

STEPS = (1, 2, 3)
IDENTITY = {
    "dataset": "digits", "model": "wrn-10-1", "seed": 0, "batch_size": 128,
    "plan": {"precision": "fp32", "shard": "none", "devices": 0},
}  # fmt: skip


def state_at(step: int) -> dict[str, Any]:
    """The tree saved at ``step``: float32 weights, an int32 counter, a uint8 array."""
    rng = np.random.default_rng(step)
    return {
        "params": {"w": rng.normal(size=(64, 32)).astype(np.float32)},
        "opt_state": {"mu": rng.normal(size=(64, 32)).astype(np.float32)},
        "step": np.array(step, np.int32),
        "codes": rng.integers(0, 256, size=512).astype(np.uint8),
    }


def _snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def _save_run(directory: str) -> None:
    """A run's identity and its checkpoints of :data:`STEPS` in ``directory``, as the loop
    saves them."""
    from lowmem_jax.training.checkpointing import Checkpointer
    from lowmem_jax.training.run_identity import check_run

    check_run(directory, IDENTITY, resume=False)
    ckpt = Checkpointer(directory, every=1, keep=5)
    for step in STEPS:
        ckpt.save(step, state_at(step))
    ckpt.close()


_SAVED = [""]  # the directory that run_all saves once, copied for each case


def _saved_run(directory: str) -> dict[str, bytes]:
    """``directory`` holding the saved run (:func:`_save_run`); returns its files. Within
    :func:`run_all`, a copy of the run it saved once: Orbax's files name no directory that a
    restore reads (only commit_success.txt, a note that nothing reads, says where it was
    written), so a copy restores as the saved directory does."""
    if _SAVED[0]:
        shutil.copytree(_SAVED[0], directory)
    else:
        _save_run(directory)
    return _snapshot(directory)


def _resume(directory: str) -> tuple[str, bool | None]:
    """Resume as the loop does: (what the user sees, restored values equal the saved ones)."""
    from lowmem_jax.training.checkpointing import Checkpointer, CheckpointError
    from lowmem_jax.training.run_identity import check_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = None
        try:
            check_run(directory, IDENTITY, resume=True)
            ckpt = Checkpointer(directory, every=1, keep=5)
            state = ckpt.restore_newest(state_at(0))
        except (CheckpointError, ValueError, OSError) as err:
            return f"error: {_short(err)}", None
        finally:
            if ckpt is not None:
                ckpt.close()
    step = int(state["step"])
    saved = state_at(step)
    same = all(
        np.array_equal(np.asarray(a), b)
        for a, b in zip(_leaves(state), _leaves(saved), strict=True)
    )
    said = [str(w.message) for w in caught if "does not restore" in str(w.message)]
    warned = f"; warning: {_short(said[0])}" if said else ""
    return f"resumed from step {step}{warned}", same


def _leaves(tree: dict[str, Any]) -> list[Any]:
    return [tree["params"]["w"], tree["opt_state"]["mu"], tree["step"], tree["codes"]]


_ROOT = [""]  # the scratch directory of run_all, written <tmp> in messages


def _short(err) -> str:
    text = " ".join(str(err).split())
    if _ROOT[0]:
        text = text.replace(_ROOT[0], "<tmp>")
    return text if len(text) <= 300 else text[:297] + "..."


def _intact(directory: str, before: dict[str, bytes], damaged: int | None) -> bool:
    """Every file of the undamaged checkpoints as saved; the damaged step's files kept
    (in place or under ``<step>.corrupt``)."""
    after = _snapshot(directory)
    for path, data in before.items():
        top = path.split(os.sep)[0]
        if damaged is not None and top == str(damaged):
            moved = os.path.join(f"{damaged}.corrupt", *path.split(os.sep)[1:])
            if path not in after and moved not in after:
                return False
            continue
        if top == "run.json":
            continue
        if after.get(path) != data:
            return False
    return True


def case_killed_mid_write(work: str) -> dict[str, Any]:
    before = _saved_run(work)
    # Orbax writes step 4 under a temporary name and renames it when complete.
    partial = os.path.join(work, "4.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(os.path.join(work, "3"), partial)
    for root, _, files in os.walk(partial):
        for name in files[: len(files) // 2]:
            os.truncate(os.path.join(root, name), 0)
    sees, same = _resume(work)
    return {"sees": sees, "restored_as_saved": same, "intact": _intact(work, before, None)}


def _step_files(directory: str, step: int = 3) -> list[tuple[str, str]]:
    """``(label, path)`` of each file of ``step``'s checkpoint, in a stable order: data files
    are named by hashes that differ between saves, so they are labelled by their directory and
    rank by size."""
    paths = sorted(
        (p for p in _snapshot(directory) if p.split(os.sep)[0] == str(step)),
        key=lambda p: (os.path.dirname(p), os.path.getsize(os.path.join(directory, p)), p),
    )
    out, rank = [], {}
    for rel in paths:
        head, name = os.path.split(rel)
        if len(name) == 32 and all(c in "0123456789abcdef" for c in name):
            rank[head] = rank.get(head, 0) + 1
            name = f"<data file {rank[head]}, by size>"
        out.append((os.path.join(head, name), rel))
    return out


def _each_file(work_root: str, damage) -> list[dict[str, Any]]:
    probe = os.path.join(work_root, "probe")
    _saved_run(probe)
    rows = []
    for i, (label, _) in enumerate(_step_files(probe)):
        work = os.path.join(work_root, str(i))
        before = _saved_run(work)
        path = dict(_step_files(work)).get(label)
        if path is None:  # OCDBT splits data into a varying number of files between saves
            continue
        damage(os.path.join(work, path))
        sees, same = _resume(work)
        rows.append({"file": label, "sees": sees, "restored_as_saved": same,
                     "intact": _intact(work, before, 3)})  # fmt: skip
    return rows


def truncate_half(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if data:
            data[len(data) // 2] ^= 0xFF
            f.seek(0)
            f.write(data)


def case_full_disk(work: str) -> dict[str, Any]:
    """The save of step 4 fails with ENOSPC after writing part of its files."""
    from lowmem_jax.training.checkpointing import Checkpointer

    before = _saved_run(work)
    ckpt = Checkpointer(work, every=1, keep=5)
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode and "4" in os.path.relpath(str(path), work).split(os.sep)[0]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    try:
        with mock.patch("builtins.open", full):
            ckpt.save(4, state_at(4))
        saved = "saved"
    except Exception as err:  # noqa: BLE001 - whatever the writer raises is what the user sees
        saved = f"the save failed: {_short(err)}"
    finally:
        ckpt.close()
    sees, same = _resume(work)
    return {"sees": f"{saved}; then {sees}", "restored_as_saved": same,
            "intact": _intact(work, before, None)}  # fmt: skip


def case_second_run(work: str) -> dict[str, Any]:
    from lowmem_jax.training.run_identity import RunMismatchError, check_run

    before = _saved_run(work)
    try:
        check_run(work, {**IDENTITY, "seed": 1}, resume=False)
        sees = "started"
    except RunMismatchError as err:
        sees = f"error: {_short(err)}"
    return {"sees": sees, "restored_as_saved": None, "intact": _intact(work, before, None)}


def case_identity_changed(work: str, field: str, value: Any) -> dict[str, Any]:
    from lowmem_jax.training.run_identity import RunMismatchError, check_run

    before = _saved_run(work)
    identity = json.loads(json.dumps(IDENTITY))
    if field.startswith("plan."):
        identity["plan"][field[5:]] = value
    else:
        identity[field] = value
    try:
        check_run(work, identity, resume=True)
        sees = "resumed"
    except RunMismatchError as err:
        sees = f"error: {_short(err)}"
    return {"sees": sees, "restored_as_saved": None, "intact": _intact(work, before, None)}


def run_all(root: str) -> list[dict[str, Any]]:
    _ROOT[0] = root
    _save_run(os.path.join(root, "saved"))
    _SAVED[0] = os.path.join(root, "saved")
    # lowmem_jax.training.checkpointing runs a full gc.collect() after each restore attempt, which
    # walks every object of the process: ~0.25 s each in a fresh process, more in one that has run
    # other tests. The objects from before the cases are frozen (left out of collections)
    # meanwhile: they are not the abandoned reads of a restore that the collection is for.
    gc.freeze()
    try:
        return _cases(root)
    finally:
        gc.unfreeze()
        _SAVED[0] = ""


def _cases(root: str) -> list[dict[str, Any]]:
    rows = [{"case": "killed mid-write (a step's temporary directory left)",
             **case_killed_mid_write(os.path.join(root, "killed"))}]  # fmt: skip
    for row in _each_file(os.path.join(root, "truncated"), truncate_half):
        rows.append({"case": f"truncated: {row.pop('file')}", **row})
    for row in _each_file(os.path.join(root, "flipped"), flip_a_byte):
        rows.append({"case": f"one byte flipped: {row.pop('file')}", **row})
    rows.append({"case": "full disk during a save", **case_full_disk(os.path.join(root, "full"))})
    rows.append({"case": "a second run pointed at the directory",
                 **case_second_run(os.path.join(root, "second"))})  # fmt: skip
    changes = [("model", "wrn-16-2"), ("dataset", "cifar10"), ("seed", 1), ("batch_size", 64),
               ("plan.precision", "fp16"), ("plan.devices", 4)]  # fmt: skip
    for field, value in changes:
        work = os.path.join(root, f"identity_{field}")
        rows.append({"case": f"resume with {field} changed to {value!r}",
                     **case_identity_changed(work, field, value)})  # fmt: skip
    return rows


def to_markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Fault injection on a checkpoint directory",
        "",
        f"Made by `{command}`. Steps 1-3 saved, one fault injected, then a resume (or a new run).",
        "`restored as saved`: the values restored equal those saved at that step (`-`: nothing "
        "restored). `intact`: every undamaged checkpoint still there and byte-identical, a "
        "damaged one kept (in place or as `<step>.corrupt`).",
        "",
        "| case | what the user sees | restored as saved | intact |",
        "|---|---|---|---|",
    ]
    for r in rows:
        same = {None: "-", True: "yes", False: "NO"}[r["restored_as_saved"]]
        sees = r["sees"].replace("|", "\\|")
        lines.append(f"| {r['case']} | {sees} | {same} | {'yes' if r['intact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        rows = run_all(root)
    command = "python benchmarks/fault_injection.py --out-dir " + args.out_dir
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fault_injection.json"), "w") as f:
        json.dump({"command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out_dir, "fault_injection.md"), "w") as f:
        f.write(to_markdown(rows, command))
    bad = [r["case"] for r in rows if not r["intact"] or r["restored_as_saved"] is False]
    print(f"{len(rows)} cases, {len(bad)} with a good checkpoint lost or wrong values restored")
    for case in bad:
        print("  " + case)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
