import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, BNNet, assert_trees_close, classification_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm


def _setup(model, batch_size, seed=0):
    batch = classification_batch(batch_size, seed=seed)
    variables = model.init(jax.random.key(seed), batch["image"], train=False)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    no_scale = lm.techniques.loss_scale.NoOpLossScale()
    grad_fn = lm.scaled_grad_fn(lm.classifier_loss_fn(model), no_scale)
    return grad_fn, params, model_state, batch


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_mean_of_microbatch_grads_equals_full_batch(k):
    grad_fn, params, state, batch = _setup(MLP(), 32)
    full, _, full_metrics = jax.jit(grad_fn)(params, state, batch, None)
    acc, _, acc_metrics = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    assert_trees_close(acc, full)
    np.testing.assert_allclose(acc_metrics["loss"], full_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(acc_metrics["accuracy"], full_metrics["accuracy"], rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(
    microbatch_size=st.integers(1, 6),
    k=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_accumulation_equals_full_batch_property(microbatch_size, k, seed):
    grad_fn, params, state, batch = _setup(MLP(), microbatch_size * k, seed)
    # Jitted: two programs per example instead of one per operation and shape.
    full, _, _ = jax.jit(grad_fn)(params, state, batch, None)
    acc, _, _ = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    assert_trees_close(acc, full, rtol=1e-4, atol=1e-6)


def test_batchnorm_semantics_per_microbatch_stats_and_ordered_running_averages():
    k = 4
    grad_fn, params, state, batch = _setup(BNNet(momentum=0.8), 16)
    acc, acc_state, _ = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    grad_fn = jax.jit(grad_fn)  # the references: one program per batch shape

    # Reference: k ordinary steps over consecutive slices, threading the running averages.
    ref_grads, ref_state = [], state
    for i in range(k):
        micro = jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch)
        g, ref_state, _ = grad_fn(params, ref_state, micro, None)
        ref_grads.append(g)
    ref_mean = jax.tree.map(lambda *gs: sum(gs) / k, *ref_grads)
    assert_trees_close(acc, ref_mean)
    assert_trees_close(acc_state, ref_state)

    # ...which is not what one full-batch BatchNorm pass gives.
    full, full_state, _ = grad_fn(params, state, batch, None)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), acc_state, full_state)
    assert max(jax.tree.leaves(diff)) > 1e-4


def test_rng_differs_per_microbatch():
    seen = []

    def grad_fn(params, state, batch, rng):
        return params, state, {"r": jax.random.uniform(rng)}

    _, _, metrics = lm.accumulate_gradients(grad_fn, 2)(
        {"w": jnp.ones(())}, {}, {"x": jnp.ones((4, 1))}, jax.random.key(0)
    )
    seen.append(float(metrics["r"]))
    r0 = float(jax.random.uniform(jax.random.fold_in(jax.random.key(0), 0)))
    r1 = float(jax.random.uniform(jax.random.fold_in(jax.random.key(0), 1)))
    np.testing.assert_allclose(seen[0], (r0 + r1) / 2, rtol=1e-6)


def test_indivisible_batch_raises_before_tracing_the_model():
    grad_fn, params, state, batch = _setup(MLP(), 10)
    with pytest.raises(ValueError, match=r"batch size 10 .*num_microbatches=4"):
        lm.accumulate_gradients(grad_fn, 4)(params, state, batch, None)


@pytest.mark.parametrize("k", [0, -2, 2.0, True])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match="num_microbatches"):
        lm.accumulate_gradients(lambda *a: a, k)


def test_cpu_step_holds_no_parameter_copy_across_the_microbatch_loop():
    """XLA:CPU computes half-precision dots in float32; with its loop-invariant code motion the
    float32 copy of a weight is hoisted out of the accumulation loop and held across it. The
    plan's options (joined with remat's) leave it inside: less temp, the same update."""
    width = 512

    def loss_fn(params, model_state, batch, rng):
        out = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2), (model_state, {})

    params = {"w1": jnp.ones((width, width)) / width, "w2": jnp.ones((width, width)) / width}
    batch = {"x": jax.random.normal(jax.random.key(0), (32, width)), "y": jnp.zeros((32, width))}
    plan = lm.Plan(precision="mixed_fp16", microbatches=4)
    tx = optax.sgd(0.1)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    step = lm.make_train_step(loss_fn, tx, plan, jit=False)
    assert plan.compiler_options() == lm.techniques.microbatches.compiler_options(4, "cpu")
    assert (
        "while-loop-invariant-code-motion"
        in lm.techniques.microbatches.compiler_options(4, "cpu")["xla_disable_hlo_passes"]
    )
    assert lm.techniques.microbatches.compiler_options(1, "cpu") == {}
    joined = lm.Plan(microbatches=2, remat="full").compiler_options()["xla_disable_hlo_passes"]
    assert sorted(joined.split(",")) == ["cse_barrier_expander", "while-loop-invariant-code-motion"]
    temp, updated = {}, {}
    for name, options in (("plan", plan.compiler_options()), ("hoisted", None)):
        jitted = jax.jit(step, compiler_options=options)
        compiled = jitted.lower(state, batch).compile()
        temp[name] = lm.analysis.memory.xla_memory(compiled)["temp_bytes"]
        updated[name] = jitted(state, batch)[0].params
    assert temp["plan"] <= temp["hoisted"] - width * width * 4  # at least one float32 weight
    said = {v.technique: v for v in lm.verdicts(step, state, batch, plan=plan, tx=tx)}
    assert said["microbatches"].took_effect
    assert "no loop-invariant code motion" in said["microbatches"].evidence
    assert_trees_close(updated["plan"], updated["hoisted"], rtol=1e-6, atol=0)
