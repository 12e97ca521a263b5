"""Compressed gradient communication on one device: refusals and sizes (the multi-device
behaviour: tests/grad_compression_cases.py, run by tests/test_sharding.py on 8 host devices)."""

import json
import pathlib

import jax
import optax
import pytest
from conftest import TinyMLP, classification_batch
from hypothesis import given
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.techniques.shard import compression as grad_compression


@given(n=st.integers(1, 10**6), devices=st.sampled_from([1, 2, 3, 4, 8]))
def test_the_padded_size_is_whole_groups_in_equal_chunks(n, devices):
    size = grad_compression.padded_size(n, devices)
    assert size >= n and size % (256 * devices) == 0 and size - n < 256 * devices


@given(n=st.integers(1, 10**7), fraction=st.floats(1e-6, 1.0))
def test_topk_sends_at_least_one_entry_and_at_most_all(n, fraction):
    k = grad_compression.topk_count(n, fraction)
    assert 1 <= k <= n and abs(k - fraction * n) <= max(0.5, 1 - fraction * n)


def test_a_raw_optax_optimizer_is_refused_naming_wrap_optimizer():
    params = TinyMLP().init(jax.random.key(0), classification_batch()["image"])["params"]
    plan = lm.Plan(shard="dp", devices=1, grad_compression="int8")
    with pytest.raises(ValueError, match=r"\(shard\).*plan.wrap_optimizer\(tx, params\)"):
        lm.TrainState.create(params=params, tx=optax.sgd(0.1), plan=plan)
    with pytest.raises(ValueError, match="grad_compression needs params in wrap_optimizer"):
        plan.wrap_optimizer(optax.sgd(0.1))
    wrapped = plan.wrap_optimizer(optax.sgd(0.1), params)
    state = lm.TrainState.create(params=params, tx=wrapped, plan=plan)
    count = sum(x.size for x in jax.tree.leaves(params))
    worker, server = state.opt_state.errors
    assert worker.shape == server.shape == (1, grad_compression.padded_size(count, 1))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"grad_compression": "int4"}, "Unknown grad_compression='int4'; allowed values"),
        ({"grad_compression": "int8"}, "needs shard=dp or zero1 \\(got 'none'\\)"),
        ({"grad_compression": "int8", "shard": "zero2"}, "which zero2 and zero3 partition"),
        ({"grad_compression": "powersgd", "shard": "dp", "powersgd_rank": 0},
         "powersgd_rank must be an int >= 1, got 0"),
        ({"grad_compression": "int8", "shard": "dp", "powersgd_rank": 2},
         "powersgd_rank=2 applies to grad_compression='powersgd' only"),
        ({"grad_compression": "topk", "shard": "dp", "topk_fraction": 0.0},
         "topk_fraction must be a number in \\(0, 1\\], got 0.0"),
        ({"grad_compression": "topk", "shard": "dp", "topk_fraction": "1%"},
         "topk_fraction must be a number in \\(0, 1\\], got '1%'"),
        ({"grad_compression": "int8", "shard": "dp", "topk_fraction": 0.1},
         "topk_fraction=0.1 applies to grad_compression='topk' only"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_when_the_plan_is_made(fields, match):
    with pytest.raises(ValueError, match=match):
        lm.Plan(**fields)


@pytest.mark.parametrize(
    "shape, rank, factored",
    [((5, 1535), 4, True), ((1535, 3), 4, False), ((3, 3, 64, 64), 4, True), ((64,), 1, False),
     ((3, 3, 16, 16), 16, False), ((2, 2), 1, False), ((3, 3), 1, True)],
)  # fmt: skip
def test_powersgd_factors_a_leaf_only_where_that_sends_fewer_numbers(shape, rank, factored):
    assert grad_compression.compressible(shape, rank) == factored
    # as a stack of blocks, the leading axis is the block's: one dimension fewer per matrix
    assert grad_compression.compressible((2, *shape), rank, stacked=True) == factored


def test_powersgd_orthonormalizes_a_stack_one_block_at_a_time():
    """A stacked leaf's ``P [blocks, rows, r]``: one LAPACK QR per block, not a batched call
    (two batched calls at once deadlock XLA:CPU's two-thread pool); each block's ``Q`` equals
    its own QR's."""
    import jax.numpy as jnp
    import numpy as np
    from conftest import assert_trees_close, batched_lapack_calls
    from jax.sharding import PartitionSpec

    mesh = jax.make_mesh((1,), ("data",))
    leaf = jax.random.normal(jax.random.key(0), (3, 40, 30))
    qs = [jax.random.normal(jax.random.key(1), (3, 30, 2))]

    def mean(leaf, error, qs):
        return grad_compression.powersgd_mean([leaf], error, qs, "data", stacked=[True])

    run = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=PartitionSpec(),
                                out_specs=PartitionSpec(), check_vma=False))  # fmt: skip
    error = jnp.zeros(leaf.size)
    lowered = run.lower(leaf, error, qs).as_text()
    assert "lapack_sgeqrf_ffi" in lowered and batched_lapack_calls(lowered) == []
    (got,), _, _ = run(leaf, error, qs)
    p = np.stack([np.linalg.qr(np.asarray(m @ q))[0] for m, q in zip(leaf, qs[0], strict=True)])
    want = np.einsum("lrk,lck->lrc", p, np.einsum("lrc,lrk->lck", np.asarray(leaf), p))
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_committed_accuracy_is_its_runs_and_the_docs_quote_it():
    """experiments/grad_compression_accuracy.py's table, recomputed from its kept runs, and the
    figures docs/distributed.md gives."""
    from experiments import grad_compression_accuracy as experiment
    from experiments import study

    out = pathlib.Path(experiment.OUT)
    result = json.loads((out / "accuracy.json").read_text())
    assert (out / "accuracy.md").read_text() == experiment.to_markdown(result)
    recomputed = study.summarize_cv(study.load_runs(str(out)))
    assert json.loads(json.dumps(recomputed)) == result["rows"]
    rows = {r["name"]: r for r in result["rows"]}
    assert {name: rows[name]["runs"] for name in rows} == {n: 15 for n in rows}
    docs = " ".join((out.parents[2] / "docs" / "distributed.md").read_text().split())
    for name in ("int8", "powersgd", "topk"):
        d = rows[name]["delta_vs_baseline"]
        low, high = (100 * x for x in d["ci95"])
        quoted = f"`{name}` {100 * d['mean']:+.2f} [{low:+.2f}, {high:+.2f}] points"
        assert quoted in docs, quoted
