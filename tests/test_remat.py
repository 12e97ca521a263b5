import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close_to_scale

import lowmem_jax as lm
from lowmem_jax.core.jaxprs import traced_equations

# The last: a per-block schedule of WRN-28-1's 12 blocks (stacks of 1, 3, 1, 3, 1, 3), with
# runs of different policies inside a stack.
POLICIES = ["full", "dots", "save:conv_out", "offload:conv_out", "every:2", "every:3", "sqrt",
            "blocks:full,dots*2,none,full*4,none*2,dots,none"]  # fmt: skip


def _wrn_grads(remat, depth=28, batch=4, size=8):
    model = lm.models.WideResNet(depth=depth, width=1, num_classes=10, remat=remat)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
    init = jax.jit(lm.models.WideResNet(depth=depth, width=1).init, static_argnames="train")
    variables = init(jax.random.key(0), images, train=False)
    loss_fn = lm.classifier_loss_fn(model)
    state = {"batch_stats": variables["batch_stats"]}
    grad_fn = jax.jit(
        lambda p: jax.grad(loss_fn, has_aux=True)(
            p, state, {"image": images, "label": labels}, None
        ),
        compiler_options=lm.compiler_options(remat) or None,
    )
    return grad_fn(variables["params"])


@pytest.fixture(scope="module")
def baseline():
    return _wrn_grads("none")


@pytest.mark.parametrize("policy", POLICIES)
def test_remat_gradients_equal_no_remat(baseline, policy):
    grads, (new_state, _) = _wrn_grads(policy)
    ref_grads, (ref_state, _) = baseline
    # Two programs: float32 roundoff, which each program's fusion (XLA's version and flags, this
    # CPU) may round differently.
    assert_trees_close_to_scale(grads, ref_grads)
    assert_trees_close_to_scale(new_state, ref_state)


def test_trees_close_to_scale_take_roundoff_and_refuse_a_wrong_value():
    """The comparison above: an element off by roundoff of its leaf's size passes; one off by
    0.1% of it fails."""
    ref = {"w": np.array([1.0, 1e-3, -0.5], np.float32)}
    assert_trees_close_to_scale({"w": ref["w"] + np.float32(3e-6)}, ref)
    with pytest.raises(AssertionError):
        assert_trees_close_to_scale({"w": ref["w"] + np.array([0, 1e-3, 0], np.float32)}, ref)


class Block(nn.Module):
    features: int = 64
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train):
        dense = functools.partial(nn.Dense, self.features, dtype=self.dtype)
        h = jnp.tanh(dense()(x))
        h = jnp.tanh(dense()(h))
        return x + dense()(h)


def _stack_temp_bytes(remat, length=16, batch=1024, options=None):
    stack = lm.ScannedBlocks(functools.partial(Block, 64), length, remat)
    x = jnp.ones((batch, 64))
    params = stack.init(jax.random.key(0), x, train=False)["params"]

    def loss(p, x):
        return jnp.sum(stack.apply({"params": p}, x, train=True) ** 2)

    options = lm.compiler_options(remat) if options is None else options
    grad = jax.jit(jax.grad(loss), compiler_options=options or None)
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_temp_bytes_fall_as_remat_saves_less():
    temps = {p: _stack_temp_bytes(p) for p in ["none", "dots", "full", "every:4"]}
    assert temps["none"] > temps["dots"] > temps["full"] > temps["every:4"], temps
    # A stack given one policy per block: half the blocks checkpointed, between the two.
    half = _stack_temp_bytes(("full",) * 8 + ("none",) * 8, options=lm.compiler_options("full"))
    assert temps["none"] > half > temps["full"], (half, temps)


@pytest.mark.parametrize(
    "name, policies",
    [
        ("blocks:full", ("full",)),
        ("blocks:full*2,none,dots*3", ("full",) * 2 + ("none",) + ("dots",) * 3),
    ],
)
def test_a_schedule_parses_to_one_policy_per_block(name, policies):
    spec = lm.techniques.remat.parse_policy(name)
    assert spec.schedule == policies and spec.enabled
    assert lm.techniques.remat.schedule_name(policies) == name
    assert not lm.techniques.remat.parse_policy("blocks:none*3").enabled


@pytest.mark.parametrize(
    "name",
    ["blocks:", "blocks:full*0", "blocks:every:2", "blocks:full*x", "blocks:sqrt", "blocks:,"],
)
def test_a_malformed_schedule_is_refused_naming_remat(name):
    with pytest.raises(ValueError, match=r"Unknown remat=.*blocks:P\[\*K\]"):
        lm.techniques.remat.parse_policy(name)


def test_a_schedule_must_give_every_block_of_the_model_a_policy():
    assert lm.techniques.remat.stack_policies("blocks:full*2,none", [1, 2], "M") == [
        ("full",),
        ("full", "none"),
    ]
    assert lm.techniques.remat.stack_policies("dots", [1, 2], "M") == ["dots", "dots"]
    with pytest.raises(ValueError, match=r"schedules 2 blocks; WRN-16 runs 6"):
        _wrn_grads("blocks:full*2", depth=16)
    with pytest.raises(ValueError, match="needs the scanned block stacks"):
        lm.techniques.remat.remat_module(Block(), "blocks:full")
    with pytest.raises(ValueError, match="a stack takes its slice"):
        _stack_temp_bytes("blocks:full*16")


class Chain(nn.Module):
    """8 blocks that are not scanned (stacks of length 1), like the first block of a WRN group."""

    remat: str

    @nn.compact
    def __call__(self, x, train):
        for i in range(8):
            x = lm.ScannedBlocks(functools.partial(Block, 64), 1, self.remat, name=f"b{i}")(
                x, train=train
            )
        return x


def _chain_temp_bytes(remat, options):
    model, x = Chain(remat), jnp.ones((1024, 64))
    params = model.init(jax.random.key(0), x, train=False)["params"]

    def loss(p, x):
        return jnp.sum(model.apply({"params": p}, x, train=True) ** 2)

    grad = jax.jit(jax.grad(loss), compiler_options=options or None)
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_unscanned_remat_needs_the_cpu_compiler_option():
    if jax.default_backend() != "cpu":
        pytest.skip("the pass in question is XLA:CPU's")
    assert lm.compiler_options("full") == {"xla_disable_hlo_passes": "cse_barrier_expander"}
    assert lm.compiler_options("none") == {}
    baseline = _chain_temp_bytes("none", {})
    # Without the option XLA:CPU merges the recomputation back into the forward pass.
    assert _chain_temp_bytes("full", {}) == baseline
    assert _chain_temp_bytes("full", lm.compiler_options("full")) < 0.5 * baseline


def test_scanned_remat_holds_without_the_option():
    # Inside lax.scan the loop keeps forward and recomputation apart (prevent_cse=False).
    assert _stack_temp_bytes("full", options={}) < 0.5 * _stack_temp_bytes("none", options={})


def test_parameters_do_not_depend_on_policy():
    x = jnp.ones((2, 8, 8, 3))
    shapes = {
        p: jax.tree.map(
            jnp.shape,
            lm.models.WideResNet(depth=28, width=1, remat=p).init(
                jax.random.key(0), x, train=False
            ),
        )
        for p in ["none", "full", "sqrt", "every:2"]
    }
    assert all(s == shapes["none"] for s in shapes.values())


@pytest.mark.parametrize("name", ["some", "every:0", "every:x", "save:", "offload:", "", None])
def test_unknown_policy_raises(name):
    with pytest.raises(ValueError, match=r"remat=.*allowed values"):
        lm.techniques.remat.parse_policy(name)


@pytest.mark.parametrize(
    "name, length, expected", [("sqrt", 9, 3), ("sqrt", 3, 2), ("every:4", 3, 3), ("full", 5, 1)]
)
def test_segment_length(name, length, expected):
    assert lm.techniques.remat.parse_policy(name).segment_length(length) == expected


@pytest.mark.parametrize(
    "remat, dtype, unroll, straight",
    [
        ("none", jnp.float32, None, True),
        ("none", jnp.bfloat16, None, True),
        ("none", jnp.float16, None, False),  # float16 stacks stay loops
        ("full", jnp.float32, None, False),  # remat'd stacks stay loops
        ("full", jnp.float32, True, True),
        ("none", jnp.float32, False, False),
    ],
)
def test_unroll_none_unrolls_stacks_without_remat_or_float16(remat, dtype, unroll, straight):
    """``unroll=None``: the scan is unrolled (its ``unroll`` parameter is the stack's length)
    exactly when :func:`straight_line` says so; the result does not change."""
    stack = lm.ScannedBlocks(functools.partial(Block, 8, dtype), 3, remat, unroll)
    x = jnp.ones((2, 8), dtype)
    params = stack.init(jax.random.key(0), x, train=False)["params"]
    eqns = traced_equations(lambda p: stack.apply({"params": p}, x, train=True), params)
    scans = [e for e in eqns if e.primitive.name == "scan"]
    assert [e.params["unroll"] > 1 for e in scans] == [straight]
    assert lm.blocks.scanned.straight_line(unroll, remat, dtype) is straight
    looped = lm.ScannedBlocks(functools.partial(Block, 8, dtype), 3, remat, False)
    # Two programs (unrolled, looped): the same math, but XLA may fuse them differently on
    # another machine, so the last bit may differ.
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-3
    np.testing.assert_allclose(
        stack.apply({"params": params}, x, train=True),
        looped.apply({"params": params}, x, train=True),
        rtol=tolerance, atol=tolerance,
    )  # fmt: skip


class ContextBlock(nn.Module):
    @nn.compact
    def __call__(self, x, memory, scale, train):
        return x + scale * nn.Dense(x.shape[-1])(memory)


@pytest.mark.parametrize("remat", ["none", "full", "every:2"])
def test_scanned_blocks_pass_context_to_every_block(remat):
    stack = lm.ScannedBlocks(ContextBlock, 3, remat)
    x, memory = jnp.zeros((2, 4)), jnp.ones((2, 4))
    params = stack.init(jax.random.key(0), x, memory, 2.0, train=False)["params"]
    out = stack.apply({"params": params}, x, memory, 2.0, train=True)
    expected = x
    for i in range(3):
        p = jax.tree.map(lambda a, i=i: a[i], params["stack"])
        expected = expected + 2.0 * ContextBlock().apply({"params": p}, x, memory, 1.0, False)
    # float32 sums in another order (the suite compiles without XLA's optimisations): ~1 ulp
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def _looped_loss(checkpoint):
    """Blocks in a scan, a jitted call and a cond, each under ``checkpoint`` (or the same code
    without it when ``checkpoint`` is the identity)."""

    def block(x, w):
        return jnp.tanh(jnp.sin(x @ w) @ w)

    def loss(params, model_state, batch, rng):
        x, _ = jax.lax.scan(lambda c, w: (checkpoint(block)(c, w), None), batch, params["ws"])
        x = jax.jit(checkpoint(lambda y: jnp.cos(jnp.exp(y))))(x)
        x = jax.lax.cond(x.sum() > 0, lambda y: checkpoint(jnp.sin)(y) * 2, lambda y: y, x)
        return (x**2).sum(), (model_state, {})

    return loss


def test_without_checkpoints_saves_what_the_code_without_them_saves():
    """Inlining every checkpoint (in a scan body, a jitted call, a cond branch) gives the loss
    written without them: the same value and gradients, no checkpoint left, and the residual
    bytes of that code (the reference), which are more than the checkpointed loss saves."""
    from lowmem_jax.analysis.analytic import saved_activation_bytes
    from lowmem_jax.core.jaxprs import without_checkpoints

    params = {"ws": jnp.asarray(np.random.default_rng(0).normal(size=(4, 16, 16)) * 0.2)}
    batch = jnp.ones((8, 16))
    remat, plain = _looped_loss(jax.checkpoint), _looped_loss(lambda f: f)
    inlined = without_checkpoints(remat)
    args = (params, {}, batch, None)
    names = {e.primitive.name for e in traced_equations(inlined, *args)}
    assert not names & {"checkpoint", "remat2"}, names
    assert "remat2" in {e.primitive.name for e in traced_equations(remat, *args)}
    want = jax.grad(lambda p: plain(p, {}, batch, None)[0])(params)
    got = jax.grad(lambda p: inlined(p, {}, batch, None)[0])(params)
    np.testing.assert_allclose(got["ws"], want["ws"], rtol=1e-6)
    saved = {f: saved_activation_bytes(f, *args)["bytes"] for f in (remat, plain, inlined)}
    assert saved[inlined] == saved[plain] > saved[remat], saved


class _DenseStack(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(3):
            x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


def test_the_remat_verdict_weighs_saved_residuals_and_says_when_nothing_falls():
    """With the step's loss, remat's verdict gives the residuals saved without and with its
    checkpoints (the "with" figure is the analytic activation figure of lowmem analyze), and a
    checkpoint that saves what the code saved anyway (around each Dense alone: its input)
    took no effect. Checkpoints inside compressed activations' custom derivative cannot be
    inlined: the residuals are not weighed (not a false "no effect")."""
    work = lm.workload("wrn-10-1", 8)
    setup = lm.build(work, lm.Plan(remat="full"))
    (verdict,) = setup.verdicts()
    before, after = (float(x) for x in re.findall(r"([\d.]+) -> ([\d.]+) MiB", verdict.evidence)[0])
    analytic = lm.analysis.memory.analytic_breakdown(
        state=setup.abstract_state(), batch=work.batch, loss_fn=setup.plan.model_loss(setup.loss_fn)
    )
    assert verdict.took_effect and after == round(analytic["activation_bytes"] / 2**20, 2) < before
    compressed = lm.build(work, lm.Plan(remat="full", activations="int8")).verdicts()
    remat = next(v for v in compressed if v.technique == "remat")
    assert remat.took_effect and "saved residuals not weighed" in remat.evidence

    model = _DenseStack()
    x = jnp.ones((16, 8))
    variables = model.init(jax.random.key(0), x)
    plan = lm.Plan(remat="full", remat_blocks=("Dense",))
    tx = plan.wrap_optimizer(optax.sgd(0.1), variables["params"])
    loss_fn = lm.classifier_loss_fn(plan.configure_model(model))
    state = lm.TrainState.create(params=variables["params"], tx=tx, plan=plan)
    batch = {"image": x, "label": jnp.zeros(16, jnp.int32)}
    step = lm.make_train_step(loss_fn, tx, plan)
    (verdict,) = lm.verdicts(step, state, batch, plan=plan, tx=tx, loss_fn=loss_fn)
    assert not verdict.took_effect and verdict.evidence.startswith("4 checkpointed regions")
    (counted,) = lm.verdicts(step, state, batch, plan=plan, tx=tx)  # no loss: regions only
    assert counted.took_effect and "saved residuals" not in counted.evidence


class _NoRepeats(nn.Module):
    """No class runs twice: remat can only checkpoint the whole forward."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(4)(nn.relu(nn.Conv(8, (1,))(x[..., None]).mean(-1)))


def test_one_checkpoint_around_the_whole_forward_is_no_effect_though_residuals_fall():
    model, x = _NoRepeats(), jnp.ones((16, 8))
    variables = model.init(jax.random.key(0), x)
    plan = lm.Plan(remat="full")
    with pytest.warns(UserWarning, match="lowers no peak memory"):
        configured = plan.configure_model(model)
        loss_fn = lm.classifier_loss_fn(configured)
        tx = plan.wrap_optimizer(optax.sgd(0.1), variables["params"])
        state = lm.TrainState.create(params=variables["params"], tx=tx, plan=plan)
        batch = {"image": x, "label": jnp.zeros(16, jnp.int32)}
        step = lm.make_train_step(loss_fn, tx, plan)
        (verdict,) = lm.verdicts(step, state, batch, plan=plan, tx=tx, loss_fn=loss_fn)
    before, after = (float(v) for v in re.findall(r"([\d.]+) -> ([\d.]+) MiB", verdict.evidence)[0])
    assert after < before  # the residuals saved between the passes fall ...
    assert not verdict.took_effect and "no peak falls" in verdict.evidence  # ... the peak not
