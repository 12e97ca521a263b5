"""Stored optimizer-state formats (lowmem_jax.techniques.optimizer_state) and the step's finiteness
guard."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    FAST_COMPILE,
    OPTIMIZERS,
    BNNet,
    classification_batch,
    fast_jit,
    tiny_params,
)

import lowmem_jax as lm
from lowmem_jax.analysis import memory
from lowmem_jax.codecs import quantization
from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.second_moment import factored_second_moment
from lowmem_jax.techniques.sparsity import slots
from lowmem_jax.techniques.sparsity.layout import leaves_by_key

BIG = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(128, 64)), jnp.float32)}
PARAMS = {**BIG, "b": jnp.zeros((100,), jnp.float32)}


def _grads(params, t):
    return jax.tree.map(lambda x: jnp.cos(x * (t + 1)) * 0.01, params)


def _run(tx, params, steps=3):
    state = tx.init(params)
    update = jax.jit(tx.update, compiler_options=FAST_COMPILE)
    outs = []
    for t in range(steps):
        updates, state = update(_grads(params, t), state, params)
        outs.append(updates)
    return outs, state


@pytest.mark.parametrize("name", [*OPTIMIZERS, "chain"])
def test_fp32_format_is_the_inner_optimizer(name):
    inner = (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
        if name == "chain"
        else OPTIMIZERS[name]()
    )
    ref, _ = _run(inner, PARAMS)
    got, state = _run(lm.quantized_state(inner, "fp32"), PARAMS)
    for a, b in zip(ref, got, strict=True):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9), a, b)
    assert isinstance(state, lm.techniques.optimizer_state.QuantizedState) and state.rng is None


def test_works_inside_chain_and_with_injected_hyperparameters():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    tx = optax.chain(optax.clip(1.0), lm.quantized_state(inner, "int8"))
    state = tx.init(PARAMS)
    updates, state = jax.jit(tx.update)(_grads(PARAMS, 0), state, PARAMS)
    hyper = state[1].inner_state.hyperparams
    assert float(hyper["learning_rate"]) == pytest.approx(1e-2)
    # Changing the injected learning rate scales the update (Adam's first step: lr * sign(g)).
    hyper["learning_rate"] = jnp.asarray(2e-2)
    updates2, _ = jax.jit(tx.update)(_grads(PARAMS, 0), state, PARAMS)
    ratio = np.asarray(updates2["w"]) / np.asarray(updates["w"])
    assert np.median(ratio) == pytest.approx(2.0, rel=0.05)


def test_stored_bytes_and_slot_names_per_format():
    """Adam on a 8192-element kernel and a 100-element bias: the kernel's slots are stored in
    the format, the bias's stay float32 (< 4096 elements), the step count stays int32."""
    n = 128 * 64
    expected = {  # slot -> bytes (kernel + bias)
        "fp32": {"slot:mu": 4 * n + 400, "slot:nu": 4 * n + 400},
        "bf16": {"slot:mu": 2 * n + 400, "slot:nu": 2 * n + 400},
        # int8: a byte a value, one float32 absmax per 2048-block
        "int8": {
            "slot:mu": n + 400,
            "slot:mu scales": 4 * 4,
            "slot:nu": n + 400,
            "slot:nu scales": 4 * 4,
        },
        # int4: two values a byte; mu per 128-block, nu rank-1 (128 + 64 maxima)
        "int4": {
            "slot:mu": n // 2 + 400,
            "slot:mu scales": 64 * 4,
            "slot:nu": n // 2 + 400,
            "slot:nu scales": (128 + 64) * 4,
        },
    }
    for fmt, slots_expected in expected.items():
        opt = lm.quantized_state(optax.adam(1e-3), fmt)
        state = opt.init(PARAMS)
        breakdown = memory.optimizer_breakdown(PARAMS, state)
        got = {k: v for k, v in breakdown.items() if k.startswith("slot:") and k != "slot:count"}
        assert got == slots_expected, fmt
        assert breakdown["slot:count"] == 4
        assert state.inner_state[0].mu["b"].dtype == jnp.float32
        # The structure and dtypes never change from step to step (donation, skipped steps).
        _, stepped = _run(opt, PARAMS, steps=2)
        assert jax.tree.structure(stepped) == jax.tree.structure(state)
        assert [x.dtype for x in jax.tree.leaves(stepped)] == [
            x.dtype for x in jax.tree.leaves(state)
        ]
    assert opt.describe(state)["optimizer_state"] == {
        "format": "int4",
        "quantized_leaves": 2,
        "stored_bytes": sum(slots_expected.values()) + 4,
    }


def _least_squares(tx, steps: int) -> float:
    """The loss of a noiseless least-squares fit ``[256, 64] @ [64, 80]`` after ``steps`` of
    ``tx`` from zeros (62.3 at the start)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
    y = a @ jnp.asarray(rng.normal(size=(64, 80)), jnp.float32)

    def loss(p):
        return jnp.mean((a @ p["w"] - y) ** 2)

    def step(_, carry):
        p, state = carry
        u, state = tx.update(jax.grad(loss)(p), state, p)
        return optax.apply_updates(p, u), state

    p = {"w": jnp.zeros((64, 80))}
    p, _ = jax.jit(lambda c: jax.lax.fori_loop(0, steps, step, c))((p, tx.init(p)))
    return float(loss(p))


def test_int8_and_int4_adam_reach_fp32_adams_loss_on_least_squares():
    """A noiseless least-squares fit (Adam, lr 3e-2): bf16 and int8 states track float32 Adam;
    the 4-bit state converges at about half its rate and has no floor of its own.

    The 4-bit lag is the first moment's (block-wise 4-bit dynamic map): with a float32 second
    moment it stays (0.072 at 300 steps), with a float32 first moment and the 4-bit second
    moment it goes (2.3e-4). With the second moment factored (``second_moment="factored"``:
    Adafactor's row and column means, float32) Adam fits faster than with its own (7.4e-9 at
    300 steps), and the 4-bit first moment beside it (the 4-bit paper's "4-bit Factor")
    reaches 5.9e-4 with nearest rounding (the paper's), 4x float32 Adam's, and 2.2e-6 with
    stochastic rounding."""
    train = _least_squares
    fp32 = train(optax.adam(3e-2), 300)  # 1.4e-4 (from 62.3)
    for fmt in ("bf16", "int8"):  # 1.7e-4, 2.1e-4
        got = train(lm.quantized_state(optax.adam(3e-2), fmt), 300)
        assert got < 2 * fp32, (fmt, got, fp32)
    # int4: 0.073 after 300 steps; fp32's 300-step loss at step 613; 7e-9 after 1,000 steps
    # (fp32 Adam: 4e-7, oscillating at its learning rate).
    assert train(lm.quantized_state(optax.adam(3e-2), "int4"), 700) < fp32
    assert train(factored_second_moment(optax.adam(3e-2)), 300) < fp32
    int4_factored = lm.quantized_state(factored_second_moment(optax.adam(3e-2)), "int4")
    assert train(int4_factored, 300) < 10 * fp32
    stochastic = lm.quantized_state(
        factored_second_moment(optax.adam(3e-2)), "int4", stochastic_rounding=True
    )
    assert train(stochastic, 300) < fp32


class _Wide(nn.Module):
    """A 64 x 80 kernel: enough elements (>= 4,096) for a quantized state."""

    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(3)(nn.relu(nn.Dense(80)(x)))


def test_the_plans_stochastic_rounding_lets_4_bit_adam_fit_as_float32_adam():
    """``optimizer_state_rounding="stochastic"`` (a named departure from the papers' nearest
    rounding) with the second moment factored: 4-bit Adam's 300-step loss within 2x float32
    Adam's (the 4-bit paper's rule, nearest, gives 5.9e-4 against 1.4e-4)."""
    params = {"w": jnp.zeros((64, 80))}
    plan = lm.Plan(optimizer_state="int4", second_moment="factored",
                   optimizer_state_rounding="stochastic")  # fmt: skip
    fp32 = _least_squares(optax.adam(3e-2), 300)
    assert _least_squares(plan.wrap_optimizer(optax.adam(3e-2), params), 300) < 2 * fp32
    work = lm.custom_workload(
        "wide", _Wide(), classification_batch(8, features=64), loss=lm.classifier_loss_fn,
        optimizer=optax.adam(3e-2), init=lambda m, rng, b: m.init(rng, b["image"]),
    )  # fmt: skip
    (verdict,) = [v for v in lm.build(work, plan).verdicts() if v.technique == "optimizer_state"]
    assert verdict.took_effect and "int4, rounded stochastically" in verdict.evidence, verdict


def test_half_precision_adam_zero_and_underflowing_gradients_stay_finite():
    """float16 parameters and slots: optax.adam in float16 gives 0/0 and x/0 (eps = 1e-8 rounds
    to 0; g**2 underflows); the wrapper's float32 arithmetic does not."""
    params = {"w": jnp.full((64, 64), 0.1, jnp.float16)}
    g = np.zeros((64, 64), np.float16)
    g[:32] = 1e-4  # g**2 = 1e-8 < float16's smallest subnormal (6e-8): nu underflows to 0
    grads = {"w": jnp.asarray(g)}  # the other half exactly 0
    plain = optax.adam(1e-3)
    updates, _ = plain.update(grads, plain.init(params), params)
    assert not np.isfinite(np.asarray(updates["w"], np.float32)).all()  # the bug, reproduced
    for fmt in ("auto", "fp32", "bf16", "int8"):
        opt = lm.quantized_state(optax.adam(1e-3), fmt)
        state = opt.init(params)
        for _ in range(3):
            updates, state = opt.update(grads, state, params)
            u = np.asarray(updates["w"], np.float32)
            assert updates["w"].dtype == jnp.float16 and np.isfinite(u).all(), fmt
            assert not u[32:].any() and (u[:32] < 0).all()  # zero grads, zero updates
        decoded = opt.decode(state.inner_state)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(decoded))


def test_pure_fp16_adam_train_step_keeps_finite_parameters():
    model = BNNet(dtype=jnp.float16)
    plan = lm.Plan(precision="fp16")
    batch = classification_batch(n=16)
    variables = model.init(jax.random.PRNGKey(0), batch["image"], train=False)
    tx = plan.wrap_optimizer(optax.adam(1e-2))
    assert isinstance(tx, lm.techniques.optimizer_state.QuantizedStateOptimizer)
    assert tx.format == "auto"
    state = lm.TrainState.create(
        params=variables["params"],
        tx=tx,
        plan=plan,
        model_state={"batch_stats": variables["batch_stats"]},
    )
    # auto: 16-bit slots for 16-bit parameters, in bfloat16 (float16 squares underflow)
    assert {x.dtype for x in jax.tree.leaves(state.opt_state.inner_state[0].nu)} == {
        jnp.dtype(jnp.bfloat16)
    }
    step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.skipped_steps) == 0
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state.params))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_pure_fp16_step_with_low_bit_state_trains_a_regression(fmt):
    """float16 parameters of 8,192 elements (quantized leaves) through the jitted step."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    y = x @ jnp.asarray(rng.normal(size=(64, 128)) / 8, jnp.float32)
    plan = lm.Plan(precision="fp16", optimizer_state=fmt)

    def loss_fn(p, model_state, batch, rng):
        loss = jnp.mean((batch["x"] @ p["w"] - batch["y"]).astype(jnp.float32) ** 2)
        return loss, (model_state, {"loss": loss})

    tx = plan.wrap_optimizer(optax.adam(1e-2))
    state = lm.TrainState.create(params={"w": jnp.zeros((64, 128))}, tx=tx, plan=plan)
    assert state.params["w"].dtype == jnp.float16
    step = fast_jit(lm.make_train_step(loss_fn, tx, plan, jit=False))
    losses = []
    for _ in range(30):
        state, metrics = step(state, {"x": x, "y": y})
        losses.append(float(metrics["loss"]))
    assert int(state.skipped_steps) == 0 and losses[-1] < 0.3 * losses[0], losses


class _NanOnSecondStep:
    """An optax transformation whose second update is NaN although the gradients are finite."""

    def init(self, params):
        return jnp.zeros((), jnp.int32)

    def update(self, grads, count, params=None):
        bad = jnp.where(count == 1, jnp.nan, 1.0)
        return jax.tree.map(lambda g: -0.1 * g * bad, grads), count + 1


def test_step_with_a_non_finite_update_is_skipped_and_counted_as_such():
    params = {"w": jnp.ones((5, 3))}
    plan = lm.Plan(loss_scale="dynamic", initial_loss_scale=2.0**10)

    def loss_fn(p, model_state, batch, rng):
        loss = jnp.mean((batch["x"] @ p["w"]) ** 2)
        return loss, (model_state, {"loss": loss})

    state = lm.TrainState.create(params=params, tx=_NanOnSecondStep(), plan=plan)
    step = fast_jit(lm.make_train_step(loss_fn, _NanOnSecondStep(), plan, jit=False))
    batch = {"x": jnp.ones((4, 5))}
    state, m1 = step(state, batch)
    before = state
    state, m2 = step(state, batch)
    assert bool(m1["update_finite"]) and bool(m2["grads_finite"])
    assert not bool(m2["update_finite"]) and int(m2["skipped_steps"]) == 1
    np.testing.assert_array_equal(state.params["w"], before.params["w"])
    assert int(state.opt_state) == 1  # the optimizer's own counter was not advanced
    # The loss scale answers to overflowing gradients only: not backed off here.
    assert float(state.loss_scale.loss_scale) == float(before.loss_scale.loss_scale)
    state, m3 = step(state, batch)  # the same NaN again: the counter is stuck at 1
    assert int(m3["skipped_steps"]) == 2


def _two_steps(opt, state, stored, grads, pattern=lambda state: state.pattern):
    """Two updates of ``opt`` (sparse training rewires at the second); the state, the stored
    parameters, the last updates and the sparse pattern before the second update."""
    update = jax.jit(opt.update, compiler_options=FAST_COMPILE)
    for _ in range(2):
        old = pattern(state)
        updates, state = update(grads, state, stored)
        stored = optax.apply_updates(stored, updates)
    return state, stored, updates, old


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_sparse_slot_reset_of_regrown_weights_reaches_the_quantized_slots(fmt):
    params = tiny_params()
    # zeros_first: regrowth lands only where the mask was off, so the masks tell regrown weights
    # from kept ones (under the published rule a just-dropped weight may be both, reset to 0).
    cfg = sparsity.SparseConfig(
        algorithm="set", density=0.3, update_period=2, drop_fraction=0.5, regrow_pool="zeros_first"
    )
    sp = sparsity.sparse_training(optax.adam(1e-2), cfg, params)
    opt = lm.quantized_state(sp, fmt, min_size=0, block_size=8)  # quantize even tiny leaves
    stored, state = jax.jit(opt.store)(params)  # one program, not one per primitive and shape
    assert any(isinstance(x, quantization.Quantized) for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, quantization.Quantized)))  # fmt: skip
    grads = jax.tree.map(jnp.sin, params)
    state, stored, _, old_masks = _two_steps(
        opt, state, stored, grads, pattern=lambda state: state.inner_state.pattern
    )
    decoded = jax.jit(opt.decode)(state.inner_state)
    mu, nu = slots.find_mirrors(decoded.inner_state, stored)
    for k in sp.layout.keys:
        regrown = np.asarray(state.inner_state.pattern[k] & ~old_masks[k])
        assert regrown.any()
        kept = np.asarray(state.inner_state.pattern[k] & old_masks[k])
        m = np.asarray(leaves_by_key(mu, [k])[k])
        v = np.asarray(leaves_by_key(nu, [k])[k])
        assert not m[regrown].any() and m[kept].any()  # the signed maps hold an exact 0
        if fmt == "int8":
            assert not v[regrown].any()
        else:  # the zero-free linear map: a reset second moment is the smallest code, s / 16
            assert (v[regrown] <= v[kept].max() / 16 * 1.0001).all()
            assert (v[regrown] < v[kept].min()).all()


def test_plan_puts_16_bit_slots_inside_sparse_training():
    params = lm.techniques.precision.cast_floating(tiny_params(), jnp.bfloat16)
    cfg = sparsity.SparseConfig(algorithm="set", density=0.3, update_period=2, drop_fraction=0.5)
    # Pure bf16, optimizer_state auto: bfloat16 slots, float32 arithmetic, inside.
    inside = lm.Plan(precision="bf16", sparsity=cfg).wrap_optimizer(optax.adam(1e-2), params)
    assert isinstance(inside, sparsity.SparseTraining)
    assert isinstance(inside.inner, lm.techniques.optimizer_state.QuantizedStateOptimizer)
    # bf16 slots inside: sparse training finds them as mirrors and resets the regrown ones.
    stored, state = inside.store(params)
    grads = jax.tree.map(jnp.sin, params)
    state, stored, _, old_masks = _two_steps(inside, state, stored, grads)
    mirrors = slots.find_mirrors(state.inner_state, stored)
    assert len(mirrors) == 2 and {x.dtype for x in jax.tree.leaves(mirrors)} == {
        jnp.dtype(jnp.bfloat16)
    }
    for k in inside.layout.keys:
        regrown = np.asarray(state.pattern[k] & ~old_masks[k])
        assert regrown.any()
        for mirror in mirrors:
            assert not np.asarray(leaves_by_key(mirror, [k])[k], np.float32)[regrown].any()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_plan_puts_codes_inside_sparse_training_resets_them_and_decodes_in_groups(fmt):
    """Inside sparse training an int8 / int4 state is updated one group of leaves at a time
    (the inner update is separable; the sparse one is not), and sparse training resets the
    regrown weights' slots in their codes."""
    rng = np.random.default_rng(0)
    params = {
        name: {"kernel": jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)}
        for name in ("a", "b", "c")
    }
    cfg = sparsity.SparseConfig(
        algorithm="set", density=0.3, update_period=2, drop_fraction=0.5, regrow_pool="zeros_first"
    )
    plan = lm.Plan(sparsity=cfg, optimizer_state=fmt)
    inside = plan.wrap_optimizer(optax.adam(1e-2), params)
    assert isinstance(inside, sparsity.SparseTraining)
    assert isinstance(inside.inner, lm.techniques.optimizer_state.QuantizedStateOptimizer)
    stored, state = inside.store(params)
    grads = jax.tree.map(jnp.sin, stored)
    groups, why = inside.inner.schedule(grads, state.inner_state.inner_state, stored)
    assert groups is not None and len(groups) == 3, why
    # The same first update as the state quantized around sparse training (no rewiring yet).
    outside = lm.quantized_state(sparsity.sparse_training(optax.adam(1e-2), cfg, params), fmt)
    stored_o, state_o = outside.store(params)
    np.testing.assert_allclose(
        jax.tree.leaves(jax.jit(outside.update)(grads, state_o, stored_o)[0]),
        jax.tree.leaves(jax.jit(inside.update)(grads, state, stored)[0]),
        rtol=1e-6,
    )
    state, stored, _, old_masks = _two_steps(inside, state, stored, grads)
    mu, nu = slots.find_mirrors(state.inner_state.inner_state, stored)
    for k in inside.layout.keys:
        regrown = np.asarray(state.pattern[k] & ~old_masks[k]).reshape(-1)
        kept = np.asarray(state.pattern[k] & old_masks[k]).reshape(-1)
        assert regrown.any() and kept.any()
        m_q, v_q = leaves_by_key(mu, [k])[k], leaves_by_key(nu, [k])[k]
        assert isinstance(m_q, quantization.Quantized) and isinstance(v_q, quantization.Quantized)
        m = np.asarray(quantization.dequantize(m_q)).reshape(-1)
        v = np.asarray(quantization.dequantize(v_q)).reshape(-1)
        assert not m[regrown].any() and m[kept].any()  # the signed maps hold an exact 0
        if fmt == "int8":
            assert not v[regrown].any() and v[kept].all()
        else:  # the zero-free linear map: a reset second moment is its smallest code, s / 16
            codes = np.asarray(v_q.codes)
            nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(-1)[: v.size]
            assert not nibbles[regrown].any() and v[regrown].all()


def test_snfs_reads_an_int8_momentum_inside_sparse_training():
    """SNFS regrows by the momentum slot: inside sparse training an int8 one is decoded for
    it, and the layers' regrowth counts follow the float32 momentum's (within 2%: the
    decoded momentum, and so the weights pruned, differ by the quantization error)."""
    rng = np.random.default_rng(0)
    params = {n: {"kernel": jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)} for n in "ab"}
    cfg = sparsity.SparseConfig(algorithm="snfs", density=0.3, update_period=2)
    counts = {}
    for fmt in ("fp32", "int8"):
        opt = lm.Plan(sparsity=cfg, optimizer_state=fmt).wrap_optimizer(
            optax.sgd(1e-2, momentum=0.9), params
        )
        stored, state = opt.store(params)
        grads = jax.tree.map(jnp.cos, stored)
        state, stored, updates, old = _two_steps(opt, state, stored, grads)
        assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
        counts[fmt] = [int((state.pattern[k] & ~old[k]).sum()) for k in opt.layout.keys]
    assert sum(counts["int8"]) > 0
    np.testing.assert_allclose(counts["int8"], counts["fp32"], rtol=0.02, atol=2)


def test_compressed_sparse_storage_quantizes_the_values_slots():
    params = {"dense": {"kernel": jnp.asarray(np.random.default_rng(0).normal(size=(128, 256)))}}
    cfg = sparsity.SparseConfig(density=0.25, compressed=True, is_sparse=lambda p, s: True)
    opt = lm.quantized_state(sparsity.sparse_training(optax.adam(1e-2), cfg, params), "int8")
    stored, state = opt.store(params)
    values = stored["dense"]["kernel"]
    assert values.size == 128 * 256 // 4
    mu = state.inner_state.inner_state[0].mu["dense"]["kernel"]
    assert isinstance(mu, quantization.Quantized) and mu.shape == values.shape
    assert mu.codes.size == values.size and mu.codes.dtype == jnp.uint8
    update = jax.jit(opt.update, compiler_options=FAST_COMPILE)
    updates, state = update(jax.tree.map(jnp.ones_like, params), state, stored)
    assert updates["dense"]["kernel"].shape == values.shape
    assert np.isfinite(np.asarray(updates["dense"]["kernel"])).all()


def test_plan_validates_the_format_and_leaves_fp32_plans_unwrapped():
    with pytest.raises(ValueError, match="optimizer_state='int2'.*allowed values"):
        lm.Plan(optimizer_state="int2")
    with pytest.raises(ValueError, match="block_size"):
        lm.quantized_state(optax.sgd(0.1), "int8", block_size=7)
    tx = optax.sgd(0.1)
    assert isinstance(lm.Plan().wrap_optimizer(tx), lm.core.base.OptaxOptimizer)
    assert lm.Plan(precision="mixed_fp16").wrap_optimizer(tx).tx is tx
    assert lm.Plan(optimizer_state="int8").wrap_optimizer(tx).format == "int8"
    assert lm.Plan(optimizer_state="int4").to_dict()["optimizer_state"] == "int4"


def test_analysis_of_a_wrn_with_int8_momentum_names_the_quantized_slots():
    reports = {
        fmt: lm.analyze_model("wrn-10-1", 8, lm.Plan(optimizer_state=fmt), image_size=8)
        for fmt in ("fp32", "int8")
    }
    opt = {k: r.analytic["optimizer_breakdown"] for k, r in reports.items()}
    assert set(opt["int8"]) >= {"slot:trace", "slot:trace scales"}
    # The 3x3 kernels of 16+ channels are quantized (>= 4096 elements): a quarter of the bytes.
    assert opt["int8"]["slot:trace"] < 0.5 * opt["fp32"]["slot:trace"]
    assert reports["int8"].xla["argument_bytes"] < reports["fp32"].xla["argument_bytes"]
    saved = reports["fp32"].xla["argument_bytes"] - reports["int8"].xla["argument_bytes"]
    analytic_saved = (
        reports["fp32"].analytic["optimizer_bytes"] - reports["int8"].analytic["optimizer_bytes"]
    )
    assert saved == analytic_saved  # XLA's argument bytes fall by exactly the analytic slots


def test_quantized_train_state_checkpoints_round_trip_exactly(tmp_path):
    from lowmem_jax.training.checkpointing import Checkpointer

    plan = lm.Plan(optimizer_state="int4")
    tx = plan.wrap_optimizer(optax.adam(1e-3))
    state = lm.TrainState.create(params=PARAMS, tx=tx, plan=plan)
    _, opt_state = tx.update(_grads(PARAMS, 0), state.opt_state, state.params)
    state = state.replace(opt_state=opt_state)
    checkpointer = Checkpointer(str(tmp_path), every=1)
    checkpointer.save(1, state, force=True)
    restored = checkpointer.restore(lm.TrainState.create(params=PARAMS, tx=tx, plan=plan))
    checkpointer.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_stochastic_rounding_keeps_its_key_in_the_state_and_advances_it():
    opt = lm.quantized_state(optax.adam(1e-2), "int8", stochastic_rounding=True, seed=3)
    state = opt.init(PARAMS)
    np.testing.assert_array_equal(state.rng, jax.random.PRNGKey(3))
    _, s1 = opt.update(_grads(PARAMS, 0), state, PARAMS)
    _, s2 = opt.update(_grads(PARAMS, 0), s1, PARAMS)
    assert not np.array_equal(s1.rng, state.rng) and not np.array_equal(s2.rng, s1.rng)
    # Same state and gradients, different keys: the codes of the first moment differ somewhere.
    _, other = opt.update(_grads(PARAMS, 0), state._replace(rng=jax.random.PRNGKey(4)), PARAMS)
    mu1, mu2 = s1.inner_state[0].mu["w"], other.inner_state[0].mu["w"]
    assert not np.array_equal(mu1.codes, mu2.codes)
