"""Property tests of sparse training (hypothesis, bounded): exact budgets, what is pruned and
regrown, slot resets, determinism, and masked == compressed storage."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import FAST_COMPILE, OPTIMIZERS, tiny_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.sparsity.layout import leaves_by_key
from lowmem_jax.techniques.sparsity.slots import find_mirrors

# Each example compiles a few-layer trajectory (~1-3 s on 2 shared cores): bounded.
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STEPS = 3


def _grads(params, step):
    rng = np.random.default_rng(1000 + step)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)


def dense_view(sp, stored, opt_state):
    """(weights, masks, [mirror slots]) as ``{key: flat dense array}`` whatever the storage."""
    keys = sp.layout.keys
    dense = leaves_by_key(sp.materialize(stored, opt_state), keys)
    weights = {k: v.reshape(-1) for k, v in dense.items()}
    slots = []
    for mirror in find_mirrors(opt_state.inner_state, stored):
        leaves = leaves_by_key(mirror, keys)
        if sp.config.compressed:
            leaves = {
                s.key: _scatter(s.size, opt_state.pattern[s.key], leaves[s.key])
                for s in sp.layout.leaves
            }
        slots.append({k: v.reshape(-1) for k, v in leaves.items()})
    if sp.config.compressed:
        masks = {
            s.key: _scatter(s.size, opt_state.pattern[s.key], jnp.ones((s.capacity,), bool))
            for s in sp.layout.leaves
        }
    else:
        masks = {k: v.reshape(-1) for k, v in opt_state.pattern.items()}
    return weights, masks, slots


def _scatter(size, indices, values):
    """Compressed ``[capacity]`` values at their flat ``indices`` (``size``: unused) -> dense."""
    return jnp.zeros((size,), values.dtype).at[indices].set(values, mode="drop")


@functools.lru_cache(maxsize=8)
def _runner(sp):
    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(params, grads):
        stored, state = sp.store(params)

        def body(carry, g):
            stored, state = carry
            updates, state = sp.update(g, state, stored)
            stored = optax.apply_updates(stored, updates)
            return (stored, state), dense_view(sp, stored, state)

        first = dense_view(sp, stored, state)
        (stored, state), rest = jax.lax.scan(body, (stored, state), grads)
        views = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)
        return views, state

    return run


def trajectory(sp, params, steps=STEPS):
    """Views before and after each of ``steps`` updates, and the final state; ONE compile."""
    run = _runner(sp)
    grads = [_grads(params, t) for t in range(steps)]
    views, state = run(params, jax.tree.map(lambda *x: jnp.stack(x), *grads))
    views = jax.tree.map(np.asarray, views)
    return [jax.tree.map(lambda x, t=t: x[t], views) for t in range(steps + 1)], state


configs = st.fixed_dictionaries(
    {
        "algorithm": st.sampled_from(["set", "rigl", "snfs", "dsr"]),
        "density": st.floats(0.05, 0.45),
        "distribution": st.sampled_from(["uniform", "erk"]),
        "seed": st.integers(0, 2**16),
        "compressed": st.booleans(),
    }
)


def _config(c, **kw):
    return sparsity.SparseConfig(
        update_period=1,
        drop_fraction=0.5,
        dsr_threshold=0.3,
        dsr_target_pruned=5,
        **c,
        **kw,
    )


@SETTINGS
@given(c=configs, opt=st.sampled_from(list(OPTIMIZERS)))
def test_every_update_keeps_the_budget_prunes_to_zero_and_regrows_at_zeros(c, opt):
    """Also: a second run with the same seeds is bitwise identical."""
    params = tiny_params(c["seed"] % 7)
    sp = sparsity.sparse_training(OPTIMIZERS[opt](), _config(c), params)
    views, state = trajectory(sp, params)
    assert int(state.count) == STEPS
    again, _ = trajectory(sparsity.sparse_training(sp.inner, _config(c), params), params)
    jax.tree.map(np.testing.assert_array_equal, again, views)  # identical seeds, identical runs
    budget = sp.layout.total_budget
    fixed = c["algorithm"] in ("set", "rigl")
    caps = {s.key: (s.capacity if c["compressed"] else s.size) for s in sp.layout.leaves}
    for (w0, m0, _), (w1, m1, slots1) in zip(views, views[1:], strict=False):
        assert sum(int(m.sum()) for m in m1.values()) == budget
        for s in sp.layout.leaves:
            k = s.key
            if fixed:
                assert int(m1[k].sum()) == s.budget
            assert int(m1[k].sum()) <= caps[k]
            assert not w1[k][~m1[k]].any(), "a weight outside the mask is non-zero"
            pruned = m0[k] & ~m1[k]
            regrown = m1[k] & ~m0[k]
            assert not w1[k][pruned].any()
            assert not w0[k][regrown].any(), "regrown where the weight was non-zero"
            assert not w1[k][regrown].any(), "regrown weights start at 0"
            for slot in slots1:
                assert not slot[k][regrown].any(), "optimizer slot of a regrown weight not reset"
                assert not slot[k][~m1[k]].any()


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    c=configs.filter(lambda c: not c["compressed"]),
    opt=st.sampled_from(["sgd_momentum", "adam"]),
)
def test_masked_and_compressed_storage_follow_the_same_trajectory(c, opt):
    params = tiny_params(2)
    # Capacity = layer size, so reallocation (SNFS, DSR) is capped identically in both.
    masked = sparsity.sparse_training(OPTIMIZERS[opt](), _config(c), params)
    factor = max(s.size / s.budget for s in masked.layout.leaves)
    c = {**c, "compressed": True}
    compressed = sparsity.sparse_training(
        OPTIMIZERS[opt](), _config(c, capacity_factor=factor), params
    )
    va, _ = trajectory(masked, params)
    vb, _ = trajectory(compressed, params)
    for (wa, ma, sa), (wb, mb, sb) in zip(va, vb, strict=True):
        for k in wa:
            np.testing.assert_array_equal(ma[k], mb[k])
            np.testing.assert_allclose(wa[k], wb[k], rtol=1e-6, atol=1e-7)
            for x, y in zip(sa, sb, strict=True):
                np.testing.assert_allclose(x[k], y[k], rtol=1e-6, atol=1e-7)
