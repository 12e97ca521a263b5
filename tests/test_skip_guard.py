import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.training.checkpointing import checkpoint_steps
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate
from lowmem_jax.training.skip_guard import NoProgressError, SkipGuard, skip_cause
from lowmem_jax.training.tasks.classification import Task
from lowmem_jax.workloads.recipes import Recipe

APPLIED = {"grads_finite": True, "update_finite": True, "loss_scale": 1.0}
SKIPPED = {"grads_finite": False, "update_finite": True, "loss_scale": 1.0}


@given(st.lists(st.booleans(), max_size=60), st.integers(1, 8))
def test_the_guard_stops_exactly_at_the_first_long_enough_streak(applied, limit):
    guard, streak = SkipGuard(limit), 0
    for step, ok in enumerate(applied, 1):
        streak = 0 if ok else streak + 1
        if streak == limit:
            with pytest.raises(NoProgressError) as err:
                guard.observe(step, APPLIED if ok else SKIPPED)
            assert (err.value.step, err.value.streak) == (step, limit)
            return
        guard.observe(step, APPLIED if ok else SKIPPED)
        assert guard.streak == streak


def test_the_guard_warns_once_per_streak_and_never_stops_at_zero():
    guard = SkipGuard(0, warn_after=3)
    warnings = [guard.observe(s, SKIPPED) for s in range(1, 200)]
    assert [i for i, w in enumerate(warnings, 1) if w] == [3]
    assert guard.observe(200, APPLIED) is None and guard.streak == 0
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        SkipGuard(-1)


def test_the_guard_reads_the_step_s_own_streak_when_it_sees_few_steps():
    """A loop that syncs every k-th step observes only those: the step's ``skip_streak`` is the
    streak, so the guard warns and stops on it without having seen the steps between."""
    guard = SkipGuard(10, warn_after=4)
    assert guard.observe(5, {**SKIPPED, "skip_streak": 5}) is not None  # crossed 4 unseen
    assert guard.observe(8, {**SKIPPED, "skip_streak": 8}) is None  # warned once per streak
    assert guard.observe(9, {**APPLIED, "skip_streak": 0}) is None and guard.streak == 0
    with pytest.raises(NoProgressError) as err:
        guard.observe(30, {**SKIPPED, "skip_streak": 12})
    assert err.value.streak == 12


def test_causes_name_the_guard_that_fired():
    assert "at loss scale 1 (its floor)" in skip_cause(SKIPPED, min_loss_scale=1.0)
    assert "still falling" in skip_cause({**SKIPPED, "loss_scale": 64.0}, min_loss_scale=1.0)
    assert "(its floor)" not in skip_cause(SKIPPED)  # no dynamic scale: no floor to name
    bad_update = {**APPLIED, "update_finite": False}
    assert skip_cause(bad_update).startswith("updates non-finite from finite gradients")


CONFIG = {
    "model": "wrn-10-1", "image_size": 8, "batch_size": 64, "steps": 30, "progress": False,
    # A loss scale of 2^4 reaches its floor 1 after 4 overflows (2^15 would take 15).
    "plan": lm.Plan(precision="mixed_fp16", microbatches=1, remat="none", initial_loss_scale=16),
}  # fmt: skip


def test_a_persistent_inf_input_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch
):
    clean_batches = Task.train_batches

    def inf_from_step_5(self, start, stop):
        for index, (epoch, batch) in enumerate(clean_batches(self, start, stop), start):
            if index >= 4:
                batch = {**batch, "image": np.full_like(batch["image"], np.inf)}
            yield epoch, batch

    monkeypatch.setattr(Task, "train_batches", inf_from_step_5)
    config = TrainConfig(
        **CONFIG, checkpoint_dir=str(tmp_path), checkpoint_every=2, max_consecutive_skips=8
    )
    with pytest.warns(RuntimeWarning, match="step 6: 2 consecutive skipped steps"):
        with pytest.raises(NoProgressError) as err:
            train_and_evaluate(config, log=None)
    assert (err.value.step, err.value.streak) == (12, 8)
    assert "gradients non-finite at loss scale 1 (its floor)" in str(err.value)
    assert f"the last checkpoint before it is step 4 in {tmp_path}" in str(err.value)
    # Saves due at steps 6..12 fell on skipped steps: none was taken, none at the stop.
    assert checkpoint_steps(tmp_path) == [2, 4]


def test_an_optimizer_that_returns_nan_stops_the_run_naming_the_updates(monkeypatch):
    monkeypatch.setattr(Recipe, "optimizer_for", lambda self, total: optax.sgd(float("nan")))
    config = TrainConfig(**CONFIG, max_consecutive_skips=3)
    with pytest.warns(RuntimeWarning, match="step 1: 1 consecutive skipped steps"):
        with pytest.raises(NoProgressError, match="updates non-finite from finite gradients"):
            train_and_evaluate(config, log=None)


def test_a_run_that_skips_most_steps_between_two_records_warns(monkeypatch):
    """Two steps in three skipped: no streak long enough to stop, but the records say so."""
    clean_batches = Task.train_batches

    def inf_two_in_three(self, start, stop):
        for index, (epoch, batch) in enumerate(clean_batches(self, start, stop), start):
            if index % 3:
                batch = {**batch, "image": np.full_like(batch["image"], np.inf)}
            yield epoch, batch

    monkeypatch.setattr(Task, "train_batches", inf_two_in_three)
    with pytest.warns(RuntimeWarning, match=r"step \d+: \d+ of the last \d+ steps were skipped"):
        result = train_and_evaluate(TrainConfig(**CONFIG), log=None)
    assert result["history"][-1]["skipped_steps"] == 20  # of 30
