"""lowmem_jax.ops.conv: the loop-friendly conv must match lax.conv_general_dilated
(forward) and JAX's own autodiff of it (gradients), everywhere."""

from __future__ import annotations

import itertools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from lowmem_jax.ops import Conv, conv2d

DN = ("NHWC", "HWIO", "NHWC")


def _ref_conv(x, w, strides, padding):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=DN)


@jax.jit(static_argnames=("strides", "padding"))
def _both(x, w, dy, strides, padding):
    """(y, dx, dw) of the reference and of impl="loop_friendly", in one compile."""

    def run(f):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    ref = run(lambda x, w: _ref_conv(x, w, strides, padding))
    got = run(lambda x, w: conv2d(x, w, strides, padding, impl="loop_friendly"))
    return ref, got


def _close(got, ref, rtol=1e-5):
    """Elementwise, with atol relative to the array's scale (sums of many products)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = np.abs(ref).max() if ref.size else 1.0
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale)


def _check(b, h, w_, c_in, c_out, kh, kw, strides, padding, seed=0):
    # numpy data: eager jax.random would compile once per new shape (slow tests).
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, h, w_, c_in), np.float32)
    w = rng.standard_normal((kh, kw, c_in, c_out), np.float32)
    y_shape = jax.eval_shape(lambda: _ref_conv(x, w, strides, padding)).shape
    dy = rng.standard_normal(y_shape, np.float32)
    ref, got = _both(x, w, dy, strides, padding)
    for g, r in zip(got, ref, strict=True):
        _close(g, r)


GRID = list(
    itertools.product(
        [(1, 1), (3, 3), (2, 2), (5, 5)],  # kernel
        [(1, 1), (2, 2)],  # strides
        ["SAME", "VALID", ((2, 0), (0, 1)), ((-1, 3), (1, -1))],  # padding
        [(1, 7, 8), (3, 8, 9)],  # batch, H, W: odd and even sizes
    )
)


@pytest.mark.parametrize(("kernel", "strides", "padding", "bhw"), GRID)
def test_matches_lax_conv_and_its_autodiff(kernel, strides, padding, bhw):
    _check(*bhw, 3, 4, *kernel, strides, padding)  # C_in=3 != C_out=4


@pytest.mark.parametrize(
    ("kernel", "strides", "padding"),
    [
        ((3, 2), (2, 3), "SAME"),  # non-square everything
        ((1, 1), (3, 2), ((1, 2), (0, 0))),  # 1x1 with padding > kernel
        ((2, 3), (3, 3), ((-2, 4), (0, -1))),  # kernel smaller than stride, crops
        ((4, 4), (2, 1), ((5, 5), (2, 3))),  # padding beyond the kernel
        ((3, 3), (1, 1), ((-3, 4), (0, 0))),  # most of the input cropped away
    ],
)
def test_odd_corners(kernel, strides, padding):
    _check(2, 7, 6, 2, 5, *kernel, strides, padding)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    hw=st.tuples(st.integers(1, 10), st.integers(1, 10)),
    chans=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    k=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    pad=st.tuples(*[st.integers(-2, 4)] * 4),
)
def test_random_shapes(b, hw, chans, k, s, pad):
    padding = ((pad[0], pad[1]), (pad[2], pad[3]))
    sizes = [n + lo + hi for n, (lo, hi) in zip(hw, padding, strict=True)]
    if any(n < kk for n, kk in zip(sizes, k, strict=True)):  # no output: JAX rejects it too
        padding = "SAME"
    _check(b, *hw, *chans, *k, s, padding)


def test_empty_output_gives_zero_grads():
    x, w = jnp.ones((2, 3, 3, 2)), jnp.ones((3, 3, 2, 2))
    padding = ((0, -1), (0, 0))  # padded height 2 < kernel 3: zero output rows
    y, vjp = jax.vjp(lambda x, w: conv2d(x, w, padding=padding, impl="loop_friendly"), x, w)
    assert y.shape == (2, 0, 1, 2)
    dx, dw = vjp(y)
    assert not dx.any() and not dw.any()


# --- transformations -------------------------------------------------------------


def _stack_loss(impl):
    def loss(ws, x):
        for w in ws:
            x = jax.nn.relu(conv2d(x, w, impl=impl))
        return jnp.sum(x**2)

    return loss


@pytest.fixture
def data():
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (4, 6, 6, 3))
    ws = [0.3 * jax.random.normal(k[1], (3, 3, 3, 3)), 0.3 * jax.random.normal(k[2], (3, 3, 3, 3))]
    return x, ws


def test_grads_inside_scan(data):
    x, ws = data
    ref = jax.grad(_stack_loss("xla"), argnums=(0, 1))(ws, x)

    @jax.jit
    def microbatched(ws, x):  # sum of microbatch grads == full-batch grad of a sum loss
        def body(acc, xb):
            g = jax.grad(_stack_loss("loop_friendly"), argnums=(0, 1))(ws, xb)
            return jax.tree.map(jnp.add, acc, g[0]), g[1]

        zeros = jax.tree.map(jnp.zeros_like, ws)
        gw, gx = lax.scan(body, zeros, x.reshape(2, 2, *x.shape[1:]))
        return gw, gx.reshape(x.shape)

    @jax.jit
    def layers_scanned(ws, x):
        def loss(stacked, x):
            h, _ = lax.scan(
                lambda h, w: (jax.nn.relu(conv2d(h, w, impl="loop_friendly")), None), x, stacked
            )
            return jnp.sum(h**2)

        gw, gx = jax.grad(loss, argnums=(0, 1))(jnp.stack(ws), x)
        return list(gw), gx

    for got in (microbatched(ws, x), layers_scanned(ws, x)):
        jax.tree.map(lambda g, r: _close(g, r, rtol=1e-4), got, ref)


def test_grads_under_checkpoint_and_vmap(data):
    x, ws = data
    ref_loss, loss = _stack_loss("xla"), _stack_loss("loop_friendly")
    ref = jax.grad(ref_loss)(ws, x)
    got = jax.jit(jax.grad(jax.checkpoint(loss)))(ws, x)
    jax.tree.map(lambda g, r: _close(g, r, rtol=1e-4), got, ref)

    # Per-example grads: vmap over the batch (kernel grads batched along a new axis).
    per_ex = jax.vmap(jax.grad(loss), in_axes=(None, 0))(ws, x[:, None])
    per_ex_ref = jax.vmap(jax.grad(ref_loss), in_axes=(None, 0))(ws, x[:, None])
    jax.tree.map(lambda g, r: _close(g, r, rtol=1e-4), per_ex, per_ex_ref)
    jax.tree.map(lambda g, r: _close(g.sum(0), r, rtol=1e-4), per_ex, ref)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU layout property")
def test_backward_in_loop_uses_only_canonical_convs():
    """The performance property, checked structurally: inside a scan, every conv XLA
    compiles is NHWC/HWIO (b01f_01io->b01f); JAX's own rule yields e.g. f01b_i01o->01bf."""
    x, w = jnp.ones((4, 9, 9, 3)), jnp.ones((3, 3, 3, 5))
    w1 = jnp.ones((1, 1, 5, 2))

    def dim_labels(impl):
        def f(w, w1, x):
            def body(c, xb):
                def loss(w, w1, xb):
                    h = conv2d(xb, w, (2, 2), impl=impl)
                    return jnp.sum(conv2d(h, w1, (2, 2), "VALID", impl=impl) ** 2)

                return c, jax.grad(loss, argnums=(0, 1, 2))(w, w1, xb)

            return lax.scan(body, 0.0, x.reshape(2, 2, *x.shape[1:]))[1]

        hlo = jax.jit(f).lower(w, w1, x).compile().as_text()
        return set(re.findall(r"dim_labels=([^,\s]+)", hlo))

    assert dim_labels("loop_friendly") == {"b01f_01io->b01f"}
    assert dim_labels("xla") != {"b01f_01io->b01f"}  # the test can tell them apart


# --- dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    ("kernel", "strides"), [((3, 3), (1, 1)), ((3, 3), (2, 2)), ((1, 1), (2, 2))]
)
def test_low_precision(dtype, kernel, strides):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 8, 8, 8), np.float32)
    w = 0.2 * rng.standard_normal((*kernel, 8, 6)).astype(np.float32)
    dy = rng.standard_normal((3, 8 // strides[0], 8 // strides[1], 6), np.float32)

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: conv2d(x, w, strides, impl="loop_friendly"), x, w)
        return (y, *vjp(dy.astype(y.dtype)))

    ref = run(x, w, dy)
    got = run(x.astype(dtype), w.astype(dtype), dy)
    assert all(g.dtype == dtype for g in got)  # y, dx, dw
    for g, r in zip(got, ref, strict=True):
        _close(g.astype(jnp.float32), r, rtol=3e-2)


def test_mixed_dtypes_promote_and_grads_keep_primal_dtypes():
    x, w = jnp.ones((2, 5, 5, 3), jnp.bfloat16), jnp.ones((3, 3, 3, 4), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: conv2d(x, w, impl="loop_friendly"), x, w)
    dx, dw = vjp(jnp.ones_like(y))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)


# --- selector and validation -------------------------------------------------------


def test_auto_selects_by_backend():
    x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
    jaxpr = str(jax.make_jaxpr(lambda x, w: conv2d(x, w, impl="auto"))(x, w))
    assert ("custom_vjp_call" in jaxpr) == (jax.default_backend() == "cpu")
    jaxpr = str(jax.make_jaxpr(lambda x, w: conv2d(x, w, impl="xla"))(x, w))
    assert "custom_vjp_call" not in jaxpr


def test_bad_arguments_raise():
    x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
    with pytest.raises(ValueError, match="impl.*loop_friendly"):
        conv2d(x, w, impl="cudnn")
    for bad in ("same", "FULL", 1, [(1, 1)], [(1, 1, 1), (1, 1, 1)]):
        with pytest.raises(ValueError, match="padding"):
            conv2d(x, w, padding=bad)
    with pytest.raises(ValueError, match="impl"):
        Conv(2, (3, 3), impl="fast").init(jax.random.key(0), x)


# --- flax module -------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize(("strides", "padding"), [((1, 1), "SAME"), ((2, 2), "VALID")])
def test_conv_module_matches_flax(use_bias, strides, padding):
    x = jax.random.normal(jax.random.key(3), (2, 9, 9, 3))
    ours = Conv(5, (3, 3), strides, padding, use_bias=use_bias)
    theirs = nn.Conv(5, (3, 3), strides, padding, use_bias=use_bias)
    params = ours.init(jax.random.key(0), x)
    flax_params = theirs.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, flax_params)
    if use_bias:  # make the bias matter
        params = jax.tree.map(lambda p: p + 0.5, params)
    _close(ours.apply(params, x), theirs.apply(params, x))
    # Gradients through the module match flax's too.
    g = jax.grad(lambda p: jnp.sum(ours.apply(p, x) ** 2))(params)
    g_ref = jax.grad(lambda p: jnp.sum(theirs.apply(p, x) ** 2))(params)
    jax.tree.map(lambda a, b: _close(a, b, rtol=1e-4), g, g_ref)


def test_conv_module_init_dtype_and_batch_dims():
    x = jnp.ones((2, 3, 8, 8, 4))  # two leading batch dims
    m = Conv(6, (3, 3), dtype=jnp.bfloat16)
    params = m.init(jax.random.key(0), x)
    kernel = params["params"]["kernel"]
    assert kernel.dtype == jnp.float32 and kernel.shape == (3, 3, 4, 6)
    # He init (fan_out): std = sqrt(2 / (3 * 3 * 6)).
    std = float(jnp.std(m.init(jax.random.key(1), jnp.ones((1, 8, 8, 64)))["params"]["kernel"]))
    assert abs(std - np.sqrt(2 / 54)) < 0.1 * np.sqrt(2 / 54)
    y = m.apply(params, x)
    assert y.shape == (2, 3, 8, 8, 6) and y.dtype == jnp.bfloat16
