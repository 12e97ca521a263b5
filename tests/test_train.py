import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BNNet, classification_batch, to_numpy

import lowmem_jax as lm


def _weighted(loss_fn, weight):
    def weighted(*args):
        loss, aux = loss_fn(*args)
        return loss * weight, aux

    return weighted


def _state_and_step(plan, tx, batch_size=8, loss_weight=1.0, seed=0):
    model = plan.configure_model(BNNet())
    batch = classification_batch(batch_size, seed=seed)
    variables = model.init(jax.random.key(seed), batch["image"], train=False)
    state = lm.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        tx=tx,
        plan=plan,
    )
    loss_fn = _weighted(lm.classifier_loss_fn(model), loss_weight)
    step = lm.make_train_step(loss_fn, tx, plan, donate=False)
    return state, step, batch


def test_fp32_step_matches_a_handwritten_step():
    plan = lm.Plan()
    tx = optax.sgd(0.1, momentum=0.9)
    state, step, batch = _state_and_step(plan, tx)
    model = BNNet()

    def loss(p):
        logits, upd = model.apply(
            {"params": p, **state.model_state}, batch["image"], train=True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), upd

    grads, upd = jax.grad(loss, has_aux=True)(state.params)
    updates, _ = tx.update(grads, state.opt_state, state.params)
    expected = optax.apply_updates(state.params, updates)
    new_state, metrics = step(state, batch)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        new_state.params,
        expected,
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
        new_state.model_state["batch_stats"],
        upd["batch_stats"],
    )
    assert int(new_state.step) == 1 and bool(metrics["grads_finite"])


def test_fp16_overflow_skips_whole_update_halves_scale_then_recovers():
    # A loss weight of 1e3 makes loss x 2**15 overflow float16 (max 65504) in the backward pass.
    plan = lm.Plan(precision="mixed_fp16", loss_scale="dynamic")
    tx = optax.adam(1e-3)
    state, step, batch = _state_and_step(plan, tx, loss_weight=1e3)
    before = to_numpy(state)
    new, metrics = step(state, batch)
    assert not bool(metrics["grads_finite"])
    assert int(new.skipped_steps) == 1 and int(metrics["skipped_steps"]) == 1
    assert float(new.loss_scale.loss_scale) == 2.0**14
    for name in ("params", "opt_state", "model_state"):
        jax.tree.map(
            np.testing.assert_array_equal, to_numpy(getattr(new, name)), getattr(before, name)
        )
    assert int(optax.tree_utils.tree_get(new.opt_state, "count")) == 0  # adam's own counter

    state = new
    for _ in range(30):
        state, metrics = step(state, batch)
        if bool(metrics["grads_finite"]):
            break
    assert bool(metrics["grads_finite"]), "loss scale never backed off far enough"
    assert int(optax.tree_utils.tree_get(state.opt_state, "count")) == 1
    assert float(state.loss_scale.loss_scale) < 2.0**14
    assert int(state.skipped_steps) == int(state.step) - 1
    changed = jax.tree.map(
        lambda a, b: bool((np.asarray(a) != b).any()), state.params, before.params
    )
    assert all(jax.tree.leaves(changed))


def test_loss_scale_floor_survives_the_jitted_step():
    plan = lm.Plan(
        precision="fp16", loss_scale="dynamic", initial_loss_scale=8.0, min_loss_scale=4.0
    )
    state, step, batch = _state_and_step(plan, optax.sgd(0.1))
    batch = {**batch, "image": batch["image"].at[0, 0].set(jnp.inf)}  # every step overflows
    for _ in range(3):
        state, _ = step(state, batch)
    assert state.loss_scale.min_loss_scale == 4.0
    assert float(state.loss_scale.loss_scale) == 4.0 and int(state.skipped_steps) == 3


def test_the_step_counts_skipped_steps_in_a_row_and_resets_on_an_applied_one():
    """``skip_streak`` (state and metrics): what a hand-written loop stops a stuck run on."""
    state, step, batch = _state_and_step(lm.Plan(), optax.sgd(0.1))
    poisoned = {**batch, "image": batch["image"].at[0, 0].set(jnp.nan)}
    streaks = []
    for b in (poisoned, poisoned, poisoned, batch, poisoned):
        state, metrics = step(state, b)
        streaks.append(int(metrics["skip_streak"]))
    assert streaks == [1, 2, 3, 0, 1] and int(state.skip_streak) == 1
    assert int(state.skipped_steps) == 4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_param_policies_store_half_params(precision):
    plan = lm.Plan(precision=precision)
    state, step, batch = _state_and_step(plan, optax.sgd(0.01))
    dtype = plan.policy.param_dtype
    assert all(x.dtype == dtype for x in jax.tree.leaves(state.params))
    new, metrics = step(state, batch)
    assert all(x.dtype == dtype for x in jax.tree.leaves(new.params))
    assert metrics["loss"].dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.model_state))


def test_microbatched_step_trains_and_threads_batchnorm():
    plan = lm.Plan(microbatches=4)
    state, step, batch = _state_and_step(plan, optax.sgd(0.1), batch_size=16)
    new, metrics = step(state, batch)
    assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))
    diff = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()), new.model_state, state.model_state
    )
    assert max(jax.tree.leaves(diff)) > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp64"}, "precision"),
        ({"loss_scale": "huge"}, "loss_scale"),
        ({"microbatches": 0}, "num_microbatches"),
        ({"remat": "some"}, "remat"),
        ({"remat": "every:0"}, "remat"),
        ({"loss_scale": "dynamic", "min_loss_scale": 0}, "min_loss_scale"),
    ],
)
def test_plan_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lm.Plan(**kwargs)


def test_segmenting_remat_needs_a_model_with_block_stacks():
    with pytest.raises(ValueError, match="every:2"):
        lm.Plan(remat="every:2").configure_model(BNNet())


def test_auto_loss_scale_is_dynamic_only_for_fp16_compute():
    assert lm.Plan(precision="mixed_fp16").loss_scale_kind == "dynamic"
    assert lm.Plan(precision="fp16").loss_scale_kind == "dynamic"
    assert lm.Plan(precision="mixed_bf16").loss_scale_kind == "none"
    assert lm.Plan().loss_scale_kind == "none"


def test_plain_optax_transformations_store_parameters_as_they_are():
    tx = optax.sgd(0.1, momentum=0.9)
    opt = lm.core.base.as_optimizer(tx)
    assert isinstance(opt, lm.Optimizer) and lm.core.base.as_optimizer(opt) is opt
    assert lm.Plan().wrap_optimizer(tx).tx is tx and not opt.grads_wrt_stored
    params = {"w": jnp.arange(3.0)}
    state = lm.TrainState.create(params=params, tx=tx, plan=lm.Plan(), rng=jax.random.key(1))
    assert lm.model_params(state, tx) is state.params
    jax.tree.map(np.testing.assert_array_equal, state.opt_state, tx.init(params))
    # A typed key is stored as raw key data, so the state converts and checkpoints plainly.
    np.testing.assert_array_equal(state.rng, jax.random.key_data(jax.random.key(1)))


def _wide_loss(params, model_state, batch, rng):
    loss = ((batch["x"] @ params["w"]) ** 2).mean()
    return loss, (model_state, {"loss": loss})


@pytest.mark.parametrize(
    "plan,why",
    [
        (lm.Plan(precision="fp16"), "optimizer_state; precision='fp16' stores 16-bit"),
        (lm.Plan(optimizer_state="int8"), "optimizer_state"),
        (lm.Plan(sparsity=lm.sparsity.SparseConfig(density=0.5, is_sparse=lambda p, x: True)),
         "sparsity"),
    ],
)  # fmt: skip
def test_a_raw_optax_transformation_is_refused_where_the_plan_acts_on_the_optimizer(plan, why):
    """Pure fp16 with a raw optax.adam skipped every step (fp16 moments overflow), a sparse or
    int8 plan with one trained dense / float32: each is now refused in one line, at the state's
    creation and at the step's first call, naming what would be skipped and the fix."""
    params = {"w": jnp.full((64, 128), 0.01)}
    batch = {"x": jnp.ones((8, 64))}
    tx = optax.adam(1e-3)
    with pytest.raises(ValueError, match=f"\\({why}.*pass tx=plan.wrap_optimizer"):
        lm.TrainState.create(params=params, tx=tx, plan=plan)
    wrapped = plan.wrap_optimizer(tx, params)
    state = lm.TrainState.create(params=params, tx=wrapped, plan=plan)
    with pytest.raises(ValueError, match="pass tx=plan.wrap_optimizer"):
        lm.make_train_step(_wide_loss, tx, plan)(state, batch)
    new, metrics = lm.make_train_step(_wide_loss, wrapped, plan)(state, batch)
    assert int(metrics["skipped_steps"]) == 0 and int(new.step) == 1


def test_a_raw_optax_transformation_passes_where_the_plan_stores_nothing_else():
    """SGD without momentum has no state: under fp16 its raw and wrapped forms store the same
    arrays, so the raw one is accepted (and so is any plan without optimizer-side work)."""
    params = {"w": jnp.full((64, 128), 0.01)}
    cases = [(lm.Plan(precision="fp16"), optax.sgd(0.1)),
             (lm.Plan(precision="mixed_fp16", microbatches=2), optax.adam(1e-3))]  # fmt: skip
    for plan, tx in cases:
        state = lm.TrainState.create(params=params, tx=tx, plan=plan)
        _, metrics = lm.make_train_step(_wide_loss, tx, plan)(state, {"x": jnp.ones((8, 64))})
        assert bool(metrics["grads_finite"])


def test_labels_out_of_range_skip_the_step_and_count_it():
    """A label outside [0, classes) one-hot encodes to zeros (a loss of -0.0 that was
    applied): the loss is NaN instead, so the step is skipped and counted."""
    plan = lm.Plan()
    state, step, batch = _state_and_step(plan, optax.sgd(0.1, momentum=0.9))
    bad = {**batch, "label": batch["label"].at[0].set(10)}  # BNNet has 10 classes
    new, metrics = step(state, bad)
    assert not bool(metrics["grads_finite"]) and int(new.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, to_numpy(new.params), to_numpy(state.params))
    _, metrics = step(state, batch)
    assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))
