import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tensorboard_matches_jsonl

import lowmem_jax as lm
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.training.checkpointing import (
    Checkpointer,
    CheckpointError,
    check_directory,
    checkpoint_steps,
    resume_or_start,
)
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate
from lowmem_jax.training.run_identity import RunMismatchError, check_run

# The digits at their original 8x8 pixels, 22 steps an epoch. The runs of this file train in
# this process or in a subprocess that inherits its XLA_FLAGS (conftest's fast compile) and
# cache directory, so both compile alike: the programs of a command line are compiled once and
# read back from the persistent cache by its other runs, here or in a subprocess.
COMMON = [
    sys.executable, "-m", "lowmem_jax.cli", "train", "--model", "wrn-10-1", "--batch-size", "64",
    "--image-size", "8", "--no-progress", "--json", "--checkpoint-every", "5",
    "--keep-checkpoints", "10",
]  # fmt: skip
# Mixed fp16 (a dynamic loss scale) with microbatches and remat, two epochs: 44 steps of the
# cosine schedule, which a resumed run must take up at the step it restores.
TRAIN = [*COMMON, "--precision", "mixed_fp16", "--microbatches", "2", "--remat", "full",
         "--epochs", "2"]  # fmt: skip
# The cheapest step to compile and run, and a constant learning rate, which leaves the run's
# length out of the compiled step: runs of any length share it.
SHORT = [*COMMON, "--precision", "fp32", "--microbatches", "1", "--remat", "none",
         "--lr-schedule", "constant", "--steps", "10"]  # fmt: skip


def _train_here(command, capsys):
    """``(summary, stderr)`` of ``lowmem train`` (a ``TRAIN`` or ``SHORT`` command line) run in this
    process, as the subprocess runs it."""
    capsys.readouterr()
    assert cli.main(command[3:]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``(summary, checkpoint_dir)`` of ``TRAIN`` run to its end, in this process: the
    reference of the resumed runs below (its checkpoint directory is not to be changed)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*TRAIN[3:], "--checkpoint-dir", str(directory)]) == 0
    return json.loads(out.getvalue()), directory


def test_checkpoint_roundtrip_keeps_structure_and_static_config(tmp_path):
    plan = lm.Plan(precision="mixed_fp16", min_loss_scale=4.0)
    state = lm.TrainState.create(params={"w": jnp.arange(3.0)}, tx=optax.adam(1e-3), plan=plan)
    ckpt = Checkpointer(str(tmp_path), every=2, keep=2)
    for step in range(1, 8):
        ckpt.save(step, state.replace(step=jnp.int32(step)))
    assert ckpt.latest_step() == 6 and ckpt.save(7, state, force=True)
    restored = ckpt.restore(jax.eval_shape(lambda: state))
    assert int(restored.step) == 0  # step 7 was the forced save of the original state
    assert restored.loss_scale.min_loss_scale == 4.0
    np.testing.assert_array_equal(restored.params["w"], state.params["w"])
    assert sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == [6, 7]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters(tmp_path, capsys, uninterrupted):
    """kill -9 mid-run, the newest checkpoint then found corrupt: the resumed run falls back to
    the one before and still ends bitwise equal to an uninterrupted run."""
    straight, _ = uninterrupted

    interrupted_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [*TRAIN, "--checkpoint-dir", str(interrupted_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        steps = (
            [int(p) for p in os.listdir(interrupted_dir) if p.isdigit()]
            if (interrupted_dir.exists())
            else []
        )
        if steps and max(steps) >= 15:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # a real kill: no cleanup, no final save
    proc.wait()
    *_, before, killed_at = checkpoint_steps(interrupted_dir)
    assert 15 <= killed_at < straight["steps"]
    _corrupt(interrupted_dir / str(killed_at), "truncated array file")

    # The same command with --resume, in this process (a new run of the loop, as a new process
    # has: state built afresh, then the checkpoint restored).
    resumed, stderr = _train_here([*TRAIN, "--checkpoint-dir", str(interrupted_dir), "--resume"],
                                  capsys)  # fmt: skip
    assert f"warning: checkpoint step {killed_at} in {interrupted_dir} does not restore" in stderr
    assert resumed["resumed_from_step"] == before
    assert resumed["steps"] == straight["steps"] == 2 * (1437 // 64)
    assert resumed["param_checksum"] == straight["param_checksum"]
    lines = (interrupted_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]  # none lost, none twice
    assert_tensorboard_matches_jsonl(interrupted_dir)


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(resume=True)


@pytest.mark.slow
def test_classifier_metrics_reach_tensorboard_and_survive_a_resume(tmp_path, uninterrupted):
    first, saved = uninterrupted  # TRAIN's run: checkpoints every 5 steps, 10 kept
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    assert first["steps"] == 44  # 22 steps per epoch; records at steps 22 and 44
    assert_tensorboard_matches_jsonl(tmp_path)
    for step in (35, 40, 44):  # as if killed after the save of step 30
        shutil.rmtree(tmp_path / str(step))
    # TRAIN's settings, resumed through the library.
    resume = TrainConfig(
        model="wrn-10-1", epochs=2, batch_size=64, image_size=8,
        plan=lm.Plan(precision="mixed_fp16", microbatches=2, remat="full"),
        checkpoint_dir=str(tmp_path), checkpoint_every=10, keep_checkpoints=10, progress=False,
        resume=True,
    )  # fmt: skip
    resumed = train_and_evaluate(resume, log=None)
    assert resumed["resumed_from_step"] == 30
    assert resumed["param_checksum"] == first["param_checksum"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 22), (2, 44)]
    assert records[1]["test_accuracy"] == first["test_accuracy"]
    assert_tensorboard_matches_jsonl(tmp_path)


def _corrupt(step_dir, how):
    """Damages one saved step as a full disk, a bad copy or a killed writer would."""
    arrays = sorted(step_dir.rglob("d/*"), key=lambda p: p.stat().st_size)
    if how == "truncated array file":
        with open(arrays[-1], "r+b") as f:
            f.truncate(arrays[-1].stat().st_size // 2)
    elif how == "garbage array file":
        arrays[-1].write_bytes(np.random.default_rng(0).bytes(arrays[-1].stat().st_size))
    else:
        for path in step_dir.rglob("_METADATA"):
            path.write_text("{not json")


def _saved(tmp_path, steps=(1, 2, 3)):
    states = {s: {"w": jnp.arange(1000.0) * s, "step": jnp.int32(s)} for s in steps}
    ckpt = Checkpointer(str(tmp_path), every=1, keep=5)
    for s, state in states.items():
        ckpt.save(s, state)
    ckpt.close()
    return states


@pytest.mark.parametrize(
    "how", ["truncated array file", "garbage array file", "corrupt metadata"]
)  # fmt: skip
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, how):
    states = _saved(tmp_path)
    _corrupt(tmp_path / "3", how)
    ckpt = Checkpointer(str(tmp_path), every=1, keep=5)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 3 .* does not restore \(\w+"):
        restored = ckpt.restore_newest(jax.eval_shape(lambda: states[3]))
    np.testing.assert_array_equal(restored["w"], states[2]["w"])
    # Moved aside, not deleted; step 3 can be written afresh by the resumed run.
    assert (tmp_path / "3.corrupt").is_dir() and ckpt.latest_step() == 2
    assert ckpt.save(3, states[3]) and ckpt.latest_step() == 3
    np.testing.assert_array_equal(ckpt.restore(states[3])["w"], states[3]["w"])
    ckpt.close()


def test_no_checkpoint_restoring_is_one_error_naming_the_directory(tmp_path):
    states = _saved(tmp_path, steps=(1, 2))
    for step in (1, 2):
        _corrupt(tmp_path / str(step), "truncated array file")
    ckpt = Checkpointer(str(tmp_path), every=1, keep=5)
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError) as err:
        ckpt.restore_newest(jax.eval_shape(lambda: states[2]))
    assert str(tmp_path) in str(err.value) and "step 2 (" in str(err.value)
    assert "step 1 (" in str(err.value) and "\n" not in str(err.value)
    ckpt.close()


def test_resume_refuses_a_directory_without_checkpoints(tmp_path):
    state = {"w": jnp.zeros(3)}
    for directory, why in ((tmp_path / "missing", "does not exist"), (tmp_path, "holds no")):
        with pytest.raises(FileNotFoundError, match=why):
            resume_or_start(state, str(directory), every=1, keep=1, resume=True)
    assert not (tmp_path / "missing").exists()  # not created by a refused resume


def test_checkpoint_directory_is_checked_before_anything_runs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_directory(str(a_file))
    with pytest.raises(PermissionError, match="cannot be created"):
        check_directory("/proc/lowmem-checkpoints")  # not creatable, even by root
    check_directory(str(tmp_path / "new"))
    assert (tmp_path / "new").is_dir()


def _listing(directory) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")}


def _refusal(command, capsys) -> str:
    """``lowmem train``'s one-line error (exit 2) for ``command`` (a ``SHORT``-style command
    line), run in this process."""
    with pytest.raises(SystemExit) as exc:
        cli.main(command[3:])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_checkpoint_directory_survives_a_wrong_resume_and_a_second_run(tmp_path, capsys):
    """Resuming with one wrong flag renamed every good checkpoint to <step>.corrupt, and a new
    run in the directory deleted the old run's checkpoints and overwrote its metrics: both are
    refused in one line (exit 2) before anything is built, and the directory is untouched (and
    so is --resume with fewer steps than the run has, which trained nothing and said nothing);
    the right --resume then continues the run."""
    # Every command runs in this process, as `lowmem train` runs it.
    first, _ = _train_here([*SHORT, "--checkpoint-dir", str(tmp_path)], capsys)
    before = _listing(tmp_path)
    assert {"5", "10", "run.json", "metrics.jsonl"} <= set(before)

    # The refusals come before anything is built.
    wrong = _refusal([*SHORT, "--model", "wrn-16-2", "--checkpoint-dir", str(tmp_path),
                      "--resume"], capsys)  # fmt: skip
    assert "model: 'wrn-10-1' in the run, 'wrn-16-2' in this command" in wrong
    again = _refusal([*SHORT, "--seed", "1", "--checkpoint-dir", str(tmp_path)], capsys)
    assert "already holds a run (checkpoints at steps 5, 10)" in again
    assert "--resume" in again and "--overwrite" in again
    fewer = _refusal([*SHORT, "--steps", "5", "--checkpoint-dir", str(tmp_path), "--resume"],
                     capsys)  # fmt: skip
    assert f"the run in checkpoint_dir={tmp_path} is at step 10, past the 5 steps" in fewer
    assert _listing(tmp_path) == before  # nothing renamed, deleted or overwritten

    resumed, _ = _train_here(
        [*SHORT, "--steps", "15", "--checkpoint-dir", str(tmp_path), "--resume"], capsys
    )
    assert resumed["steps"] == 15 and first["steps"] == 10
    # The summary's history is the whole run's, and says where it resumed.
    assert resumed["resumed_from_step"] == 10 and "resumed_from_step" not in first
    assert [r["step"] for r in resumed["history"]] == [r["step"] for r in first["history"]] + [15]


def test_overwrite_moves_the_old_run_aside_whole(tmp_path):
    """check_run, the library side: a new run with overwrite moves the old run to
    <dir>.previous (then .previous-1), records the new identity, and resumes of that identity
    pass while any other identity is refused naming each difference."""
    directory = tmp_path / "run"
    (directory / "5").mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("{}\n")
    mine = {"model": "wrn-10-1", "seed": 0, "plan": {"precision": "fp32"}}
    with pytest.raises(RunMismatchError, match="already holds a run"):
        check_run(directory, mine, resume=False)
    moved = check_run(directory, mine, resume=False, overwrite=True)
    assert moved == str(directory) + ".previous"
    assert (tmp_path / "run.previous" / "5").is_dir()
    assert (tmp_path / "run.previous" / "metrics.jsonl").read_text() == "{}\n"
    assert json.loads((directory / "run.json").read_text()) == mine
    (directory / "10").mkdir()
    assert check_run(directory, mine, resume=True) is None
    other = {**mine, "seed": 1, "plan": {"precision": "fp16"}}
    with pytest.raises(RunMismatchError, match="plan: .*'fp32'.* in the run, .*'fp16'.*; seed: 0"):
        check_run(directory, other, resume=True)
    assert check_run(directory, mine, resume=False, overwrite=True).endswith("run.previous-1")


def test_overwrite_and_resume_do_not_go_together():
    with pytest.raises(ValueError, match="overwrite=True starts a new run"):
        TrainConfig(checkpoint_dir="x", resume=True, overwrite=True)


def test_ctrl_c_says_where_the_last_checkpoint_is_and_exits_130(tmp_path):
    """Ctrl-C printed a 21-line traceback: now one line naming the newest checkpoint and how to
    continue, exit status 130 (the run's own record lines before it stay)."""
    # A shell without job control starts background jobs with SIGINT ignored, and Python then
    # raises no KeyboardInterrupt: the child takes Python's handler back, as a terminal has it.
    restore = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['lowmem', *sys.argv[1:]]; runpy.run_module('lowmem_jax.cli', "
        "run_name='__main__')"
    )
    proc = subprocess.Popen(  # 1000 steps: far more than it runs before the Ctrl-C
        [sys.executable, "-c", restore, *SHORT[3:], "--steps", "1000",
         "--checkpoint-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not checkpoint_steps(tmp_path):
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    newest = checkpoint_steps(tmp_path)[-1]
    assert last == (
        f"lowmem train: interrupted; the newest checkpoint is step {newest} in {tmp_path}: run "
        "the same command with --resume to continue"
    )
