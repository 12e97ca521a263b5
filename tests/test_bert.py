"""BERT's masked LM (lowmem_jax.models.bert) against transformers' FlaxBertForMaskedLM with its
weights copied, its named shapes' parameter counts, and the bert-* workloads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from lowmem_jax.models.bert import BERT_PRESETS, Bert, bert_parameter_count
from lowmem_jax.workloads import losses

TINY = BERT_PRESETS["tiny"]


def _hf(ours: dict):
    """transformers' FlaxBertForMaskedLMModule at the tiny shape, ``ours`` in its layout."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule

    config = BertConfig(
        vocab_size=TINY.vocab,
        hidden_size=TINY.width,
        num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads,
        intermediate_size=TINY.ffn,
        max_position_embeddings=TINY.max_positions,
    )
    stack = ours["stack"]["stack"]
    ln = lambda p: {"LayerNorm": p}  # noqa: E731

    def layer(i):
        at = jax.tree.map(lambda x: x[i], stack)
        return {
            "attention": {
                "self": {n: at[n] for n in ("query", "key", "value")},
                "output": {"dense": at["attention_out"], **ln(at["attention_norm"])},
            },
            "intermediate": {"dense": at["intermediate"]},
            "output": {"dense": at["output"], **ln(at["output_norm"])},
        }

    params = {
        "bert": {
            "embeddings": {
                "word_embeddings": {"embedding": ours["word"]},
                "position_embeddings": {"embedding": ours["position"]},
                "token_type_embeddings": {"embedding": ours["token_type"]},
                **ln(ours["embeddings_norm"]),
            },
            "encoder": {"layer": {str(i): layer(i) for i in range(TINY.layers)}},
        },
        "cls": {
            "predictions": {
                "bias": ours["mlm"]["bias"],
                "transform": {"dense": ours["mlm"]["transform"], **ln(ours["mlm"]["norm"])},
            }
        },
    }
    return FlaxBertForMaskedLMModule(config), params


def test_the_tiny_shape_matches_transformers_flax_bert_with_its_weights_copied():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, TINY.vocab)
    model = Bert.preset("tiny")
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    hf, hf_params = _hf(params)
    args = (tokens, jnp.ones_like(tokens), jnp.zeros_like(tokens),
            jnp.broadcast_to(jnp.arange(16), tokens.shape), None)  # fmt: skip
    hf_init = hf.init(jax.random.PRNGKey(0), *args)["params"]
    assert jax.tree.structure(hf_params) == jax.tree.structure(hf_init)
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == sum(x.size for x in jax.tree.leaves(hf_init)) == bert_parameter_count(TINY)
    theirs = hf.apply({"params": hf_params}, *args).logits
    np.testing.assert_allclose(model.apply({"params": params}, tokens), theirs, atol=2e-5)


@pytest.mark.parametrize("size, published", [("base", 109_514_298), ("large", 335_174_458)])
def test_bert_base_and_large_have_their_published_parameter_counts(size, published):
    """From abstract shapes: transformers' BertForMaskedLM (uncased vocabulary) counts."""
    shapes = jax.eval_shape(Bert.preset(size).init, jax.random.PRNGKey(0),
                            jnp.zeros((1, 8), jnp.int32))  # fmt: skip
    assert sum(x.size for x in jax.tree.leaves(shapes)) == published
    assert bert_parameter_count(BERT_PRESETS[size]) == published


def test_the_masked_loss_reads_the_weighted_positions_only():
    model = Bert.preset("tiny", dropout=0.0)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, TINY.vocab)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    weights = jnp.zeros(tokens.shape).at[:, ::5].set(1.0)
    batch = {"inputs": tokens, "targets": tokens, "weights": weights}
    loss, (_, metrics) = losses.mlm_loss_fn(model)(params, {}, batch, None)
    logp = jax.nn.log_softmax(model.apply({"params": params}, tokens))
    nll = -jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, nll[:, ::5].mean(), rtol=1e-6)
    assert metrics["count"] == weights.sum()


def test_the_registered_bert_trains_with_dropout_and_microbatches():
    """Four microbatches with unequal masked counts give the full batch's loss (count
    weighting), and a dropout step trains."""
    work = lm.workloads.workload("bert-tiny", 4, seq_len=16, dropout=0.0)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 16), 0, TINY.vocab)
    weights = jnp.zeros(tokens.shape).at[0, :9].set(1.0).at[1:, 3].set(1.0)
    batch = {"inputs": tokens, "targets": tokens, "weights": weights}
    plain, split = lm.build(work, lm.Plan()), lm.build(work, lm.Plan(microbatches=4))
    _, whole = plain.step(plain.init_state(batch), batch)  # the step donates its state
    _, split = split.step(plain.init_state(batch), batch)
    np.testing.assert_allclose(split["loss"], whole["loss"], rtol=1e-5)
    dropout = lm.build(lm.workloads.workload("bert-tiny", 4, seq_len=16), lm.Plan())
    _, metrics = dropout.step(dropout.init_state(batch), batch)
    assert np.isfinite(metrics["loss"])
