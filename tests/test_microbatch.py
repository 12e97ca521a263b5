import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, BNNet, assert_trees_close, classification_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm


def _setup(model, batch_size, seed=0):
    batch = classification_batch(batch_size, seed=seed)
    variables = model.init(jax.random.key(seed), batch["image"], train=False)
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    no_scale = lm.techniques.loss_scale.NoOpLossScale()
    grad_fn = lm.scaled_grad_fn(lm.classifier_loss_fn(model), no_scale)
    return grad_fn, params, model_state, batch


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_mean_of_microbatch_grads_equals_full_batch(k):
    grad_fn, params, state, batch = _setup(MLP(), 32)
    full, _, full_metrics = jax.jit(grad_fn)(params, state, batch, None)
    acc, _, acc_metrics = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    assert_trees_close(acc, full)
    np.testing.assert_allclose(acc_metrics["loss"], full_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(acc_metrics["accuracy"], full_metrics["accuracy"], rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(
    microbatch_size=st.integers(1, 6),
    k=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_accumulation_equals_full_batch_property(microbatch_size, k, seed):
    grad_fn, params, state, batch = _setup(MLP(), microbatch_size * k, seed)
    # Jitted: two programs per example instead of one per operation and shape.
    full, _, _ = jax.jit(grad_fn)(params, state, batch, None)
    acc, _, _ = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    assert_trees_close(acc, full, rtol=1e-4, atol=1e-6)


def test_batchnorm_semantics_per_microbatch_stats_and_ordered_running_averages():
    k = 4
    grad_fn, params, state, batch = _setup(BNNet(momentum=0.8), 16)
    acc, acc_state, _ = jax.jit(lm.accumulate_gradients(grad_fn, k))(params, state, batch, None)
    grad_fn = jax.jit(grad_fn)  # the references: one program per batch shape

    # Reference: k ordinary steps over consecutive slices, threading the running averages.
    ref_grads, ref_state = [], state
    for i in range(k):
        micro = jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch)
        g, ref_state, _ = grad_fn(params, ref_state, micro, None)
        ref_grads.append(g)
    ref_mean = jax.tree.map(lambda *gs: sum(gs) / k, *ref_grads)
    assert_trees_close(acc, ref_mean)
    assert_trees_close(acc_state, ref_state)

    # ...which is not what one full-batch BatchNorm pass gives.
    full, full_state, _ = grad_fn(params, state, batch, None)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), acc_state, full_state)
    assert max(jax.tree.leaves(diff)) > 1e-4


def test_rng_differs_per_microbatch():
    seen = []

    def grad_fn(params, state, batch, rng):
        return params, state, {"r": jax.random.uniform(rng)}

    _, _, metrics = lm.accumulate_gradients(grad_fn, 2)(
        {"w": jnp.ones(())}, {}, {"x": jnp.ones((4, 1))}, jax.random.key(0)
    )
    seen.append(float(metrics["r"]))
    r0 = float(jax.random.uniform(jax.random.fold_in(jax.random.key(0), 0)))
    r1 = float(jax.random.uniform(jax.random.fold_in(jax.random.key(0), 1)))
    np.testing.assert_allclose(seen[0], (r0 + r1) / 2, rtol=1e-6)


def test_indivisible_batch_raises_before_tracing_the_model():
    grad_fn, params, state, batch = _setup(MLP(), 10)
    with pytest.raises(ValueError, match=r"batch size 10 .*num_microbatches=4"):
        lm.accumulate_gradients(grad_fn, 4)(params, state, batch, None)


@pytest.mark.parametrize("k", [0, -2, 2.0, True])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match="num_microbatches"):
        lm.accumulate_gradients(lambda *a: a, k)


def test_cpu_step_holds_no_parameter_copy_across_the_microbatch_loop():
    """XLA:CPU computes half-precision dots in float32; with its loop-invariant code motion the
    float32 copy of a weight is hoisted out of the accumulation loop and held across it. The
    plan's options (joined with remat's) leave it inside: less temp, the same update."""
    width = 512

    def loss_fn(params, model_state, batch, rng):
        out = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2), (model_state, {})

    params = {"w1": jnp.ones((width, width)) / width, "w2": jnp.ones((width, width)) / width}
    batch = {"x": jax.random.normal(jax.random.key(0), (32, width)), "y": jnp.zeros((32, width))}
    plan = lm.Plan(precision="mixed_fp16", microbatches=4)
    tx = optax.sgd(0.1)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    step = lm.make_train_step(loss_fn, tx, plan, jit=False)
    assert plan.compiler_options() == lm.techniques.microbatches.compiler_options(4, "cpu")
    assert (
        "while-loop-invariant-code-motion"
        in lm.techniques.microbatches.compiler_options(4, "cpu")["xla_disable_hlo_passes"]
    )
    assert lm.techniques.microbatches.compiler_options(1, "cpu") == {}
    joined = lm.Plan(microbatches=2, remat="full").compiler_options()["xla_disable_hlo_passes"]
    assert sorted(joined.split(",")) == ["cse_barrier_expander", "while-loop-invariant-code-motion"]
    temp, updated = {}, {}
    for name, options in (("plan", plan.compiler_options()), ("hoisted", None)):
        jitted = jax.jit(step, compiler_options=options)
        compiled = jitted.lower(state, batch).compile()
        temp[name] = lm.analysis.memory.xla_memory(compiled)["temp_bytes"]
        updated[name] = jitted(state, batch)[0].params
    assert temp["plan"] <= temp["hoisted"] - width * width * 4  # at least one float32 weight
    said = {v.technique: v for v in lm.verdicts(step, state, batch, plan=plan, tx=tx)}
    assert said["microbatches"].took_effect
    assert "no loop-invariant code motion" in said["microbatches"].evidence
    assert_trees_close(updated["plan"], updated["hoisted"], rtol=1e-6, atol=0)


# --- losses normalised by a count (issue 84) -----------------------------------------------------


def _masked_mean_loss(w, batch):
    per_position = ((batch["x"] @ w) - batch["y"]) ** 2  # [B, T]
    mask = batch["mask"].astype(jnp.float32)
    n = mask.sum()
    return (per_position * mask).sum() / jnp.maximum(n, 1.0), n


def _masked_mean_grad_fn(report_count: bool, takes_weight: bool = False):
    """A masked-mean loss over ``[B, T]`` positions (as masked LM and padded token losses are):
    the mean over the positions ``batch["mask"]`` marks, 0 where it marks none. With
    ``takes_weight``, ``grad_fn`` takes the keyword ``weight`` (the gradient of ``weight * loss``,
    as :func:`lowmem_jax.scaled_grad_fn`'s does)."""

    def grad_fn(params, model_state, batch, rng, weight=None):
        def weighted(w):
            value, n = _masked_mean_loss(w, batch)
            return value if weight is None else value * weight, (value, n)

        grads, (value, n) = jax.grad(weighted, has_aux=True)(params)
        metrics = {"loss": value, **({"count": n} if report_count else {})}
        return grads, model_state, metrics

    if takes_weight:
        return grad_fn
    return lambda params, model_state, batch, rng: grad_fn(params, model_state, batch, rng)


def _masked_batch(mask):
    rng = np.random.default_rng(int(mask.sum()))
    b, t = mask.shape
    return {"x": jnp.asarray(rng.normal(size=(b, t, 3)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(b, t)), jnp.float32),
            "mask": jnp.asarray(mask)}  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([2, 4, 8]),
    mask=st.lists(st.booleans(), min_size=8 * 6, max_size=8 * 6),
    takes_weight=st.booleans(),
)
def test_a_loss_reporting_its_count_accumulates_to_the_full_batch_gradient(k, mask, takes_weight):
    """Either rule: the weights at the backward's seed (a ``grad_fn`` taking ``weight``) or the
    sum carried rescaled (one that does not)."""
    mask = np.asarray(mask).reshape(8, 6)
    if not mask.any():
        mask[3, 2] = True  # a batch with no unit has no mean
    batch, w = _masked_batch(mask), jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    grad_fn = _masked_mean_grad_fn(report_count=True, takes_weight=takes_weight)
    full, _, full_metrics = jax.jit(grad_fn)(w, {}, batch, None)
    acc, _, metrics = jax.jit(lm.accumulate_gradients(grad_fn, k))(w, {}, batch, None)
    np.testing.assert_allclose(acc, full, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], rtol=1e-6)
    assert float(metrics["count"]) == mask.sum()  # the full batch's count, summed


def test_a_loss_without_its_count_is_the_mean_of_means_and_warned_about():
    mask = np.zeros((8, 6), bool)
    mask[:2] = True  # 12 positions in the first microbatch of 4, 0 in the others
    mask[4, 0] = True
    batch, w = _masked_batch(mask), jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    counted = jax.jit(lm.accumulate_gradients(_masked_mean_grad_fn(True), 4))(w, {}, batch, None)
    with pytest.warns(UserWarning, match=r"reports no metrics\['count'\]"):
        uncounted = lm.accumulate_gradients(_masked_mean_grad_fn(False), 4)(w, {}, batch, None)
    full, _, _ = _masked_mean_grad_fn(True)(w, {}, batch, None)
    np.testing.assert_allclose(counted[0], full, rtol=1e-6)
    assert not np.allclose(uncounted[0], full, rtol=1e-2)  # another objective


def _divisors_after_the_loop(fn, *args) -> list:
    """The divisors of the array (not scalar: the metrics') divisions that follow the microbatch
    loop in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    loop = max(i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive.name == "scan")
    return [eqn.invars[1] for eqn in jaxpr.eqns[loop + 1 :]
            if eqn.primitive.name == "div" and eqn.outvars[0].aval.shape != ()]  # fmt: skip


def test_counts_known_before_the_loop_weight_the_seed_and_the_sum_is_divided_by_k():
    """A count from the batch alone: the weights enter each microbatch's backward pass as a
    scalar, so no gradient-sized op after the loop divides by a traced total (the rescaled rule's
    final division, which cost 1.35% on an IWSLT step), and the gradient is the full batch's."""
    mask = np.zeros((8, 6), bool)
    mask[0] = True
    mask[5, :2] = True  # 6, 0, 2, 0 positions in 4 microbatches
    batch, w = _masked_batch(mask), jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    full, _, _ = _masked_mean_grad_fn(True)(w, {}, batch, None)
    seeded = lm.accumulate_gradients(_masked_mean_grad_fn(True, takes_weight=True), 4)
    rescaled = lm.accumulate_gradients(_masked_mean_grad_fn(True), 4)
    for fn in (seeded, rescaled):
        np.testing.assert_allclose(jax.jit(fn)(w, {}, batch, None)[0], full, rtol=1e-6)
    literal = jax.extend.core.Literal
    assert _divisors_after_the_loop(seeded, w, {}, batch, None)
    assert all(isinstance(v, literal) for v in _divisors_after_the_loop(seeded, w, {}, batch, None))
    assert not all(
        isinstance(v, literal) for v in _divisors_after_the_loop(rescaled, w, {}, batch, None)
    )


def test_a_count_drawn_from_rng_or_read_from_the_model_is_weighted_exactly():
    """The counts before the loop see each microbatch's ``fold_in(rng, i)``; a count computed from
    the parameters (here: the positions the model predicts above 0) is left to the loop's rule."""
    rng = np.random.default_rng(1)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 6, 3)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)}  # fmt: skip
    w = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)

    def make(where):
        def grad_fn(params, model_state, batch, rng, weight=1.0):
            def loss(p):
                mask = where(p, batch, rng).astype(jnp.float32)
                value = ((((batch["x"] @ p) - batch["y"]) ** 2) * mask).sum()
                return weight * value / jnp.maximum(mask.sum(), 1.0), (value, mask.sum())

            grads, (_, n) = jax.grad(loss, has_aux=True)(params)
            return grads, model_state, {"count": n}

        return grad_fn

    drawn = make(lambda p, b, key: jax.random.bernoulli(key, 0.3, b["y"].shape))
    predicted = make(lambda p, b, key: jax.lax.stop_gradient(b["x"] @ p) > 0)
    key = jax.random.key(3)
    for grad_fn in (drawn, predicted):
        acc, _, metrics = jax.jit(lm.accumulate_gradients(grad_fn, 4))(w, {}, batch, key)
        parts = [grad_fn(w, {}, jax.tree.map(lambda x, i=i: x[2 * i : 2 * i + 2], batch),
                         jax.random.fold_in(key, i)) for i in range(4)]  # fmt: skip
        counts = np.asarray([float(p[2]["count"]) for p in parts])
        expected = sum(n * g for n, (g, _, _) in zip(counts, parts, strict=True)) / counts.sum()
        assert len(set(counts)) > 1  # unequal: the mean of the parts' gradients would differ
        np.testing.assert_allclose(acc, expected, rtol=1e-5)  # summed in another order
        assert float(metrics["count"]) == counts.sum()


def test_a_count_from_shapes_alone_keeps_the_unweighted_rule():
    """classifier_loss_fn's count is the number of examples: equal in every microbatch, so the
    plain mean of the microbatch gradients is used, unchanged."""
    from lowmem_jax.techniques.microbatches.accumulate import _count_output

    grad_fn, params, state, batch = _setup(MLP(), 16)
    quarter = jax.tree.map(lambda x: x[:4], batch)
    traced = jax.make_jaxpr(grad_fn, return_shape=True)(params, state, quarter, None)
    assert _count_output(*traced) is None  # the count is a constant: no weighting
    acc, _, metrics = jax.jit(lm.accumulate_gradients(grad_fn, 4))(params, state, batch, None)
    micro = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * (i + 1)], batch) for i in range(4)]
    parts = [jax.jit(grad_fn)(params, state, m, None)[0] for m in micro]
    summed = jax.tree.map(lambda *g: sum(g[1:], g[0]) / 4, *parts)
    assert_trees_close(acc, summed, rtol=1e-6, atol=0)
    assert float(metrics["count"]) == 16.0


def test_the_translation_loss_microbatched_equals_its_full_batch():
    from conftest import TINY_TRANSLATION

    from lowmem_jax.models import DynamicConvTransformer

    model = DynamicConvTransformer.small(13, 13, **TINY_TRANSLATION)
    rng = np.random.default_rng(0)
    tgt = jnp.asarray(rng.integers(1, 13, (8, 7)), jnp.int32)
    lengths = [6, 1, 2, 6, 3, 5, 6, 2]  # unequal tokens per microbatch
    pad = jnp.arange(6)[None, :] >= jnp.asarray(lengths)[:, None]
    batch = {"src": jnp.asarray(rng.integers(1, 13, (8, 5)), jnp.int32),
             "tgt_in": tgt[:, :-1], "tgt_out": jnp.where(pad, 0, tgt[:, 1:])}  # fmt: skip
    params = model.init(jax.random.key(0), batch["src"], batch["tgt_in"], train=False)["params"]
    no_scale = lm.techniques.loss_scale.NoOpLossScale()
    loss_fn = lm.translation_loss_fn(model, label_smoothing=0.1, token_weighted=True)
    grad_fn = lm.scaled_grad_fn(loss_fn, no_scale)
    full, _, full_metrics = jax.jit(grad_fn)(params, {}, batch, None)
    acc, _, metrics = jax.jit(lm.accumulate_gradients(grad_fn, 4))(params, {}, batch, None)
    assert_trees_close(acc, full, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], full_metrics["accuracy"], rtol=1e-6)
    assert float(metrics["count"]) == sum(lengths)


def test_bert_masked_lm_microbatched_gives_the_full_batch_gradient():
    """Issue 84's case: transformers' Flax BERT masked LM (dropout off), normalised by the
    masked positions of the batch, 4 microbatches holding different numbers of them."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config only: nothing to fetch
    from transformers import BertConfig
    from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    model = FlaxBertForMaskedLMModule(config)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, (8, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((8, 16)) < 0.15)
    assert len({int(m.sum()) for m in np.split(np.asarray(mask), 4)}) > 1

    def apply(params, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        args = (ids, jnp.ones_like(ids), jnp.zeros_like(ids), positions, None)
        return model.apply({"params": params}, *args).logits

    def loss_fn(params, model_state, batch, rng):
        masked = jnp.where(batch["mask"], 0, batch["ids"])
        token = optax.softmax_cross_entropy_with_integer_labels(apply(params, masked), batch["ids"])
        weights = batch["mask"].astype(jnp.float32)
        count = weights.sum()
        loss = (token * weights).sum() / jnp.maximum(count, 1.0)
        return loss, (model_state, {"loss": loss, "count": count})

    batch = {"ids": ids, "mask": mask}
    one = jnp.ones((1, 16), jnp.int32)
    params = model.init(jax.random.key(0), ids[:1], one, 0 * one, jnp.arange(16)[None], None)
    params = params["params"]
    grad_fn = lm.scaled_grad_fn(loss_fn, lm.techniques.loss_scale.NoOpLossScale())
    full, _, _ = jax.jit(grad_fn)(params, {}, batch, None)
    acc, _, _ = jax.jit(lm.accumulate_gradients(grad_fn, 4))(params, {}, batch, None)
    a, b = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (acc, full))
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= 1e-6
