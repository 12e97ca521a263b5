"""Plan(second_moment="factored"): each matrix's second moment stored as its row and column means
(Adafactor's statistics) around any optax transformation; optax's own Adam is the reference."""

from __future__ import annotations

import json
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.analysis import memory
from lowmem_jax.analysis.analytic import tree_bytes
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.codecs.quantization import Quantized
from lowmem_jax.codecs.state_format import is_quantized
from lowmem_jax.data import iterate_batches, load_digits
from lowmem_jax.techniques.second_moment import Factored, factored_leaves, factored_second_moment

SHAPES = st.sampled_from([(3, 5), (8, 2), (2, 3, 4, 6), (16, 9)])


def _adam_nu(state):
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu"))).nu


def _run(tx, grads, params):
    state = tx.init(params)
    updates = []
    for g in grads:
        u, state = tx.update(g, state, params)
        updates.append(u)
    return updates, state


@settings(max_examples=15, deadline=None)
@given(shape=SHAPES, steps=st.integers(1, 4), b2=st.sampled_from([0.5, 0.9, 0.999]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_the_stored_means_are_those_of_adam_s_second_moment(shape, steps, b2, seed):
    """Row and column means are linear, so the factored state's statistics follow optax Adam's
    dense second moment exactly, whatever its gradients."""
    rng = np.random.default_rng(seed)
    params = {"w": jnp.zeros(shape), "b": jnp.zeros(shape[-1:])}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
             for _ in range(steps)]  # fmt: skip
    adam = optax.adam(1e-2, b2=b2)
    _, dense = _run(adam, grads, params)
    _, stored = _run(factored_second_moment(adam), grads, params)
    nu, (factored,) = _adam_nu(dense), factored_leaves(stored)
    np.testing.assert_allclose(factored.rows, nu["w"].mean(-1, keepdims=True), rtol=2e-5)
    np.testing.assert_allclose(factored.cols, nu["w"].mean(-2, keepdims=True), rtol=2e-5)
    # the 1-D bias keeps its moment whole, equal to Adam's
    np.testing.assert_allclose(_adam_nu(stored.inner_state)["b"], nu["b"], rtol=1e-6)


@settings(max_examples=15, deadline=None)
@given(shape=SHAPES, scales=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_a_rank_one_second_moment_gives_adam_s_updates(shape, scales, seed):
    """Gradients ``s_t * a b^T`` keep the second moment rank one per matrix, where its
    factorization is exact: the updates are optax Adam's."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=shape[:-1] + (1,))
    b = rng.normal(size=shape[:-2] + (1, shape[-1]))
    params = {"w": jnp.zeros(shape)}
    grads = [{"w": jnp.asarray(s * a * b, jnp.float32)} for s in scales]
    adam = optax.adam(1e-2)
    want, _ = _run(adam, grads, params)
    got, _ = _run(factored_second_moment(adam), grads, params)
    for u, v in zip(got, want, strict=True):
        np.testing.assert_allclose(u["w"], v["w"], rtol=2e-4, atol=1e-7)


def test_the_state_stores_n_plus_m_floats_per_matrix_and_analyze_says_so():
    """The small transformer (Adam): every kernel's second moment (n x m, n + m < n m) becomes
    n + m float32 numbers, in the analytic count and in the verdict (nothing compiled)."""
    work = lm.workload("dynamicconv-small", 8)
    dense = lm.build(work, lm.Plan())
    factored = lm.build(work, lm.Plan(second_moment="factored"))
    saved = 0
    for x in jax.tree.leaves(dense.abstract_state().params):
        if x.ndim >= 2 and sum(x.shape[-2:]) < math.prod(x.shape[-2:]):
            rest = math.prod(x.shape[:-2])
            saved += 4 * rest * (math.prod(x.shape[-2:]) - sum(x.shape[-2:]))
    assert saved > 0

    def optimizer_bytes(setup):
        state = setup.abstract_state()
        return memory.analytic_breakdown(state=state, batch=work.batch, tx=setup.tx)[
            "optimizer_bytes"
        ]

    assert optimizer_bytes(dense) - optimizer_bytes(factored) == saved
    (verdict,) = factored.verdicts()
    found = factored_leaves(factored.abstract_state().opt_state)
    assert verdict.technique == "second_moment" and verdict.took_effect
    assert verdict.evidence.startswith(f"{len(found)} second moments stored factored")
    assert isinstance(found[0], Factored)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(10)(nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1))))


def test_with_an_int8_state_a_linen_model_learns():
    """Composed with a low-bit state on a Linen model through the public step: the first moment
    of the 64 x 128 kernel in int8, its second moment as float32 factors; the loss falls."""
    digits = load_digits(image_size=8)
    plan = lm.Plan(second_moment="factored", optimizer_state="int8")
    model = _MLP()
    params = model.init(jax.random.PRNGKey(0), digits["train"]["image"][:2])["params"]
    tx = plan.wrap_optimizer(optax.adam(1e-2), params)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    assert factored_leaves(state.opt_state) and any(
        isinstance(x, Quantized) for x in jax.tree.leaves(state.opt_state, is_leaf=is_quantized)
    )
    train_step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    losses = []
    for batch in iterate_batches(digits["train"], 64, seed=0):  # one epoch, 22 steps
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.5 * losses[0]


class _Wide(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def test_with_an_int8_state_the_factors_are_quantized_and_updated_with_their_parameter():
    """A 4,608 x 64 kernel: its second moment's rows (4,608 means) are large enough for int8.
    The verdicts read the quantized factors (before: an AttributeError in `lowmem analyze`),
    and the update decodes one group of leaves at a time, each factored moment a unit with its
    parameter (test_leafwise: the same numbers as all at once, in fewer bytes)."""
    batch = {"image": jnp.zeros((8, 4608)), "label": jnp.zeros((8,), jnp.int32)}
    work = lm.custom_workload(
        "wide", _Wide(), batch, loss=lm.classifier_loss_fn, optimizer=optax.adam(1e-3),
        init=lambda model, rng, b: model.init(rng, b["image"][:2]),
    )  # fmt: skip
    plan = lm.Plan(second_moment="factored", optimizer_state="int8")
    setup = lm.build(work, plan)
    verdicts = {v.technique: v for v in setup.verdicts()}
    found = factored_leaves(setup.abstract_state().opt_state)
    assert any(isinstance(f.rows, Quantized) for f in found)
    stored = sum(tree_bytes(f) for f in found)
    assert verdicts["second_moment"].evidence.endswith(
        f"as {stored / 2**20:.3f} MiB of row and column means"
    ), verdicts["second_moment"]
    assert "decoded and updated in 2 groups" in verdicts["optimizer_state"].evidence


def test_an_optimizer_without_a_second_moment_is_refused_in_one_line(capsys):
    """SGD (the WideResNet's recipe) keeps no second moment: nothing to factor."""
    with pytest.raises(ValueError, match="second_moment='factored': the optimizer's state has"):
        lm.build(lm.workload("wrn-10-1", 8), lm.Plan(second_moment="factored"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "--model", "wrn-10-1", "--batch-size", "8",
                  "--second-moment", "factored"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "SGD keeps none" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="does not combine with sparsity"):
        lm.Plan(second_moment="factored", sparsity=lm.sparsity.report_sparsity(0.7))
    with pytest.raises(ValueError, match="Unknown second_moment='adafactor'; allowed values"):
        lm.Plan(second_moment="adafactor")


def test_the_readme_quotes_the_committed_report_s_row():
    root = pathlib.Path(__file__).resolve().parents[1]
    report = json.loads(
        (root / "experiments/results/memory_report_dynamicconv/report.json").read_text()
    )
    rows = {r["name"]: r for r in report["configs"]}
    base, factored = rows["baseline"], rows["second moment factored"]
    mib = 2.0**20
    quoted = (
        f"optimizer state {base['analytic']['optimizer_bytes'] / mib:.1f} -> "
        f"{factored['analytic']['optimizer_bytes'] / mib:.1f} MiB (analytic), total "
        f"{base['xla']['total_bytes'] / mib:.1f} -> {factored['xla']['total_bytes'] / mib:.1f} MiB"
    )
    assert quoted in (root / "README.md").read_text()


def test_a_published_model_s_adam_state_is_factored_and_lion_s_refused():
    """Hugging Face transformers' Flax GPT-2 (the conformance table's), through the public API:
    under Adam its kernels' second moments are stored factored and the verdict says so (traced,
    nothing compiled); Lion keeps a first moment only, so the plan is refused in one line."""
    from experiments import conformance_models

    make_workload, _, _ = conformance_models.MODELS["gpt2"]
    plan = lm.Plan(second_moment="factored")
    subject = conformance_models.subject(make_workload(), plan)
    tx = plan.wrap_optimizer(optax.adam(1e-3), subject.params)
    state = lm.TrainState.create(params=subject.params, tx=tx, plan=plan)
    step = lm.make_train_step(subject.loss_fn, tx, plan)
    found = {v.technique: v for v in lm.verdicts(step, state, subject.batch, plan=plan, tx=tx)}
    assert found["second_moment"].took_effect, found
    dense = optax.adam(1e-3).init(subject.params)
    assert tree_bytes(state.opt_state) < 0.75 * tree_bytes(dense)
    with pytest.raises(ValueError, match="no second moment"):
        plan.wrap_optimizer(optax.lion(1e-4), subject.params)
