"""The LLaMA-style decoder (lowmem_jax.models.llama): checked against transformers'
FlaxLlamaForCausalLM (its weights copied: same parameter count, same logits and loss), causal,
its shapes' parameter counts, the registry's llama-* workloads and their plans."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.models.llama import PRESETS, Llama, parameter_count
from lowmem_jax.workloads import losses

TINY = PRESETS["tiny"]


def _tokens(seed: int, shape=(2, 16), vocab: int = TINY.vocab) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, vocab)


def _hf_model_and_params(ours: dict):
    """transformers' FlaxLlamaForCausalLMModule at the tiny shape, with ``ours`` (our tiny
    model's params) copied into its layout: layer ``i`` is slice ``i`` of our stacks."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule

    config = LlamaConfig(
        vocab_size=TINY.vocab,
        hidden_size=TINY.width,
        intermediate_size=TINY.ffn,
        num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        # transformers 4.46 slices its sin/cos table to max_position_embeddings columns:
        # at least the head size's, or the rotation is cut short.
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    stack = ours["stack"]["stack"]

    def layer(i):
        kernel = lambda name: {"kernel": stack[name]["kernel"][i]}  # noqa: E731
        return {
            "input_layernorm": {"weight": stack["input_norm"]["scale"][i]},
            "post_attention_layernorm": {"weight": stack["post_attention_norm"]["scale"][i]},
            "self_attn": {n: kernel(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "mlp": {n: kernel(n) for n in ("gate_proj", "up_proj", "down_proj")},
        }

    params = {
        "model": {
            "embed_tokens": {"embedding": ours["embed"]["embedding"]},
            "layers": {str(i): layer(i) for i in range(TINY.layers)},
            "norm": {"weight": ours["norm"]["scale"]},
        },
        "lm_head": {"kernel": ours["lm_head"]["kernel"]},
    }
    return FlaxLlamaForCausalLMModule(config), params


def test_the_tiny_shape_matches_transformers_flax_llama_with_its_weights_copied():
    """Same parameter count as transformers' own model at the shape, and with our weights in
    its layout the same logits (float32, within 1e-5) and the same next-token loss."""
    model = Llama.preset("tiny")
    tokens = _tokens(1)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    hf, hf_params = _hf_model_and_params(params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hf_init = hf.init(jax.random.PRNGKey(0), tokens, jnp.ones_like(tokens), positions)
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == sum(x.size for x in jax.tree.leaves(hf_init)) == parameter_count(TINY)
    assert jax.tree.structure(hf_params) == jax.tree.structure(hf_init["params"])

    ours = model.apply({"params": params}, tokens)
    theirs = hf.apply({"params": hf_params}, tokens, jnp.ones_like(tokens), positions).logits
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    targets = _tokens(2)
    loss = losses.lm_loss_fn(model)(params, {}, {"inputs": tokens, "targets": targets}, None)[0]
    reference = optax.softmax_cross_entropy_with_integer_labels(theirs, targets).mean()
    np.testing.assert_allclose(loss, reference, rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(cut=st.integers(1, 15), seed=st.integers(0, 2**16))
def test_a_position_sees_no_later_token(cut, seed):
    model = Llama.preset("tiny")
    tokens = _tokens(seed)
    params = model.init(jax.random.PRNGKey(0), tokens)
    changed = tokens.at[:, cut:].set((tokens[:, cut:] + 1) % TINY.vocab)
    before, after = model.apply(params, tokens), model.apply(params, changed)
    np.testing.assert_array_equal(before[:, :cut], after[:, :cut])
    assert not np.allclose(before[:, cut:], after[:, cut:])


@pytest.mark.parametrize("size", sorted(set(PRESETS) - {"tiny"}))
def test_each_named_shape_has_the_parameters_its_formula_counts(size):
    """From abstract shapes (nothing allocated): the 7B shape's 6,738,415,616 is LLaMA-2-7B's
    published count; TinyLlama's 1,100,048,384 its own."""
    model = Llama.preset(size)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    count = sum(x.size for x in jax.tree.leaves(shapes))
    assert count == parameter_count(PRESETS[size])
    published = {"7b": 6_738_415_616, "1b": 1_100_048_384}
    assert count == published.get(size, count)


def test_bad_shapes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="kv_heads must divide heads=4, got 3"):
        Llama(vocab_size=8, width=16, layers=1, heads=4, kv_heads=3, ffn=8)
    with pytest.raises(ValueError, match="heads must divide width=16 into an even head size"):
        Llama(vocab_size=8, width=16, layers=1, heads=16, kv_heads=16, ffn=8)
    with pytest.raises(ValueError, match=r"Unknown model='llama-3b'; allowed values: .*llama-SIZE"):
        lm.workloads.workload("llama-3b")


def test_remat_and_bf16_train_the_registered_decoder_as_the_plain_step():
    """``llama-tiny`` through ``build``: under remat the loss's gradients equal the plain
    step's (within 1e-5: the same arithmetic, recomputed and reordered), the step trains;
    under bf16 the compute is bf16 and the loss finite."""
    work = lm.workloads.workload("llama-tiny", 2, seq_len=16)
    batch = {"inputs": _tokens(3), "targets": _tokens(4)}
    grads = {}
    for remat in ("none", "full"):
        setup = lm.build(work, lm.Plan(remat=remat))
        state = setup.init_state(batch)
        grads[remat] = jax.grad(lambda p, s=setup: s.loss_fn(p, {}, batch, None)[0])(state.params)
        state, metrics = setup.step(state, batch)
        assert np.isfinite(metrics["loss"]) and metrics["count"] == 32
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads["full"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    setup = lm.build(work, lm.Plan(precision="bf16"))
    assert setup.model.dtype == jnp.bfloat16
    _, metrics = setup.step(setup.init_state(batch), batch)
    assert np.isfinite(metrics["loss"])


def test_grouped_causal_attention_equals_jax_own():
    """``causal_attention`` against ``jax.nn.dot_product_attention(is_causal=True)`` (jax's
    reference, which takes grouped heads too), 4 query heads on 2 key/value heads."""
    from lowmem_jax.models.llama import causal_attention

    q, k, v = (
        jax.random.normal(jax.random.PRNGKey(i), (2, 9, n, 8)) for i, n in enumerate([4, 2, 2])
    )
    np.testing.assert_allclose(
        causal_attention(q, k, v),
        jax.nn.dot_product_attention(q, k, v, is_causal=True),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_float16_step_compiles_on_cpu():
    """XLA:CPU has no float16 dot with a float32 result (what jax.nn.dot_product_attention
    asks for): the decoder casts to float32 itself, so mixed_fp16 (the planner's candidate)
    compiles and steps."""
    work = lm.workloads.workload("llama-tiny", 2, seq_len=16)
    setup = lm.build(work, lm.Plan(precision="mixed_fp16", loss_scale="dynamic"))
    batch = {"inputs": _tokens(3), "targets": _tokens(4)}
    _, metrics = setup.step(setup.init_state(batch), batch)
    assert np.isfinite(metrics["loss"])


def test_the_lm_loss_counts_every_token_and_refuses_a_target_outside_the_vocabulary():
    model = Llama.preset("tiny")
    tokens = _tokens(5)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    loss_fn = losses.lm_loss_fn(model)
    loss, (_, metrics) = loss_fn(params, {}, {"inputs": tokens, "targets": tokens}, None)
    assert metrics["count"] == tokens.size and np.isfinite(loss)
    bad = tokens.at[0, 3].set(TINY.vocab)
    assert np.isnan(loss_fn(params, {}, {"inputs": tokens, "targets": bad}, None)[0])
