"""The LM loss over chunks of tokens (``Plan.loss_chunk``, issue 81): equal to the whole-logits
cross-entropy and its gradient, the logits never whole in the compiled step, and refused in one
line where the model cannot take part."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.models import Llama, WideResNet
from lowmem_jax.techniques.loss_chunk import chunked_token_losses
from lowmem_jax.workloads.losses import lm_loss_fn


def _whole(hidden, kernel, labels):
    logits = jnp.einsum("...c,cv->...v", hidden, kernel)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 40), chunk=st.integers(1, 48), vocab=st.integers(2, 30), seed=st.integers(0, 9)
)
def test_chunked_cross_entropy_equals_optax_on_the_whole_logits_with_its_gradients(
    n, chunk, vocab, seed
):
    keys = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(keys[0], (n, 8))
    kernel = jax.random.normal(keys[1], (8, vocab))
    labels = jax.random.randint(keys[2], (n,), 0, vocab)
    nll, correct = chunked_token_losses(hidden, kernel, labels, chunk)
    np.testing.assert_allclose(nll, _whole(hidden, kernel, labels), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(correct, (hidden @ kernel).argmax(-1) == labels)
    weights = jnp.linspace(0.5, 1.5, n)  # a cotangent that is not uniform
    ours = jax.grad(lambda h, w: (chunked_token_losses(h, w, labels, chunk)[0] * weights).sum(),
                    argnums=(0, 1))(hidden, kernel)  # fmt: skip
    ref = jax.grad(lambda h, w: (_whole(h, w, labels) * weights).sum(), argnums=(0, 1))(
        hidden, kernel
    )
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_backward_pass_holds_one_chunk_of_logits_not_all_of_them():
    """XLA:CPU compiled, loss and gradient: 2,048 tokens x 4,096 classes (32 MiB of float32
    logits) against chunks of 128."""
    hidden = jax.ShapeDtypeStruct((2048, 64), jnp.float32)
    kernel = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    labels = jax.ShapeDtypeStruct((2048,), jnp.int32)

    def temp(loss):
        grad = jax.jit(jax.grad(lambda h, w, y: loss(h, w, y).mean(), argnums=(0, 1)))
        return grad.lower(hidden, kernel, labels).compile().memory_analysis().temp_size_in_bytes

    whole = temp(_whole)
    chunked = temp(lambda h, w, y: chunked_token_losses(h, w, y, 128)[0])
    logits = 2048 * 4096 * 4
    assert whole >= logits
    assert chunked < logits / 4


def test_bad_chunks_and_shapes_are_refused():
    h, w, y = jnp.zeros((4, 3)), jnp.zeros((3, 5)), jnp.zeros((4,), jnp.int32)
    for chunk in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk must be an int >= 1"):
            chunked_token_losses(h, w, y, chunk)
    with pytest.raises(ValueError, match="do not match"):
        chunked_token_losses(h, w.T, y, 2)


def _llama_batch(b=2, t=24, vocab=256):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, t + 1)), jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_llama_trains_the_same_with_its_logits_in_chunks():
    """Three AdamW steps of the tiny Llama, whole logits against chunks of 10 tokens (48 per
    batch: four chunks and a padded one): losses and parameters within float32 rounding."""
    batch = _llama_batch()
    model = Llama.preset("tiny")
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    runs = {}
    for chunk in (0, 10):
        plan = lm.Plan(loss_chunk=chunk)
        configured = plan.configure_model(model)
        assert configured.loss_chunk == chunk
        tx = plan.wrap_optimizer(optax.adamw(1e-2), params)
        state = lm.TrainState.create(params=params, tx=tx, plan=plan)
        step = lm.make_train_step(lm_loss_fn(configured), tx, plan, donate=False)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[chunk] = (losses, state.params, float(metrics["accuracy"]))
    np.testing.assert_allclose(runs[10][0], runs[0][0], rtol=1e-5)
    # Adam divides by sqrt(v): float32 rounding of tiny gradients moves a parameter by <= ~lr 1e-3
    for a, b in zip(jax.tree.leaves(runs[10][1]), jax.tree.leaves(runs[0][1]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert abs(runs[10][2] - runs[0][2]) <= 1 / 48  # argmax may flip one near-tie token
    grads = [jax.grad(lambda p, m=m: lm_loss_fn(m)(p, {}, batch, None)[0])(params)
             for m in (model, model.clone(loss_chunk=10))]  # fmt: skip
    flat = [jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in grads]
    assert float(jnp.linalg.norm(flat[1] - flat[0]) / jnp.linalg.norm(flat[0])) < 1e-6


def test_analyze_says_the_chunked_loss_took_effect_and_its_bytes_fall():
    """The registry's LM workload on a Llama whose logits dominate (vocabulary 4,096, width 32,
    256 tokens: 4 MiB of float32 logits), analysed from shapes: XLA:CPU's temp falls by at least
    the logits' bytes."""
    base = lm.workload("llama-tiny", batch_size=2, seq_len=128)
    model = Llama(vocab_size=4096, width=32, layers=1, heads=2, kv_heads=1, ffn=64)
    work = dataclasses.replace(base, model=model)
    temp = {}
    for chunk in (0, 32):
        setup = lm.build(work, lm.Plan(loss_chunk=chunk))
        temp[chunk] = setup.analyze().xla["temp_bytes"]
    (verdict,) = [v for v in setup.verdicts() if v.technique == "loss_chunk"]
    assert verdict.took_effect, verdict.evidence
    assert "[32, 4096]" in verdict.evidence
    assert temp[0] - temp[32] >= 256 * 4096 * 4
    whole = lm.build(work, lm.Plan(loss_chunk=256))
    (verdict,) = [v for v in whole.verdicts() if v.technique == "loss_chunk"]
    assert not verdict.took_effect and "fit one chunk" in verdict.evidence


def test_a_model_without_a_chunked_head_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="WideResNet computes its loss from whole logits"):
        lm.Plan(loss_chunk=16).configure_model(WideResNet(depth=10, width=1, num_classes=10))
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config only: nothing to fetch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    gpt2 = FlaxGPT2LMHeadModule(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="FlaxGPT2LMHeadModule computes its loss from whole"):
        lm.Plan(loss_chunk=16).configure_model(gpt2)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk must be an int >= 0"):
            lm.Plan(loss_chunk=bad)
    for value, match in (("16", "loss_chunk=16: WideResNet"), ("-3", "loss_chunk")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["analyze", "--model", "wrn-10-1", "--batch-size", "4", "--loss-chunk", value])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and match in err[0], err


def test_the_docs_quote_the_committed_benchmark():
    """docs/language_models.md's table and the README's row are benchmarks/loss_chunk.py's
    committed figures, and its markdown is made from its JSON."""
    import json
    import pathlib
    import re

    from conftest import load_benchmark

    root = pathlib.Path(__file__).resolve().parents[1]
    result = json.loads((root / "benchmarks/results/loss_chunk_cpu.json").read_text())
    bench = load_benchmark("loss_chunk")
    assert bench.to_markdown(result) == (root / "benchmarks/results/loss_chunk_cpu.md").read_text()
    docs = (root / "docs/language_models.md").read_text()
    readme = (root / "README.md").read_text()
    for row in result["rows"]:
        a, b = (f"{row[k]['xla']['total_bytes'] / 2**30:.3f}" for k in ("as_quoted", "chunked"))
        assert re.search(rf"\| {re.escape(a)}( GiB)? \| {re.escape(b)} \|", docs), row["case"]
        if row["case"] in ("1b-any", "7b-s2048-planner"):
            assert f"{a} -> {b}" in readme, row["case"]
    assert f"commit {result['commit']}" in docs
