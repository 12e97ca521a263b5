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
from lowmem_jax.checkpointing import Checkpointer
from lowmem_jax.loop import TrainConfig, train_and_evaluate

# The digits at their original 8x8 pixels: the same 44 steps as at 32x32, ~10x cheaper.
TRAIN = [
    sys.executable, "-m", "lowmem_jax.cli", "train", "--model", "wrn-10-1", "--epochs", "2",
    "--batch-size", "64", "--microbatches", "2", "--remat", "full", "--precision", "mixed_fp16",
    "--image-size", "8", "--no-progress", "--json", "--checkpoint-every", "5",
]  # fmt: skip


def _run(checkpoint_dir, *extra):
    out = subprocess.run(
        [*TRAIN, "--checkpoint-dir", str(checkpoint_dir), *extra],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout)


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
def test_killed_run_resumes_to_the_same_parameters(tmp_path):
    straight = _run(tmp_path / "straight")

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
    killed_at = max(int(p) for p in os.listdir(interrupted_dir) if p.isdigit())
    assert 15 <= killed_at < straight["steps"]

    resumed = _run(interrupted_dir, "--resume")
    assert resumed["steps"] == straight["steps"] == 2 * (1437 // 64)
    assert resumed["param_checksum"] == straight["param_checksum"]
    lines = (interrupted_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]  # none lost, none twice
    assert_tensorboard_matches_jsonl(interrupted_dir)


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(resume=True)


@pytest.mark.slow
def test_classifier_metrics_reach_tensorboard_and_survive_a_resume(tmp_path):
    common = {
        "model": "wrn-10-1", "epochs": 2, "batch_size": 64, "image_size": 8,
        "plan": lm.Plan(precision="fp32", microbatches=1, remat="none"),
        "checkpoint_dir": str(tmp_path), "checkpoint_every": 10, "keep_checkpoints": 10,
        "progress": False,
    }  # fmt: skip
    first = train_and_evaluate(TrainConfig(**common), log=None)
    assert first["steps"] == 44  # 22 steps per epoch; records at steps 22 and 44
    assert_tensorboard_matches_jsonl(tmp_path)
    for step in (40, 44):  # as if killed after the save of step 30
        shutil.rmtree(tmp_path / str(step))
    resumed = train_and_evaluate(TrainConfig(**common, resume=True), log=None)
    assert resumed["param_checksum"] == first["param_checksum"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 22), (2, 44)]
    assert records[1]["test_accuracy"] == first["test_accuracy"]
    assert_tensorboard_matches_jsonl(tmp_path)
