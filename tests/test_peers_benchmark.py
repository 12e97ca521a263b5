"""Smoke test of benchmarks/peers.py on a tiny conv + BatchNorm classifier (seconds)."""

from __future__ import annotations

import pytest
from conftest import TinyConvNet, load_benchmark


@pytest.fixture(scope="module")
def peers():
    return load_benchmark("peers")


@pytest.mark.slow
def test_microbatch_methods_agree_and_ours_saves_temp(peers):
    result = peers.microbatch_comparison(
        "wrn-10-1", batch_size=32, ks=(4,), repeats=1, image_size=8, model=TinyConvNet(), log=None
    )
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "ours_k4", "optax_microbatch_k4", "optax_multisteps_k4"}
    agreement = result["update_agreement"]["k4"]
    # The three accumulation methods make the same update (float32 rounding only) ...
    assert agreement["optax_microbatch_k4"] < 1e-5
    assert agreement["optax_multisteps_k4"] < 1e-5
    # ... which differs from the full-batch step's (BatchNorm over 32 examples, not 4 x 8).
    assert agreement["plain_full_batch"] > 1e-3
    assert all(r["params_finite"] for r in rows.values())
    # XLA:CPU compile-only: our k=4 step needs less temp than the plain full-batch step.
    assert rows["ours_k4"]["xla"]["temp_bytes"] < rows["plain"]["xla"]["temp_bytes"]
    # MultiSteps keeps a params-sized accumulator in its (argument) optimizer state.
    multi, plain = rows["optax_multisteps_k4"], rows["plain"]
    assert multi["accumulator_bytes"] == result["param_bytes"]
    assert multi["calls_per_update"] == 4
    assert multi["step_seconds"] > 0 and plain["time_ratio"] == 1.0


def test_injected_overflow_ruins_unscaled_run_and_is_skipped_by_ours(peers):
    result = peers.loss_scale_comparison(
        ("ours_dynamic", "plain_fp16"),
        (0,),
        scenarios=("overflow",),
        batch_size=32,
        steps=6,
        fault_step=2,
        fault_scale=1e6,
        model=TinyConvNet(),
        measure_underflow=False,
        log=None,
    )
    runs = {r["variant"]: r for r in result["runs"]}
    plain, ours = runs["plain_fp16"], runs["ours_dynamic"]
    assert plain["fault"]["grads_finite"] is False and ours["fault"]["grads_finite"] is False
    # Without loss scaling or a finiteness guard, the NaN update is applied.
    assert plain["params_finite"] is False
    # Ours skips that step (and any overflow of the initial 2^15 scale) and stays finite.
    assert ours["params_finite"] is True and ours["batch_stats_finite"] is True
    assert ours["skipped_steps"] >= 1
    assert ours["steps"] == plain["steps"] == 6
