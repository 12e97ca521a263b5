"""Compressed gradient communication (lowmem_jax.techniques.shard.compression) over 8 host devices.

Run with tests/sharding_cases.py in its 8-device process (tests/test_sharding.py). Alone:
``LOWMEM_TEST_DEVICES=8 python -m pytest tests/grad_compression_cases.py``.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BNNet, classification_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import lowmem_jax as lm
from lowmem_jax.analysis import collectives
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.techniques.shard import compression as gc

DEVICES = 8
GROUP = 256
N = gc.padded_size(3 * GROUP * DEVICES, DEVICES)  # three groups per device's chunk
MESH = Mesh(np.asarray(jax.devices()[:DEVICES]), ("data",))


@jax.jit
def _reduce(grads, worker, server):
    """``int8_mean`` of ``grads[d]`` from device ``d``: (the mean as every device has
    it, stacked; the errors)."""
    rows = P("data")

    def local(g, w, s):
        mean, w, s = gc.int8_mean(g[0], w[0], s[0], "data")
        return mean[None], w[None], s[None]

    return jax.shard_map(local, mesh=MESH, in_specs=(rows,) * 3, out_specs=(rows,) * 3)(
        grads, worker, server
    )


def _zeros():
    return jnp.zeros((DEVICES, N)), jnp.zeros((DEVICES, N // DEVICES))


def _group_ranges(x):
    groups = np.asarray(x).reshape(*np.shape(x)[:-1], -1, GROUP)
    return groups.max(-1) - groups.min(-1)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), log_scale=st.floats(-6, 3))
def test_the_int8_mean_is_within_two_half_steps_of_the_mean(seed, log_scale):
    grads = np.random.default_rng(seed).standard_normal((DEVICES, N)).astype(np.float32)
    grads *= np.float32(10.0**log_scale)
    mean, _, _ = _reduce(jnp.asarray(grads), *_zeros())
    mean = np.asarray(mean)
    assert (mean == mean[0]).all()  # every device decoded the same rows
    exact = grads.astype(np.float64).mean(0)
    # phase 1: each device's codes at most half a step (range / 255 / 2) off; phase 2: the
    # chunk's range is at most the exact mean's plus twice phase 1's error
    first = _group_ranges(grads).mean(0) / 510
    second = (_group_ranges(exact) + 2 * first) / 510
    bound = np.repeat(first + second, GROUP) * 1.001 + 1e-6 * np.abs(exact).max()
    assert (np.abs(mean[0] - exact) <= bound).all()


def test_error_feedback_loses_nothing_over_steps():
    """sum_t mean_t + server error + average worker error == sum_t exact mean_t: what the
    compression holds back is carried, not dropped."""
    rng = np.random.default_rng(0)
    worker, server = _zeros()
    applied = exact = 0.0
    for _ in range(6):
        grads = rng.standard_normal((DEVICES, N)).astype(np.float32)
        mean, worker, server = _reduce(jnp.asarray(grads), worker, server)
        applied = applied + np.asarray(mean[0], np.float64)
        exact = exact + grads.astype(np.float64).mean(0)
    held = np.asarray(server, np.float64).reshape(-1) + np.asarray(worker, np.float64).mean(0)
    np.testing.assert_allclose(applied + held, exact, atol=2e-5)
    assert np.abs(held).max() > 1e-4  # something was held back, so the test tests it


class WideMLP(nn.Module):
    """13,818 parameters: 3.7% of padding to whole groups on every device."""

    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(3)(nn.relu(nn.Dense(1535)(x)))


def _step(plan, params, tx, batch):
    wrapped = plan.wrap_optimizer(tx, params)
    state = jax.jit(lambda p: lm.TrainState.create(params=p, tx=wrapped, plan=plan))(params)
    state = jax.device_put(state, lm.techniques.shard.state_shardings(state, plan))
    step = lm.make_train_step(lm.classifier_loss_fn(WideMLP()), wrapped, plan, donate=False)
    return step, state


def test_the_int8_step_tracks_dp_and_sends_a_quarter_of_its_bytes():
    batches = [classification_batch(32, seed=s % 2) for s in range(20)]
    params = WideMLP().init(jax.random.key(0), batches[0]["image"])["params"]
    tx = optax.adam(1e-2)
    runs = {}
    int8 = {"grad_compression": "int8"}
    for name, extra in [("dp", {}), ("int8", int8), ("int8 mb 2", {**int8, "microbatches": 2}),
                        ("zero1 int8", {**int8, "shard": "zero1"})]:  # fmt: skip
        plan = lm.Plan(**{"shard": "dp", "devices": DEVICES, **extra})
        step, state = _step(plan, params, tx, batches[0])
        hlo = step.lower(state, batches[0]).compile().as_text()
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[name] = (collectives.collectives(hlo), losses, state)
    dp, int8, int8_mb = (runs[k] for k in ("dp", "int8", "int8 mb 2"))
    # The error state is one row per device, laid out over the mesh.
    worker, server = int8[2].opt_state.errors
    assert worker.shape[0] == server.shape[0] == DEVICES
    assert worker.sharding.spec == server.sharding.spec == P("data")
    # Bytes: an all-to-all and an all-gather of uint8 rows, 0.26x dp's all-reduce, and the
    # same with two microbatches (dp all-reduces inside the microbatch loop, this once).
    kinds = int8[0]["by_kind"]
    assert kinds["all-to-all"]["count"] == kinds["all-gather"]["count"] == 1
    assert int8[0]["sent_bytes"] <= 0.3 * dp[0]["sent_bytes"]
    assert int8_mb[0]["sent_bytes"] == int8[0]["sent_bytes"]
    # Training: the losses follow dp's (the same gradients up to the compression's error).
    np.testing.assert_allclose(int8[1], dp[1], rtol=0.02)
    np.testing.assert_allclose(int8_mb[1], int8[1], rtol=1e-3)  # summed in another order
    np.testing.assert_allclose(runs["zero1 int8"][1], int8[1], rtol=1e-4)  # the state split
    assert int8[1][-1] < 0.8 * int8[1][0]


def test_batchnorm_statistics_are_per_device_and_averaged_after_the_step():
    """Each device normalises its own examples; the running averages leave the step as the
    mean of the devices' (BNNet: one BatchNorm after a Dense layer)."""
    batch = classification_batch(16, seed=1)
    variables = jax.jit(lambda x: BNNet().init(jax.random.key(0), x, train=False))(batch["image"])
    plan = lm.Plan(shard="dp", devices=DEVICES, grad_compression="int8")
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    wrapped = plan.wrap_optimizer(optax.sgd(0.0), params)
    state = lm.TrainState.create(params=params, tx=wrapped, plan=plan, model_state=model_state)
    state = jax.device_put(state, lm.techniques.shard.state_shardings(state, plan))
    step = lm.make_train_step(lm.classifier_loss_fn(BNNet()), wrapped, plan, donate=False)
    new, _ = step(state, batch)

    def stats_after(images):
        _, updated = BNNet().apply(variables, images, train=True, mutable=["batch_stats"])
        return updated["batch_stats"]

    per_device = [stats_after(x) for x in np.split(np.asarray(batch["image"]), DEVICES)]
    want = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *per_device)
    got = jax.tree.map(np.asarray, new.model_state["batch_stats"])
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), got, want)


def test_analyze_says_the_gradients_went_int8_and_what_they_cost(capsys):
    argv = ["analyze", "--model", "wrn-10-1", "--batch-size", "16", "--devices", "8",
            "--shard", "dp", "--grad-compression", "int8"]  # fmt: skip
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    verdict = {v["technique"]: v for v in report["verdicts"]}["shard"]
    assert verdict["took_effect"] and "reduced in int8 with error feedback" in verdict["evidence"]
    # dp's float32 all-reduce would send 2 * 7/8 * 4 bytes per parameter
    dp_bytes = 2 * 7 / 8 * 4 * report["param_count"]
    assert report["xla"]["collectives"]["sent_bytes"] <= 0.3 * dp_bytes


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_stages_that_partition_the_gradient_refuse_it(stage):
    with pytest.raises(ValueError, match="needs shard=dp or zero1"):
        lm.Plan(shard=stage, grad_compression="int8")


def test_a_model_nobody_here_wrote_trains_with_int8_gradients():
    """transformers' Flax GPT-2 (dropout: a key per device) through the public API: the step
    sends int8 and the loss falls on a fixed batch."""
    from experiments import conformance_models

    work = conformance_models.gpt2()
    plan = lm.Plan(shard="dp", devices=DEVICES, grad_compression="int8")
    found = conformance_models.subject(work, plan)
    tx = plan.wrap_optimizer(optax.adam(3e-3), found.params)
    state = lm.TrainState.create(
        params=found.params, tx=tx, plan=plan, model_state=found.model_state
    )
    state = jax.device_put(state, lm.techniques.shard.state_shardings(state, plan))
    step = lm.make_train_step(found.loss_fn, tx, plan, donate=False)
    verdict = {v.technique: v for v in lm.verdicts(step, state, found.batch, plan=plan, tx=tx)}
    assert verdict["shard"].took_effect, verdict["shard"].evidence
    losses = []
    for _ in range(4):
        state, metrics = step(state, found.batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def _powersgd(leaves, error, qs, stacked=None):
    """``powersgd_mean`` of device ``d``'s ``leaves[d]`` (lists stacked per leaf)."""
    rows = P("data")

    @jax.jit
    def run(leaves, error, qs):
        def local(leaves, error, qs):
            mine = [x[0] for x in leaves]
            mean, error, qs = gc.powersgd_mean(mine, error[0], qs, "data", stacked)
            return [m[None] for m in mean], error[None], qs

        return jax.shard_map(
            local, mesh=MESH, in_specs=(rows, rows, P()), out_specs=(rows, rows, P()),
            check_vma=False,
        )(leaves, error, qs)  # fmt: skip

    return run(leaves, error, qs)


SHAPES = [(3, 3, 8, 16), (40, 30), (30,)]  # two factored at rank 2, a vector whole


def _qs(rank):
    keys = jax.random.split(jax.random.key(0), 2)
    return [jax.random.normal(k, (1, s[-1], rank)) for k, s in zip(keys, SHAPES[:2], strict=True)]


def test_powersgd_recovers_a_low_rank_mean_exactly():
    rng = np.random.default_rng(0)
    leaves = []
    for shape in SHAPES:  # every device a multiple of one rank-1 matrix (a vector: any)
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        base = np.outer(rng.standard_normal(rows), rng.standard_normal(cols)).reshape(shape)
        scale = rng.uniform(0.5, 2, DEVICES).reshape(-1, *[1] * len(shape))
        leaves.append(jnp.asarray((scale * base).astype(np.float32)))
    n = sum(int(np.prod(s)) for s in SHAPES)
    mean, error, _ = _powersgd(leaves, jnp.zeros((DEVICES, n)), _qs(2))
    for m, x in zip(mean, leaves, strict=True):
        np.testing.assert_allclose(np.asarray(m)[0], np.asarray(x).mean(0), rtol=1e-4, atol=1e-5)
        assert (np.asarray(m) == np.asarray(m)[0]).all()  # the same on every device
    # each device's error is its own gradient minus the shared mean
    want = np.concatenate([np.asarray(x - x.mean(0)).reshape(DEVICES, -1) for x in leaves], 1)
    np.testing.assert_allclose(np.asarray(error), want, atol=1e-4)


def test_powersgd_factors_each_block_of_a_stack_apart():
    """Three blocks, each rank 1 on every device: rank 2 per block recovers their mean
    exactly, where the stack as one [120, 30] matrix (rank 3) would not."""
    rng = np.random.default_rng(3)
    blocks = np.stack([np.outer(rng.standard_normal(40), rng.standard_normal(30))
                       for _ in range(3)])  # fmt: skip
    scale = rng.uniform(0.5, 2, DEVICES).reshape(-1, 1, 1, 1)
    leaf = jnp.asarray((scale * blocks).astype(np.float32))  # [devices, 3, 40, 30]
    q = jax.random.normal(jax.random.key(0), (3, 30, 2))
    mean, _, _ = _powersgd([leaf], jnp.zeros((DEVICES, leaf[0].size)), [q], stacked=[True])
    np.testing.assert_allclose(np.asarray(mean[0])[0], np.asarray(leaf).mean(0), atol=1e-4)
    assert gc.matrix_view((3, 40, 30), stacked=True) == (3, 40, 30)
    assert gc.matrix_view((3, 3, 8, 16)) == (1, 72, 16)


def test_powersgd_error_feedback_loses_nothing_over_steps():
    rng = np.random.default_rng(1)
    n = sum(int(np.prod(s)) for s in SHAPES)
    error, qs = jnp.zeros((DEVICES, n)), _qs(2)
    applied = exact = 0.0
    for _ in range(5):
        leaves = [jnp.asarray(rng.standard_normal((DEVICES, *s)), jnp.float32) for s in SHAPES]
        mean, error, qs = _powersgd(leaves, error, qs)
        applied = applied + np.concatenate([np.asarray(m[0], np.float64).reshape(-1) for m in mean])
        exact = exact + np.concatenate([np.asarray(x, np.float64).mean(0).reshape(-1)
                                        for x in leaves])  # fmt: skip
    held = np.asarray(error, np.float64).mean(0)
    np.testing.assert_allclose(applied + held, exact, atol=1e-4)
    assert np.abs(held).max() > 0.1  # rank 2 of 16 and 30 columns holds much back


def _trained(plan, tx):
    """WideMLP's step under ``plan`` over 20 batches (two, alternating), its loss falling:
    (what the compiled step sends, its verdicts)."""
    batches = [classification_batch(32, seed=s % 2) for s in range(20)]
    params = WideMLP().init(jax.random.key(0), batches[0]["image"])["params"]
    step, first = _step(plan, params, tx, batches[0])
    sent = collectives.collectives(step.lower(first, batches[0]).compile().as_text())
    state, losses = first, []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
    wrapped = plan.wrap_optimizer(tx, params)
    verdicts = lm.verdicts(step, first, batches[0], plan=plan, tx=wrapped)
    return sent, {v.technique: v for v in verdicts}


def test_the_powersgd_step_trains_and_sends_its_factors():
    plan = lm.Plan(shard="dp", devices=DEVICES, grad_compression="powersgd", powersgd_rank=2)
    sent, verdict = _trained(plan, optax.adam(1e-2))
    # both kernels ([5, 1535] and [1535, 3]) as rank-2 factors, the biases whole
    floats = 2 * (5 + 1535) + 2 * (1535 + 3) + 1535 + 3
    reduced = sent["by_kind"]["all-reduce"]["bytes"]
    assert 4 * floats <= reduced <= 4 * floats + 64  # + the loss and finiteness flags
    assert verdict["shard"].took_effect and "2 of 4 leaves" in verdict["shard"].evidence


@jax.jit
def _topk(flat, error):
    rows = P("data")

    def local(g, e):
        mean, e = gc.topk_mean(g[0], e[0], 64, "data")
        return mean[None], e[None]

    return jax.shard_map(local, mesh=MESH, in_specs=(rows, rows), out_specs=(rows, rows))(
        flat, error
    )


def test_topk_sends_the_largest_entries_and_feeds_back_the_rest():
    rng = np.random.default_rng(2)
    n = 1000
    error = jnp.zeros((DEVICES, n))
    applied = exact = 0.0
    for step in range(5):
        grads = rng.standard_normal((DEVICES, n)).astype(np.float32)
        mean, new_error = _topk(jnp.asarray(grads), error)
        mean = np.asarray(mean)
        assert (mean == mean[0]).all()  # the same sum, in the same order, on every device
        v = grads + np.asarray(error)
        if step == 0:  # each device sent exactly its 64 largest |v|: the rest is its error
            kept = np.abs(np.asarray(new_error)) > 0
            assert (kept.sum(1) == n - 64).all()
            threshold = np.sort(np.abs(v), axis=1)[:, -64]
            assert (np.abs(v)[kept] <= np.repeat(threshold, n - 64)).all()
        applied = applied + mean[0].astype(np.float64)
        exact = exact + grads.astype(np.float64).mean(0)
        error = new_error
    held = np.asarray(error, np.float64).mean(0)
    np.testing.assert_allclose(applied + held, exact, atol=1e-5)


def test_the_topk_step_trains_and_sends_its_pairs():
    plan = lm.Plan(shard="dp", devices=DEVICES, grad_compression="topk", topk_fraction=0.05)
    sent, verdict = _trained(plan, optax.adam(3e-3))
    k = gc.topk_count(13_818, 0.05)
    assert sent["by_kind"]["all-gather"]["bytes"] == DEVICES * k * 8  # int32 index + value
    assert verdict["shard"].took_effect and f"{k:,} of 13,818 entries" in verdict["shard"].evidence
