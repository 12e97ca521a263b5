"""The one training loop (:func:`lowmem_jax.training.loop.train_and_evaluate`) trains both tasks the
same
way: records every ``eval_every`` steps and at the last step, with the same common keys."""

import optax
import pytest
from conftest import TINY_TRANSLATION

import lowmem_jax as lm
from lowmem_jax.training.loop import DEFAULT_PLAN, TrainConfig, train_and_evaluate
from lowmem_jax.training.tasks import classification

RECORD_KEYS = {
    "step", "epoch", "train_loss", "train_accuracy", "skipped_steps", "loss_scale",
    "learning_rate", "seconds",
}  # fmt: skip
SUMMARY_KEYS = {
    "model", "dataset", "plan", "recipe", "seed", "param_count", "param_checksum", "steps",
    "skipped_steps", "train_seconds", "backend", "history", "seconds",
}  # fmt: skip
TASKS = {
    "classification": {
        "config": {
            "dataset": "digits", "model": "wrn-10-1", "image_size": 8, "batch_size": 32,
        },
        "tests": {"test_accuracy"},
        "summary": {"batch_size", "epochs", "test_accuracy", "test_examples"},
    },
    "translation": {
        "config": {
            "dataset": "synthetic-copy", "model": "dynamicconv-small",
            "model_overrides": TINY_TRANSLATION, "max_tokens": 512, "length_multiple": 16,
            "eval_sentences": 0, "dropout": 0.0,
        },
        "tests": {"test_loss", "test_nll_loss", "test_accuracy"},
        "summary": {
            "max_tokens", "token_accuracy", "test_loss", "test_nll_loss", "test_accuracy",
            "beam_size",
        },
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "task",
    [pytest.param("classification", marks=pytest.mark.slow), "translation"],  # ~25 s / ~15 s
)
def test_one_loop_records_every_eval_every_steps_and_the_last(task, monkeypatch):
    spec = TASKS[task]
    # A jitted initialisation (20 s faster here than the op-by-op one the classification task
    # keeps for bitwise reproducibility of its committed results; records are unaffected).
    monkeypatch.setattr(classification.Task, "jit_init", True)
    config = TrainConfig(
        **spec["config"], plan=lm.Plan(), steps=5, eval_every=2, lr_schedule="cosine",
        progress=False,
    )  # fmt: skip
    lines = []
    summary = train_and_evaluate(config, log=lines.append)
    history = summary["history"]
    assert [r["step"] for r in history] == [2, 4, 5]
    assert len(lines) == len(history) and lines[0].startswith("step      2  epoch   1")
    lr = optax.cosine_decay_schedule(
        config.recipe(lm.workload(config.model).recipe).learning_rate, 5
    )
    for record in history:
        assert set(record) == RECORD_KEYS | spec["tests"], set(record) ^ RECORD_KEYS
        assert record["epoch"] == 1  # 1-based, for both tasks
        assert record["skipped_steps"] == 0 and record["loss_scale"] == 1.0  # fp32: no scaling
        assert record["learning_rate"] == pytest.approx(float(lr(record["step"] - 1)))
        assert 0.0 <= record["test_accuracy"] <= 1.0 and record["train_loss"] > 0
    assert set(summary) == SUMMARY_KEYS | spec["summary"]  # dense: no "sparsity"
    assert summary["steps"] == 5 and summary["skipped_steps"] == 0
    assert summary["model"] == config.model and summary["plan"] == lm.Plan().to_dict()
    assert summary["recipe"]["schedule"] == "cosine"
    assert summary["test_accuracy"] == history[-1]["test_accuracy"]


def test_config_defaults_per_task():
    digits = TrainConfig()
    assert (
        digits.plan == DEFAULT_PLAN == lm.Plan(precision="mixed_fp16", microbatches=4, remat="full")
    )
    assert digits.model_name == "wrn-16-2" and digits.keep == 3
    assert TrainConfig(dataset="synthetic-reverse").model_name == "dynamicconv-small"
    # The model's recipe, with the config's overrides.
    recipe = TrainConfig(learning_rate=0.05, momentum=0.5).recipe(lm.workload("wrn-16-2").recipe)
    assert (recipe.learning_rate, recipe.momentum, recipe.schedule) == (0.05, 0.5, "cosine")
    with pytest.raises(ValueError, match="not divisible by microbatches=4"):
        TrainConfig(batch_size=30)
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match="image_size=8 applies to dataset='digits' only"):
        TrainConfig(dataset="cifar10", image_size=8)
    with pytest.raises(ValueError, match="memory_devices plans over several devices: it needs"):
        TrainConfig(memory_devices=2)
    with pytest.raises(ValueError, match="memory_devices must be an int >= 1, got 0"):
        TrainConfig(memory_devices=0, memory_budget=2**20)
    # At its default it is not part of the run's identity: runs recorded before it resume
    assert "memory_devices" not in digits.identity()
