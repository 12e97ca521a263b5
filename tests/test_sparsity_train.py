"""Sparse training inside `lm.make_train_step`: an optimizer's own parameter storage
(materialize), masked vs compressed storage through the step, a skipped fp16 step, and the
WRN-28-2 storage bytes at 90%."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import FAST_COMPILE, TinyMLP, classification_batch, fast_jit

import lowmem_jax as lm
from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.sparsity.layout import leaves_by_key


class DoubledSGD(lm.Optimizer):
    """SGD on parameters stored at half the values the model sees: a custom storage."""

    def __init__(self, learning_rate):
        self.tx = optax.sgd(learning_rate)

    def init(self, params):
        return self.tx.init(params)

    def update(self, grads, state, params=None):
        return self.tx.update(grads, state, params)

    def materialize(self, params, state):
        del state
        return jax.tree.map(lambda x: 2 * x, params)


def test_optimizer_materialize_is_what_the_step_differentiates():
    plan = lm.Plan()
    model, batch = TinyMLP(), classification_batch(features=6)
    params = model.init(jax.random.key(0), batch["image"])["params"]
    loss_fn = lm.classifier_loss_fn(model)
    tx = DoubledSGD(0.1)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    jax.tree.map(np.testing.assert_array_equal, state.params, params)  # stored as given
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, 2 * b), lm.model_params(state, tx), params
    )

    step = lm.make_train_step(loss_fn, tx, plan, donate=False)
    new, _ = step(state, batch)
    grads = jax.grad(lambda p: loss_fn(p, {}, batch, None)[0])(tx.materialize(params, None))
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), new.params, expected)


def _sparse_run(compressed, algorithm, steps=4):
    model, batch = TinyMLP(), classification_batch(features=6)
    params = model.init(jax.random.key(0), batch["image"])["params"]
    cfg = sparsity.SparseConfig(
        algorithm=algorithm,
        density=0.3,
        update_period=2,
        compressed=compressed,
        capacity_factor=1 / 0.3 if compressed else None,
        dsr_threshold=0.1,
        dsr_target_pruned=10,
    )
    plan = lm.Plan(microbatches=2, sparsity=cfg)
    sp = plan.wrap_optimizer(optax.sgd(0.1, momentum=0.9), params)
    assert isinstance(sp, sparsity.SparseTraining)
    state = lm.TrainState.create(params=params, tx=sp, plan=plan)
    step = fast_jit(lm.make_train_step(lm.classifier_loss_fn(model), sp, plan, jit=False), plan)
    losses, dense = [], []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        dense.append(jax.tree.map(np.asarray, lm.model_params(state, sp)))
    return sp, state, losses, dense


def test_masked_and_compressed_storage_train_identically_through_the_step():
    for algorithm in ("dsr",):  # RigL: see the property tests
        _, _, loss_a, dense_a = _sparse_run(False, algorithm)
        sp, state, loss_b, dense_b = _sparse_run(True, algorithm)
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
        for a, b in zip(dense_a, dense_b, strict=True):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), a, b)
        # Stored: values [capacity] for sparse kernels, dense classifier and biases.
        assert state.params["hidden"]["kernel"].ndim == 1
        assert state.params["classifier"]["kernel"].shape == (12, 3)
        report = sparsity.density_report(sp, state.opt_state)
        assert report["nnz"] == sp.layout.total_budget


def test_skipped_fp16_step_changes_no_mask_then_rigl_rewires_a_wrn():
    cfg = sparsity.SparseConfig(algorithm="rigl", density=0.2, update_period=1, drop_fraction=0.3)
    plan = lm.Plan(precision="mixed_fp16", microbatches=2, remat="full", sparsity=cfg)
    model = plan.configure_model(lm.models.WideResNet(depth=10, width=1, num_classes=10))
    rng = np.random.default_rng(0)
    batch = {
        "image": jnp.asarray(rng.normal(size=(4, 8, 8, 3)), jnp.float32),
        "label": jnp.arange(4) % 10,
    }
    # Jitted: eager init / mask selection would dispatch op by op (slow on CPU).
    variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(batch["image"][:2])
    sp = plan.wrap_optimizer(optax.sgd(0.1, momentum=0.9), variables["params"])
    assert "group0_rest" not in " ".join(sp.layout.keys)  # depth 10: one block per group
    state = jax.jit(
        lambda v: lm.TrainState.create(
            params=v["params"], tx=sp, plan=plan, model_state={"batch_stats": v["batch_stats"]}
        )
    )(variables)
    step = fast_jit(lm.make_train_step(lm.classifier_loss_fn(model), sp, plan, jit=False), plan)
    before = jax.tree.map(np.asarray, state)

    bad = {**batch, "image": batch["image"].at[0, 0, 0, 0].set(jnp.inf)}
    state, metrics = step(state, bad)
    assert not bool(metrics["grads_finite"]) and int(state.skipped_steps) == 1
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, state.opt_state), before.opt_state
    )  # masks, counter, slots
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before.params
    )

    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"]) and int(state.opt_state.count) == 1
    changed = [
        bool((np.asarray(state.opt_state.pattern[k]) != before.opt_state.pattern[k]).any())
        for k in sp.layout.keys
    ]
    assert any(changed)
    for s in sp.layout.leaves:
        mask = np.asarray(state.opt_state.pattern[s.key])  # masked storage: bool [*shape]
        assert mask.dtype == bool and mask.shape == s.shape
        assert int(mask.sum()) == s.budget
        leaf = leaves_by_key(state.params, [s.key])[s.key]
        assert not np.asarray(leaf)[~mask].any()
    # The classifier and BatchNorm stay dense.
    assert np.asarray(state.params["classifier"]["kernel"]).all()


def test_compressed_wrn_28_2_stores_at_most_a_quarter_of_dense_at_90_percent():
    plan = lm.Plan()
    model = lm.models.WideResNet(depth=28, width=2)
    images = jnp.zeros((2, 32, 32, 3))
    batch = {
        "image": jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32),
        "label": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    tx = optax.sgd(0.1, momentum=0.9)

    def dense_state():
        v = model.init(jax.random.key(0), images, train=False)
        return lm.TrainState.create(params=v["params"], tx=tx, plan=plan)

    dense = jax.eval_shape(dense_state)
    dense_bytes = lm.analysis.memory.tree_bytes((dense.params, dense.opt_state))
    params = dense.params
    loss_fn = lm.classifier_loss_fn(model)
    for algorithm in ("static", "rigl", "dsr"):
        cfg = sparsity.SparseConfig(algorithm=algorithm, density=0.1, compressed=True)
        sparse_plan = lm.Plan(sparsity=cfg)
        sp = sparse_plan.wrap_optimizer(tx, params)

        def sparse_state(sp=sp, sparse_plan=sparse_plan):
            v = model.init(jax.random.key(0), images, train=False)
            return lm.TrainState.create(
                params=v["params"],
                tx=sp,
                plan=sparse_plan,
                model_state={"batch_stats": v["batch_stats"]},
            )

        state = jax.eval_shape(sparse_state)
        analytic = lm.analysis.memory.analytic_breakdown(state=state, batch=batch, tx=sp)
        stored = analytic["model_bytes"] + sum(
            v for k, v in analytic["optimizer_breakdown"].items() if k.startswith("slot:")
        )
        assert stored <= 0.25 * dense_bytes, (algorithm, stored / dense_bytes)
        if algorithm == "static":  # same stored layout as SET / RigL; cheapest to compile
            step = lm.make_train_step(loss_fn, sp, sparse_plan)
            compiled = step.lower(state, batch).compile(FAST_COMPILE)
            args = compiled.memory_analysis().argument_size_in_bytes
            extra = lm.analysis.memory.tree_bytes(batch) + lm.analysis.memory.tree_bytes(
                (state.model_state, state.step, state.skipped_steps, state.rng, state.loss_scale)
            )
            assert args - extra <= 0.25 * dense_bytes, (args - extra) / dense_bytes
