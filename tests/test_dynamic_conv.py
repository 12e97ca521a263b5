import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILE, fast_jit

import lowmem_jax as lm
from lowmem_jax.models import DynamicConv, DynamicConvTransformer, LightConv
from lowmem_jax.workloads.losses import translation_loss_fn

V = 20  # small vocabularies (pad id 0)


def _tokens(rng, shape, vocab=V, low=3):
    return jnp.asarray(rng.integers(low, vocab, size=shape), jnp.int32)


@functools.cache
def _small(remat="none", dropout=0.0, kernels=(3, 5, 5)):
    return DynamicConvTransformer.small(
        V,
        V,
        remat=remat,
        dropout=dropout,
        weight_dropout=dropout,
        attention_dropout=dropout,
        encoder_kernel_sizes=kernels,
        decoder_kernel_sizes=kernels,
    )


@functools.cache
def _small_params(kernels=(3, 5, 5)):
    src = jnp.ones((1, 4), jnp.int32)
    return jax.jit(_small(kernels=kernels).init, compiler_options=FAST_COMPILE)(
        jax.random.key(0), src, src
    )["params"]


@functools.cache
def _apply(kernels=(3, 5, 5)):
    return jax.jit(
        lambda p, s, t: _small(kernels=kernels).apply({"params": p}, s, t),
        compiler_options=FAST_COMPILE,
    )


def test_iwslt_parameter_count_by_hand():
    model = DynamicConvTransformer.iwslt_de_en()
    src = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), src, src))
    count = sum(x.size for x in jax.tree.leaves(shapes["params"]))

    C, F, H, Vs, Vt = 512, 1024, 4, 8848, 6632
    enc_k, dec_k = [3, 7, 15, 31, 31, 31, 31], [3, 7, 15, 31, 31, 31]
    linear = C * C + C  # linear1 / linear2: Linear(C, C) with bias (no GLU)
    layer_norm = 2 * C
    ffn = (C * F + F) + (F * C + C)  # fc1, fc2
    attention = 4 * (C * C + C)  # q, k, v, out projections with bias

    def conv_block(k):
        return 2 * linear + C * H * k + layer_norm  # + weight_linear Linear(C -> H*K), no bias

    encoder_layers = sum(conv_block(k) + ffn + layer_norm for k in enc_k)
    decoder_layers = sum(conv_block(k) + attention + layer_norm + ffn + layer_norm for k in dec_k)
    embeddings = Vs * C + Vt * C + Vt * C  # src embed, tgt embed, untied output (no bias)
    assert conv_block(3) + ffn + layer_norm == 1_583_616
    assert encoder_layers == 11_347_456
    assert decoder_layers == 16_016_384
    assert embeddings == 11_321_344
    assert count == encoder_layers + decoder_layers + embeddings == 38_685_184

    tied = DynamicConvTransformer.iwslt_de_en(share_decoder_embeddings=True)
    shapes = jax.eval_shape(lambda: tied.init(jax.random.key(0), src, src))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count - Vt * C

    # Lightweight convs: one [H, K] kernel per layer instead of the [C, H*K] kernel predictor.
    light = DynamicConvTransformer.iwslt_de_en(conv_type="lightweight")
    shapes = jax.eval_shape(lambda: light.init(jax.random.key(0), src, src))
    taps = sum(enc_k) + sum(dec_k)
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count - C * H * taps + H * taps


def _naive_conv(x, w, padding_left):
    """``y[b, t, c] = sum_k w[b, t, c // R, k] x[b, t + k - P, c]``, one position at a time."""
    b, t, c = x.shape
    h, k = w.shape[-2:]
    r = c // h
    y = np.zeros((b, t, c))
    for bi in range(b):
        for ti in range(t):
            for ci in range(c):
                for ki in range(k):
                    src = ti + ki - padding_left
                    if 0 <= src < t:
                        y[bi, ti, ci] += w[bi, ti, ci // r, ki] * x[bi, src, ci]
    return y


@pytest.mark.parametrize("padding,padding_left", [("same", 2), ("causal", 4)])
def test_dynamic_conv_matches_naive_loop(padding, padding_left):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, 4)), jnp.float32)
    layer = DynamicConv(num_heads=2, kernel_size=5, padding=padding)
    params = layer.init(jax.random.key(0), x)["params"]
    y = layer.apply({"params": params}, x)
    # The kernel at (b, t) is softmax over K of x[b, t] @ W, head-major columns h * K + k.
    logits = np.asarray(x) @ np.asarray(params["weight_linear"]["kernel"])
    w = np.asarray(jax.nn.softmax(logits.reshape(2, 6, 2, 5), axis=-1))
    np.testing.assert_allclose(y, _naive_conv(np.asarray(x), w, padding_left), atol=1e-5)


def test_light_conv_matches_naive_loop():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32)
    layer = LightConv(num_heads=3, kernel_size=3, padding="causal")
    params = layer.init(jax.random.key(0), x)["params"]
    y = layer.apply({"params": params}, x)
    w = np.broadcast_to(np.asarray(jax.nn.softmax(params["weight"], axis=-1)), (2, 5, 3, 3))
    np.testing.assert_allclose(y, _naive_conv(np.asarray(x), w, 2), atol=1e-5)


def test_conv_validation_errors():
    x = jnp.zeros((1, 3, 6))
    with pytest.raises(ValueError, match="num_heads"):
        DynamicConv(num_heads=4, kernel_size=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="padding"):
        DynamicConv(num_heads=2, kernel_size=3, padding="valid").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="conv_type"):
        DynamicConvTransformer(V, V, conv_type="glu")
    with pytest.raises(ValueError, match="num_heads"):
        DynamicConvTransformer(V, V, embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="dropout"):
        DynamicConvTransformer(V, V, dropout=1.0)
    with pytest.raises(ValueError, match="remat"):
        DynamicConvTransformer(V, V, remat="sometimes")
    with pytest.raises(ValueError, match="label_smoothing"):
        translation_loss_fn(_small(), label_smoothing=1.0)


def test_decoder_is_causal():
    rng = np.random.default_rng(0)
    src, tgt = _tokens(rng, (2, 7)), _tokens(rng, (2, 9))
    params, apply = _small_params(), _apply()
    base = apply(params, src, tgt)
    assert base.shape == (2, 9, V) and base.dtype == jnp.float32
    for j in (3, 8):
        changed = apply(params, src, tgt.at[:, j].set(tgt[:, j] % (V - 3) + 3))
        np.testing.assert_allclose(changed[:, :j], base[:, :j], atol=1e-5)
        assert np.abs(changed[:, j] - base[:, j]).max() > 1e-4


def test_padding_invariance():
    rng = np.random.default_rng(1)
    src, tgt = _tokens(rng, (2, 7)), _tokens(rng, (2, 6))
    # Row 1 is shorter: its last two source tokens are padding already.
    src = src.at[1, 5:].set(0)
    params, apply = _small_params(), _apply()
    base = apply(params, src, tgt)
    longer_src = jnp.pad(src, ((0, 0), (0, 6)))
    np.testing.assert_allclose(apply(params, longer_src, tgt), base, atol=1e-5)
    longer_tgt = jnp.pad(tgt, ((0, 0), (0, 3)))
    np.testing.assert_allclose(apply(params, src, longer_tgt)[:, :6], base, atol=1e-5)
    # Padding is really masked: the padded row's outputs ignore what the padded tokens were.
    junk = src.at[1, 5:].set(7)
    assert np.abs(apply(params, junk, tgt)[1] - base[1]).max() > 1e-4


def _batch(rng, b=4, s=7, t=6):
    tgt = _tokens(rng, (b, t + 1))
    tgt_out = tgt[:, 1:].at[0, -2:].set(0)  # some target padding
    return {
        "src": _tokens(rng, (b, s)).at[1, -3:].set(0),
        "tgt_in": tgt[:, :-1],
        "tgt_out": tgt_out,
    }


def _remat_grads(remat):
    # One run of 3 identical layers per stack: every:2 has a segment and a remainder. Dropout is
    # off to keep the compile small; the train-step test runs dropout under remat.
    kernels = (3, 3, 3)
    params = _small_params(kernels)
    loss_fn = translation_loss_fn(_small(remat, kernels=kernels))
    batch = _batch(np.random.default_rng(2))
    grad_fn = jax.jit(
        lambda p: jax.grad(loss_fn, has_aux=True)(p, {}, batch, None),
        compiler_options={**lm.compiler_options(remat), **FAST_COMPILE},
    )
    return grad_fn(params)


@pytest.fixture(scope="module")
def baseline_grads():
    return _remat_grads("none")


@pytest.mark.parametrize("remat", ["full", "dots", "every:2"])
def test_remat_gradients_equal_no_remat(baseline_grads, remat):
    grads, (_, metrics) = _remat_grads(remat)
    base, (_, base_metrics) = baseline_grads
    np.testing.assert_allclose(metrics["loss"], base_metrics["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(base)) > 0


def test_translation_loss_ignores_padding_and_matches_optax():
    rng = np.random.default_rng(4)
    batch = _batch(rng)
    model, params = _small(), _small_params()
    loss_fn = translation_loss_fn(model, label_smoothing=0.1)
    loss, (_, metrics) = jax.jit(loss_fn, compiler_options=FAST_COMPILE)(params, {}, batch, None)
    logits = _apply()(params, batch["src"], batch["tgt_in"])
    labels = batch["tgt_out"]
    targets = optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1)
    per_token = optax.softmax_cross_entropy(logits, targets)
    mask = labels != 0
    assert float(metrics["count"]) == mask.sum() == 22
    np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], loss)
    acc = (logits.argmax(-1) == labels)[mask].mean()
    np.testing.assert_allclose(metrics["accuracy"], acc, rtol=1e-6)


def test_train_step_mixed_bf16_microbatched_full_remat():
    plan = lm.Plan(precision="mixed_bf16", microbatches=2, remat="full")
    model = plan.configure_model(_small(dropout=0.1, kernels=(3, 3)))
    assert model.dtype == jnp.bfloat16 and model.remat == "full"
    tx = optax.adam(1e-3)
    state = lm.TrainState.create(params=_small_params((3, 3)), tx=tx, plan=plan)
    step = fast_jit(lm.make_train_step(translation_loss_fn(model), tx, plan, jit=False), plan)
    batch = _batch(np.random.default_rng(5))
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and bool(metrics["grads_finite"])
    assert int(state.step) == 1
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


def test_layer_norm_matches_flax_and_keeps_bf16_residuals():
    x = jnp.asarray(np.random.default_rng(6).normal(2.0, 3.0, size=(3, 5, 16)), jnp.float32)
    p = {"params": {"scale": jnp.linspace(0.5, 1.5, 16), "bias": jnp.linspace(-1.0, 1.0, 16)}}

    def f(norm):
        return lambda x: (norm.apply(p, x) ** 3).sum()

    ours, ref = lm.models.dynamic_conv.LayerNorm(), nn.LayerNorm(epsilon=1e-5)
    np.testing.assert_allclose(ours.apply(p, x), ref.apply(p, x), atol=1e-5)
    np.testing.assert_allclose(jax.grad(f(ours))(x), jax.grad(f(ref))(x), atol=1e-4, rtol=1e-5)

    # Under mixed_bf16 no float32 activation of size [B, T, C] or larger is saved for the
    # backward pass (flax's LayerNorm and a float32 log-softmax would each save some).
    plan = lm.Plan(precision="mixed_bf16")
    model = plan.configure_model(_small())
    batch = _batch(np.random.default_rng(7))
    loss_fn = lm.cast_loss_fn(translation_loss_fn(model), plan.policy)
    saved = lm.analysis.memory.saved_activation_bytes(loss_fn, _small_params(), {}, batch, None)
    b, t = batch["tgt_in"].shape
    for nbytes, aval, _ in saved["largest"]:
        assert not (aval.startswith("float32") and nbytes >= 4 * b * t * 64), aval


def _step_logits(model, params, src, tgt):
    """Logits ``[B, T, V]`` from ``decode_step`` fed ``tgt [B, T]`` one token per call, and the
    final cache."""
    variables = {"params": params}

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(src, tgt):
        memory, src_mask = model.apply(variables, src, method=model.encode)
        cache = model.apply(variables, memory, src_mask, method=model.init_cache)

        def body(cache, token):
            logits, cache = model.apply(variables, token, cache, method=model.decode_step)
            return cache, logits

        cache, logits = jax.lax.scan(body, cache, tgt.T)
        return jnp.swapaxes(logits, 0, 1), cache

    return run(src, tgt)


# Decoder runs of 1 and 2 layers; K = 9 exceeds the target lengths (6 and 8), so the causal
# window still holds initial zeros at the last step.
_INC_KERNELS = (3, 9, 9)


@functools.cache
def _inc_model(conv_type="dynamic"):
    return DynamicConvTransformer.small(
        V, V, embed_dim=32, ffn_dim=64, dropout=0.0, conv_type=conv_type,
        encoder_kernel_sizes=(3,), decoder_kernel_sizes=_INC_KERNELS,
    )  # fmt: skip


@functools.cache
def _inc_params(conv_type="dynamic"):
    # Random values in the model's parameter shapes: any parameters must give equal results, and
    # eval_shape skips compiling `init` (most of these tests' time on a loaded CPU).
    src = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(_inc_model(conv_type).init, jax.random.key(0), src, src)["params"]
    rng = np.random.default_rng(11)

    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if "layer_norm" in name:  # as initialised: random ones make every step emit one token
            return jnp.full(x.shape, 1.0 if "scale" in name else 0.0, x.dtype)
        return jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.mark.parametrize("conv_type", ["dynamic", "lightweight"])
def test_incremental_decode_steps_equal_full_decode(conv_type):
    model, params = _inc_model(conv_type), _inc_params(conv_type)
    rng = np.random.default_rng(8)
    src = _tokens(rng, (3, 7)).at[1, 4:].set(0)  # a right-padded source
    tgt = _tokens(rng, (3, 6)).at[:, 0].set(1).at[2, 3].set(0)  # BOS first; a pad inside row 2
    full = jax.jit(model.apply, compiler_options=FAST_COMPILE)({"params": params}, src, tgt)
    inc, cache = _step_logits(model, params, src, tgt)
    assert inc.shape == full.shape == (3, 6, V) and inc.dtype == jnp.float32
    np.testing.assert_allclose(inc, full, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(full)).max() > 0.5  # not a trivially small comparison
    # One stacked cache per run of equal kernel sizes: [n, B, K - 1, C] windows, [n, B, S, C]
    # attention keys.
    shapes = [(layer["conv"].shape, layer["k"].shape) for layer in cache["layers"]]
    assert shapes == [((1, 3, 2, 32), (1, 3, 7, 32)), ((2, 3, 8, 32), (2, 3, 7, 32))]
    np.testing.assert_array_equal(cache["positions"], [6, 6, 5])  # the pad is not counted


def test_incremental_decode_cache_follows_bf16_compute_dtype():
    plan = lm.Plan(precision="mixed_bf16")
    model, params = plan.configure_model(_inc_model()), _inc_params()
    rng = np.random.default_rng(9)
    src, tgt = _tokens(rng, (2, 5)), _tokens(rng, (2, 4))
    inc, cache = _step_logits(model, params, src, tgt)
    floats = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    full = jax.jit(model.apply, compiler_options=FAST_COMPILE)({"params": params}, src, tgt)
    assert inc.dtype == full.dtype == jnp.bfloat16
    # bf16 roundings differ between a [B, T] and a [B, 1] computation; logits are O(1-10).
    np.testing.assert_allclose(inc.astype(jnp.float32), full.astype(jnp.float32), atol=0.15)


def test_greedy_decode_equals_full_prefix_loop():
    model, params = _inc_model(), _inc_params()
    # EOS (id 2) gets token 10's output row, slightly larger: rows that would pick 10 end.
    embed_out = params["embed_out"]
    params = {**params, "embed_out": embed_out.at[2].set(embed_out[10] * 1.01)}
    rng = np.random.default_rng(10)
    src = _tokens(rng, (6, 6)).at[2, 3:].set(0)
    max_len = 8
    greedy = jax.jit(
        functools.partial(lm.models.greedy_decode, model, max_len=max_len),
        compiler_options=FAST_COMPILE,
    )
    out = np.asarray(greedy(params, src))
    # The full decoder re-run over the growing prefix buffer, one token per iteration.
    variables = {"params": params}
    memory, src_mask = jax.jit(lambda s: model.apply(variables, s, method=model.encode))(src)
    decode = jax.jit(
        lambda t: model.apply(variables, t, memory, src_mask, method=model.decode),
        compiler_options=FAST_COMPILE,
    )
    prefix = np.zeros((6, max_len + 1), np.int32)
    prefix[:, 0] = 1  # BOS
    done = np.zeros(6, bool)
    for t in range(max_len):
        logits = np.array(decode(jnp.asarray(prefix[:, :-1])))[:, t]
        logits[:, 0] = -np.inf  # pad is never emitted
        prefix[:, t + 1] = np.where(done, 0, logits.argmax(-1))
        done |= prefix[:, t + 1] == 2
    np.testing.assert_array_equal(out, prefix[:, 1:])
    # A non-trivial comparison: rows differ, some end with EOS (then pads), some run to max_len.
    assert len({tuple(r) for r in out.tolist()}) > 3
    assert 0 < (out == 2).any(axis=1).sum() < len(out)
