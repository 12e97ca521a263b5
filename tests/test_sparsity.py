"""Sparse training (lowmem_jax.sparsity): config, layout, selection, the optax wrapper."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    FAST_COMPILE,
    OPTIMIZERS,
    assert_trees_close_to_scale,
    tiny_params,
    unnamed_stacks,
)

import lowmem_jax as lm
from lowmem_jax.core.base import OptaxOptimizer
from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.sparsity import algorithms, slots
from lowmem_jax.techniques.sparsity import masks as masks_lib
from lowmem_jax.techniques.sparsity.algorithms import Rewiring
from lowmem_jax.techniques.sparsity.layout import layer_densities, leaves_by_key, make_layout

# --- configuration and layout ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": -0.1}, "density"),
        ({"algorithm": "lottery"}, "algorithm"),
        ({"distribution": "normal"}, "distribution"),
        ({"init": "grasp"}, "init"),
        ({"update_period": 0}, "update_period"),
        ({"update_period": ((5, 100),)}, "update_period"),
        ({"update_period": ((0, 100), (50, 0))}, "update_period"),
        ({"drop_fraction": 1.5}, "drop_fraction"),
        ({"start_step": 10, "end_step": 5}, "end_step"),
        ({"capacity_factor": 0.5}, "capacity_factor"),
        ({"anneal": "linear"}, "anneal"),
    ],
)
def test_config_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsity.SparseConfig(**kwargs)


def test_layer_densities_reject_bad_input():
    with pytest.raises(ValueError, match="distribution"):
        layer_densities([(3, 3)], 0.5, "gaussian")
    with pytest.raises(ValueError, match="density"):
        layer_densities([(3, 3)], 0.0, "erk")


def test_default_selection_and_budgets_on_wrn():
    model = lm.models.WideResNet(depth=22, width=1)  # stacks of 2 blocks
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)), train=False)
    )["params"]
    for dist in ("uniform", "erk"):
        cfg = sparsity.SparseConfig(density=0.1, distribution=dist)
        layout = make_layout(params, cfg)
        keys = layout.keys
        assert "stem/kernel" in keys and "group0_first/stack/conv1/kernel" in keys
        assert layout.by_key()["group1_rest/stack/conv1/kernel"].shape == (2, 3, 3, 32, 32)
        assert not any("classifier" in k or "bn" in k or "bias" in k for k in keys)
        total = sum(s.size for s in layout.leaves)
        assert abs(layout.total_budget - 0.1 * total) <= len(keys)
        assert all(s.capacity == s.budget for s in layout.leaves)
    erk = make_layout(params, sparsity.SparseConfig(distribution="erk")).by_key()
    # ERK gives the small stem a higher density than a wide 3x3 conv.
    stem, conv = erk["stem/kernel"], erk["group2_first/stack/conv2/kernel"]
    assert stem.budget / stem.size > conv.budget / conv.size


def test_erk_densities_are_capped_at_one_and_keep_the_mean():
    shapes = [(3, 3, 3, 16), (3, 3, 64, 64), (64, 10)]
    d = layer_densities(shapes, 0.5, "erk")
    sizes = [np.prod(s) for s in shapes]
    assert max(d) <= 1.0
    assert np.isclose(np.dot(d, sizes), 0.5 * sum(sizes))


def test_allocate_is_exact_and_respects_room():
    total = jnp.int32(100)
    room = jnp.array([5, 200, 40, 0], jnp.int32)
    got = masks_lib.allocate(total, jnp.array([10.0, 1.0, 3.0, 7.0]), room)
    assert int(got.sum()) == 100 and bool((got <= room).all()) and int(got[3]) == 0
    got = masks_lib.allocate(jnp.int32(7), jnp.zeros(3), jnp.array([3, 3, 3]))
    assert int(got.sum()) == 7


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mirror_slots_are_found_structurally(name):
    params = tiny_params()
    state = OPTIMIZERS[name]().init(params)
    mirrors = slots.find_mirrors(state, params)
    assert len(mirrors) == (2 if name.startswith("adam") else 1)
    zeroed = slots.map_mirrors(lambda m: jax.tree.map(jnp.ones_like, m), state, params)
    assert all(
        float(x.min()) == 1.0
        for m in slots.find_mirrors(zeroed, params)
        for x in jax.tree.leaves(m)
    )


def _layers(*arrays):
    return [jnp.asarray(a, jnp.float32) for a in arrays]


def test_rigl_grows_where_the_gradient_is_largest_and_drops_the_smallest():
    w = _layers([0.0, 5.0, 0.1, 0.0, 3.0, 0.0, 0.0, 0.0])
    m = [w[0] != 0]
    g = _layers([9.0, 0.0, 0.0, 1.0, 0.0, 7.0, 0.0, 2.0])
    how = Rewiring("rigl", rng=jax.random.key(0), fraction=0.67, grads=g)
    out = algorithms.rewire(how, weights=w, masks=m, caps=(8,))
    # floor(0.67 * 3) = 2 dropped (|w| = 0.1 and 3.0), 2 grown (g = 9 and 7 among the zeros).
    np.testing.assert_array_equal(out.survivors[0], [0, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out.masks[0], [1, 1, 0, 0, 0, 1, 0, 0])


@pytest.mark.parametrize(
    "regrow_pool, expected",
    [("not_kept", [0, 1, 1, 0, 0, 1, 0, 0]), ("zeros_first", [1, 1, 0, 0, 0, 1, 0, 0])],
)
def test_rigl_as_published_may_regrow_a_connection_it_just_dropped(regrow_pool, expected):
    """Evci et al.'s Algorithm 1 grows by |g| among every position the drop did not keep; the
    zeros_first option (a departure) takes old zeros first. Both storages agree."""
    w = _layers([0.0, 5.0, 0.1, 0.0, 3.0, 0.0, 0.0, 0.0])
    g = _layers([1.0, 0.0, 9.0, 0.0, 0.0, 7.0, 0.0, 0.0])  # largest at position 2, dropped now
    how = Rewiring("rigl", jax.random.key(0), 0.67, grads=g, regrow_pool=regrow_pool)
    out = algorithms.rewire(how, weights=w, masks=[w[0] != 0], caps=(8,))
    np.testing.assert_array_equal(out.survivors[0], [0, 1, 0, 0, 0, 0, 0, 0])  # 0.1, 3.0 dropped
    np.testing.assert_array_equal(out.masks[0], expected)
    idx = jnp.asarray([4, 1, 2], jnp.int32)  # compressed: slots in scrambled order
    comp = algorithms.rewire_compressed(how, values=[w[0][idx]], indices=[idx], sizes=(8,))
    regrown = np.flatnonzero(np.asarray(out.masks[0]) & ~np.asarray(out.survivors[0]))
    np.testing.assert_array_equal(np.asarray(comp.grown[0])[:2], regrown)


def test_regrow_pool_defaults_to_the_published_rule_and_is_validated():
    assert sparsity.SparseConfig(algorithm="rigl").resolved_regrow_pool == "not_kept"
    assert sparsity.SparseConfig(algorithm="set").resolved_regrow_pool == "not_kept"
    assert sparsity.SparseConfig(algorithm="snfs").resolved_regrow_pool == "not_kept"
    assert sparsity.SparseConfig(algorithm="dsr").resolved_regrow_pool == "zeros_first"
    cfg = sparsity.SparseConfig(algorithm="rigl", regrow_pool="zeros_first")
    assert cfg.resolved_regrow_pool == "zeros_first"
    with pytest.raises(ValueError, match=r"regrow_pool='zeros'; allowed values: \['auto', "):
        sparsity.SparseConfig(regrow_pool="zeros")


def test_dsr_prunes_below_threshold_regrows_by_survivors_and_adapts_threshold():
    rng = np.random.default_rng(0)
    big = _layers(rng.uniform(1, 2, 40), rng.uniform(1, 2, 40))
    small = jnp.zeros(40).at[:10].set(0.01).at[10:20].set(1.5)
    weights = [big[0].at[20:].set(0), small, big[1].at[10:].set(0)]
    masks = [w != 0 for w in weights]
    how = Rewiring("dsr", jax.random.key(0), 0.0, threshold=jnp.float32(0.1), target_pruned=100)
    out = algorithms.rewire(how, weights=weights, masks=masks, caps=(40, 40, 40))
    assert int(out.num_pruned) == 10  # the ten 0.01 weights of layer 1
    kept = [int(s.sum()) for s in out.survivors]
    grown = [int(m.sum()) - k for m, k in zip(out.masks, kept, strict=True)]
    assert kept == [20, 10, 10] and sum(grown) == 10
    assert grown == [5, 2, 3]  # proportional to 20:10:10, cumulative flooring
    assert float(out.threshold) == np.float32(0.2)  # K = 10 < 0.9 * 100: doubled
    how = how._replace(target_pruned=5)
    out = algorithms.rewire(how, weights=weights, masks=masks, caps=(40, 40, 40))
    assert float(out.threshold) == np.float32(0.05)  # K = 10 > 1.1 * 5: halved


def test_snfs_shares_regrowth_by_mean_momentum():
    w = _layers(np.r_[np.arange(1, 11), np.zeros(30)], np.r_[np.arange(1, 11), np.zeros(30)])
    masks = [x != 0 for x in w]
    mom = [jnp.where(masks[0], 10.0, 0.0).at[30].set(1.0), jnp.where(masks[1], 1.0, 0.0)]
    how = Rewiring("snfs", jax.random.key(0), 0.5, momentum=mom)
    out = algorithms.rewire(how, weights=w, masks=masks, caps=(40, 40))
    counts = [int(m.sum()) for m in out.masks]
    assert sum(counts) == 20 and counts[0] > counts[1]
    assert bool(out.masks[0][30])  # grown where |momentum| is largest


@pytest.mark.parametrize("regrow_pool", ["not_kept", "zeros_first"])
@pytest.mark.parametrize("algorithm", ["set", "rigl", "snfs", "dsr"])
def test_compressed_rewire_selects_what_the_dense_rewire_selects(
    monkeypatch, algorithm, regrow_pool
):
    """Slots in scrambled order with unused ones, many ties (broken by position in both), and a
    layer too dense to regrow only at old zeros; the selection's windows of 16 positions, so
    that each layer (60, 90, 40 positions) takes several and a part of one."""
    monkeypatch.setattr(masks_lib, "SELECT_CHUNK", 16)
    rng = np.random.default_rng(3)
    sizes, caps = (60, 90, 40), (20, 30, 36)
    weights, masks, moms, values, indices, moms_c, grads = [], [], [], [], [], [], []
    for n, cap in zip(sizes, caps, strict=True):
        nnz = cap if cap > n // 2 else int(rng.integers(cap // 2, cap + 1))
        pos = rng.choice(n, nnz, replace=False)
        slots = rng.permutation(cap)[:nnz]
        idx = np.full(cap, n, np.int32)
        idx[slots] = pos
        vals, mom = np.zeros(cap, np.float32), np.zeros(cap, np.float32)
        vals[slots] = rng.integers(1, 6, nnz) / 10 * rng.choice([-1, 1], nnz)
        mom[slots] = rng.integers(0, 3, nnz)
        for dense_list, c in ((weights, vals), (moms, mom)):
            dense_list.append(jnp.zeros(n).at[idx].set(c, mode="drop"))
        masks.append(jnp.zeros(n, bool).at[idx].set(True, mode="drop"))
        values.append(jnp.asarray(vals))
        moms_c.append(jnp.asarray(mom))
        indices.append(jnp.asarray(idx))
        grads.append(jnp.asarray(rng.integers(0, 4, n), jnp.float32))
    how = Rewiring(
        algorithm,
        rng=jax.random.key(5),
        fraction=jnp.float32(0.5),
        grads=grads,
        threshold=jnp.float32(0.25),
        target_pruned=5,
        regrow_pool=regrow_pool,
    )
    dense = jax.jit(
        lambda: algorithms.rewire(
            how._replace(momentum=moms), weights=weights, masks=masks, caps=caps
        ),
        compiler_options=FAST_COMPILE,
    )()
    comp = jax.jit(
        lambda: algorithms.rewire_compressed(
            how._replace(momentum=moms_c), values=values, indices=indices, sizes=sizes
        ),
        compiler_options=FAST_COMPILE,
    )()
    assert int(comp.num_pruned) == int(dense.num_pruned) > 0
    assert float(comp.threshold) == float(dense.threshold)
    for i, n in enumerate(sizes):
        kept = jnp.zeros(n, bool).at[indices[i]].set(comp.survivors[i], mode="drop")
        np.testing.assert_array_equal(kept, dense.survivors[i])
        grown = np.asarray(comp.grown[i])
        assert (np.diff(grown) >= 0).all() and grown.dtype == np.int32
        regrown = dense.masks[i] & ~dense.survivors[i]
        np.testing.assert_array_equal(grown[grown < n], np.flatnonzero(regrown))
    if algorithm in ("set", "rigl") or regrow_pool == "not_kept":
        # 18 regrown, 4 old zeros (or any pool): some just-pruned ones regrown
        assert bool((masks[2] & regrown).any())


def test_rewire_rejects_bad_input():
    w = _layers([1.0, 0.0])
    layers = dict(weights=w, masks=[w[0] != 0], caps=(2,))
    with pytest.raises(ValueError, match="algorithm"):
        algorithms.rewire(Rewiring("magic", None, 0.1), **layers)
    with pytest.raises(ValueError, match="algorithm='rigl' needs grads"):
        algorithms.rewire(Rewiring("rigl", None, 0.1), **layers)
    with pytest.raises(ValueError, match="regrow_pool"):
        algorithms.rewire(Rewiring("set", None, 0.1, regrow_pool="x"), **layers)


def test_initial_masks_random_magnitude_and_snip():
    params = tiny_params()
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
    for init in ("random", "magnitude", "snip"):
        cfg = sparsity.SparseConfig(density=0.2, init=init, distribution="uniform")
        sp = sparsity.sparse_training(optax.sgd(0.1), cfg, params)
        masks = sp.initial_masks(params, grads)
        assert sum(int(m.sum()) for m in masks.values()) == sp.layout.total_budget
        leaves = leaves_by_key(params, sp.layout.keys)
        if init == "magnitude":
            for s in sp.layout.leaves:
                a = np.abs(np.asarray(leaves[s.key])).reshape(-1)
                m = np.asarray(masks[s.key]).reshape(-1)
                assert int(m.sum()) == s.budget and a[m].min() >= a[~m].max()
        if init == "snip":
            g = leaves_by_key(grads, sp.layout.keys)
            score = np.concatenate(
                [np.abs(np.asarray(leaves[k] * g[k])).reshape(-1) for k in sp.layout.keys]
            )
            m = np.concatenate([np.asarray(masks[k]).reshape(-1) for k in sp.layout.keys])
            assert score[m].min() >= score[~m].max()
    with pytest.raises(ValueError, match="snip"):
        sp.initial_masks(params)


def test_snip_store_takes_the_gradient_and_init_recovers_its_masks():
    params = tiny_params()
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
    cfg = sparsity.SparseConfig(density=0.2, init="snip", distribution="uniform")
    sp = sparsity.sparse_training(optax.sgd(0.1), cfg, params)
    with pytest.raises(ValueError, match="snip"):
        sp.store(params)
    stored, state = sp.store(params, grads)
    masks = sp.initial_masks(params, grads)
    jax.tree.map(np.testing.assert_array_equal, state.pattern, masks)
    # Masked storage: init of the stored (masked) parameters finds the same masks.
    jax.tree.map(np.testing.assert_array_equal, sp.init(stored).pattern, masks)
    for k in sp.layout.keys:
        assert not np.asarray(leaves_by_key(stored, [k])[k])[~np.asarray(masks[k])].any()


def test_compressed_init_and_unselected_params_raise():
    params = tiny_params()
    sp = sparsity.sparse_training(optax.sgd(0.1), sparsity.SparseConfig(compressed=True), params)
    with pytest.raises(ValueError, match="compressed"):
        sp.init(params)
    with pytest.raises(ValueError, match="is_sparse"):
        sparsity.sparse_training(
            optax.sgd(0.1), sparsity.SparseConfig(is_sparse=lambda p, s: False), params
        )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_resets_slots_of_regrown_weights_for_any_optimizer(name):
    params = tiny_params()
    cfg = sparsity.SparseConfig(algorithm="set", density=0.3, update_period=2, drop_fraction=0.5)
    sp = sparsity.sparse_training(OPTIMIZERS[name](), cfg, params)
    stored, state = sp.store(params)
    assert sp.init(stored).pattern.keys() == state.pattern.keys()
    update = jax.jit(sp.update, compiler_options=FAST_COMPILE)
    grads = jax.tree.map(jnp.sin, params)
    for t in range(2):
        old_masks = state.pattern
        updates, state = update(grads, state, stored)
        stored = optax.apply_updates(stored, updates)
        mirrors = slots.find_mirrors(state.inner_state, stored)
        assert mirrors
        for k in sp.layout.keys:
            regrown = np.asarray(state.pattern[k] & ~old_masks[k])
            assert regrown.any() == (t == 1)  # rewired on the 2nd applied step only
            for mirror in mirrors:
                slot = np.asarray(leaves_by_key(mirror, [k])[k])
                assert not slot[regrown].any() and not slot[~np.asarray(state.pattern[k])].any()
                if t == 1:  # surviving weights kept their (non-zero) slots
                    assert slot[np.asarray(state.pattern[k] & old_masks[k])].any()


def test_static_sparsity_never_changes_the_mask():
    params = tiny_params()
    cfg = sparsity.SparseConfig(algorithm="static", init="magnitude", density=0.3)
    sp = sparsity.sparse_training(optax.adam(1e-2), cfg, params)
    stored, state = sp.store(params)
    masks = state.pattern
    update = jax.jit(sp.update, compiler_options=FAST_COMPILE)
    for _ in range(3):
        updates, state = update(jax.tree.map(jnp.cos, params), state, stored)
        stored = optax.apply_updates(stored, updates)
    jax.tree.map(np.testing.assert_array_equal, state.pattern, masks)
    for k in sp.layout.keys:
        leaf = np.asarray(leaves_by_key(stored, [k])[k])
        assert not leaf[~np.asarray(masks[k])].any()


def test_drop_fraction_is_cosine_annealed():
    assert np.isclose(float(algorithms.drop_fraction(0.3, jnp.int32(0), 100)), 0.3)
    assert np.isclose(float(algorithms.drop_fraction(0.3, jnp.int32(50), 100)), 0.15)
    assert np.isclose(float(algorithms.drop_fraction(0.3, jnp.int32(100), 100)), 0.0, atol=1e-7)
    assert float(algorithms.drop_fraction(0.3, jnp.int32(50), None)) == np.float32(0.3)


def test_period_schedule_grows():
    params = tiny_params()
    cfg = sparsity.SparseConfig(
        algorithm="set", density=0.3, update_period=((0, 2), (4, 3)), drop_fraction=0.5
    )
    sp = sparsity.sparse_training(optax.sgd(0.1, momentum=0.9), cfg, params)
    stored, state = sp.store(params)
    update = jax.jit(sp.update, compiler_options=FAST_COMPILE)
    rewired = []
    for t in range(1, 10):
        old = state.pattern
        updates, state = update(jax.tree.map(jnp.sin, params), state, stored)
        stored = optax.apply_updates(stored, updates)
        if any(bool((state.pattern[k] != old[k]).any()) for k in sp.layout.keys):
            rewired.append(t)
    assert rewired == [2, 6, 9]


# --- gradients w.r.t. the stored parameters ----------------------------------------------


@pytest.mark.parametrize("algorithm", ["dsr", "set", "snfs"])
def test_update_takes_stored_layout_grads_equal_to_gathered_dense_grads(algorithm):
    params = tiny_params()
    cfg = sparsity.SparseConfig(
        algorithm=algorithm, density=0.3, distribution="uniform", compressed=True, update_period=1
    )
    tx = sparsity.sparse_training(optax.sgd(0.1, momentum=0.9), cfg, params)
    assert tx.grads_wrt_stored
    stored, state = tx.store(params)
    dense_grads = tiny_params(seed=1)
    for _ in range(2):  # the second update rewires (update_period=1 from count 1)
        # What differentiating loss(materialize(stored)) w.r.t. the stored values gives:
        stored_grads = jax.grad(
            lambda p, state=state: sum(
                jnp.vdot(g, w)
                for g, w in zip(
                    jax.tree.leaves(dense_grads),
                    jax.tree.leaves(tx.materialize(p, state)),
                    strict=True,
                )
            )
        )(stored)
        u_dense, s_dense = tx.update(dense_grads, state, stored)
        u_stored, s_stored = tx.update(stored_grads, state, stored)
        for a, b in zip(
            jax.tree.leaves((u_dense, s_dense)), jax.tree.leaves((u_stored, s_stored)), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        stored, state = optax.apply_updates(stored, u_dense), s_dense


def test_stored_layout_grads_are_refused_where_they_cannot_work():
    params = tiny_params()
    rigl = sparsity.SparseConfig(algorithm="rigl", density=0.3, compressed=True)
    tx = sparsity.sparse_training(optax.sgd(0.1), rigl, params)
    assert not tx.grads_wrt_stored  # RigL grows where |dense grad| is largest
    stored, state = tx.store(params)
    with pytest.raises(ValueError, match="rigl"):
        tx.update(jax.tree.map(jnp.zeros_like, stored), state, stored)
    dsr = sparsity.sparse_training(
        optax.sgd(0.1),
        sparsity.SparseConfig(
            algorithm="dsr", density=0.3, distribution="uniform", compressed=True
        ),
        params,
    )
    stored, state = dsr.store(params)
    wrong = jax.tree.map(lambda x: jnp.zeros(x.shape[:-1] + (x.shape[-1] + 1,)), stored)
    with pytest.raises(ValueError, match="dense model parameters or"):
        dsr.update(wrong, state, stored)


@pytest.mark.slow
def test_compressed_microbatch_accumulator_has_the_stored_size():
    from lowmem_jax.workloads import analyze_model

    plan = lm.Plan(microbatches=2)
    dense = analyze_model("wrn-10-1", 8, plan, image_size=8).analytic["optimizer_breakdown"]
    cfg = sparsity.SparseConfig(  # static: the same accumulator, no rewiring to compile
        algorithm="static", density=0.1, distribution="uniform", compressed=True
    )
    sparse = analyze_model(
        "wrn-10-1",
        8,
        dataclasses.replace(plan, sparsity=cfg),
        image_size=8,
    )
    breakdown = sparse.analytic["optimizer_breakdown"]
    stored_bytes = sparse.analytic["model_bytes"]  # float32 values (+ dense leaves)
    assert breakdown["gradient_accumulator"] == stored_bytes
    assert breakdown["gradient_accumulator"] < 0.3 * dense["gradient_accumulator"]


def test_compressed_materialize_differentiates_as_a_gather_without_dense_temporaries():
    """The dense weights are a scatter of the [capacity] values; its gradient w.r.t. the values
    is the dense gradient read at the live positions (0 in unused slots). Promising unique
    indices keeps JAX's and XLA:CPU's last-writer bookkeeping (dense int32 maps of the layer)
    out of the step: the compiled gradient needs no [n]-sized temporary."""
    from lowmem_jax.techniques.sparsity.layout import LeafSpec
    from lowmem_jax.techniques.sparsity.storage import COMPRESSED

    n, cap = 1 << 16, 1 << 12
    spec = LeafSpec("w", (n,), n, cap, cap)
    rng = np.random.default_rng(0)
    live = cap - 100  # the rest are unused slots, all holding index n
    pattern = np.full(cap, n, np.int32)
    pattern[:live] = rng.choice(n, live, replace=False)
    values = jnp.asarray(rng.normal(size=cap), jnp.float32)
    x = jnp.asarray(rng.normal(size=n), jnp.float32)

    def loss(v, p, x):
        return jnp.vdot(COMPRESSED.materialize(v, p, spec), x)

    dense = COMPRESSED.materialize(values, jnp.asarray(pattern), spec)
    expected_dense = np.zeros(n, np.float32)
    expected_dense[pattern[:live]] = np.asarray(values)[:live]
    np.testing.assert_array_equal(dense, expected_dense)
    grad = jax.jit(jax.grad(loss))(values, jnp.asarray(pattern), x)
    expected = np.where(pattern < n, np.asarray(x)[np.minimum(pattern, n - 1)], 0.0)
    np.testing.assert_array_equal(grad, expected)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (values, pattern, x)]
    compiled = jax.jit(jax.grad(loss)).lower(*abstract).compile(compiler_options=FAST_COMPILE)
    if jax.default_backend() == "cpu":  # 4.25 bytes per dense weight without the promise
        assert compiled.memory_analysis().temp_size_in_bytes < n


# --- the plan's optimizer and the summary facts -------------------------------------------


def test_plan_wraps_the_optimizer_and_describe_reports_the_pattern():
    params = tiny_params()
    tx = optax.sgd(0.1, momentum=0.9)
    dense = lm.Plan().wrap_optimizer(tx)
    assert isinstance(dense, OptaxOptimizer) and dense.tx is tx and dense.describe() == {}
    with pytest.raises(ValueError, match="SparseConfig"):
        lm.Plan(sparsity={"density": 0.1})
    cfg = sparsity.SparseConfig(
        algorithm="set", density=0.3, distribution="uniform", compressed=True
    )
    plan = lm.Plan(sparsity=cfg)
    with pytest.raises(ValueError, match="params"):
        plan.wrap_optimizer(tx)
    sp = plan.wrap_optimizer(tx, jax.eval_shape(lambda: params))  # shapes are enough
    assert isinstance(sp, sparsity.SparseTraining) and sp.inner is tx and sp.config is cfg
    state = lm.TrainState.create(params=params, tx=sp, plan=plan)
    size = sum(s.size for s in sp.layout.leaves)
    budget = sp.layout.total_budget
    assert sp.describe(state.opt_state) == {
        "sparsity": {
            "algorithm": "set",
            "storage": "compressed",
            "target_density": 0.3,
            "nnz": budget,
            "budget": budget,
            "size": size,
            "density": budget / size,
            "sparse_leaves": 3,  # conv, stack/dense and dense kernels; not the classifier
            "headline": f"density {budget / size:.4f}",
        }
    }
    # Measured on model parameters: the non-zero fraction of the sparse leaves.
    measured = sp.describe(params=lm.model_params(state, sp))
    assert measured["sparsity"]["density"] == budget / size
    assert sp.describe(params=params) == {
        "sparsity": {"density": 1.0, "headline": "density 1.0000"}
    }
    assert plan.to_dict()["sparsity"] == cfg.describe()
    assert "sparsity" not in lm.Plan().to_dict()


@pytest.mark.parametrize("n", [5, 100, 1000, 4097])
@pytest.mark.parametrize("typed", [False, True])
def test_uniform_scores_are_jax_random_uniform_bit_for_bit(n, typed):
    key = jax.random.key(7) if typed else jax.random.fold_in(jax.random.PRNGKey(3), 11)
    got = jax.jit(masks_lib.uniform_scores, static_argnums=(1, 2))(key, n, 256)
    want = jax.random.uniform(key, (n,))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("n", [5, 300, 1000])
@pytest.mark.parametrize("typed", [False, True])
def test_any_slice_of_the_uniform_scores_is_drawn_alone(n, typed):
    key = jax.random.key(7) if typed else jax.random.fold_in(jax.random.PRNGKey(3), 11)
    want = np.asarray(jax.random.uniform(key, (n,))).view(np.uint32)
    part = masks_lib.uniform_part(key, n)
    for start, size in ((0, n), (n // 3, n - n // 3), (n - 1, 1)):
        got = jax.jit(part, static_argnums=1)(jnp.int32(start), size)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want[start : start + size])
    # Another key scheme: no slice is drawn alone (callers draw the whole vector).
    assert masks_lib.uniform_part(jax.random.key(0, impl="rbg"), n) is None
    assert masks_lib.uniform_part(key, 1 << 32) is None  # the counters' high word is not 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU buffer assignment")
def test_compressed_rewiring_of_a_large_layer_needs_about_one_byte_per_dense_weight():
    """Regrowth ranks every dense position by an int8 map (1 byte per weight) and, for random
    regrowth, scores drawn chunk by chunk where the selection's loops rank them, plus chunk- and
    capacity-sized temporaries (1.6 bytes per weight in all at this size). With the float32
    scores drawn whole it was 5.5; with the whole key materialized and masked for
    ``lax.top_k``, 9.5 (and XLA:CPU's top_k allocated [n] indices besides, outside XLA's
    count)."""
    n, cap = 1 << 20, 1 << 15

    def rewire(values, indices, rng):
        how = Rewiring("dsr", rng, jnp.float32(0.3), threshold=jnp.float32(1e-3))
        return algorithms.rewire_compressed(how, values=[values], indices=[indices], sizes=(n,))

    abstract = (
        jax.ShapeDtypeStruct((cap,), jnp.float32),
        jax.ShapeDtypeStruct((cap,), jnp.int32),
        jax.random.PRNGKey(0),
    )
    compiled = jax.jit(rewire).lower(*abstract).compile(compiler_options=FAST_COMPILE)
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * n


def _top_k_positions(eligible, key, count, k):
    """The reference: ``lax.top_k`` over the masked keys, the first ``count`` taken, sorted."""
    n = key.shape[0]
    vals, pos = jax.lax.top_k(jnp.where(eligible, key, -jnp.inf), k)
    take = (jnp.arange(k) < jnp.minimum(count, k)) & (vals > -jnp.inf)
    return jnp.sort(jnp.where(take, pos.astype(jnp.int32), n))


@pytest.mark.parametrize("n,k", [(37, 37), (100, 30), (1000, 999)])
def test_top_positions_selects_what_top_k_selects(monkeypatch, n, k):
    """The radix select over chunks takes the positions ``lax.top_k`` takes, ties by position,
    with several chunks and a remainder (a 16-element chunk here), every count from none to
    more than are eligible, and keys with many ties, +inf and both zeros (not -inf, which the
    reference's mask cannot tell from an ineligible entry)."""
    monkeypatch.setattr(masks_lib, "SELECT_CHUNK", 16)

    @jax.jit
    def both(eligible, key, count):
        chunk = lambda start, size: tuple(masks_lib.slicer(start, size)(x) for x in (eligible, key))  # noqa: E731
        return masks_lib.top_positions(chunk, n, count, k), _top_k_positions(
            eligible, key, count, k
        )

    rng = np.random.default_rng(n)
    pool = np.array([-1.5, -0.0, 0.0, 0.25, 1.0, 3.0, np.inf], np.float32)
    for trial in range(12):
        ties = trial % 2 == 0
        key = rng.choice(pool, n) if ties else rng.normal(size=n).astype(np.float32)
        eligible = rng.random(n) < rng.choice([0.0, 0.3, 0.9, 1.0])
        for count in sorted({0, 1, k // 2, k, int(eligible.sum()), k + 5}):
            got, want = both(jnp.asarray(eligible), jnp.asarray(key), jnp.int32(count))
            np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}, count {count}")


def test_compressed_rewiring_of_many_layers_holds_one_layer_s_temporaries():
    """Each layer's prune, regrowth and new slots run as one conditional that waits for the
    previous layer's slots: four layers need about one layer's temporaries (XLA:CPU). Chained by
    ``optimization_barrier`` instead (which XLA:CPU drops before scheduling), four needed 3.5x
    one layer's."""
    n, cap = 1 << 16, 1 << 13

    def temp_bytes(layers):
        def rewire(values, indices, rng):
            how = Rewiring("dsr", rng, jnp.float32(0.3), threshold=jnp.float32(1e-3))
            return algorithms.rewire_compressed(
                how, values=list(values), indices=list(indices), sizes=(n,) * layers
            )

        abstract = (
            [jax.ShapeDtypeStruct((cap,), jnp.float32)] * layers,
            [jax.ShapeDtypeStruct((cap,), jnp.int32)] * layers,
            jax.random.PRNGKey(0),
        )
        compiled = jax.jit(rewire).lower(*abstract).compile(compiler_options=FAST_COMPILE)
        return compiled.memory_analysis().temp_size_in_bytes

    one, four = temp_bytes(1), temp_bytes(4)
    assert four < 1.25 * one, (one, four)


def test_compressed_stack_blocks_are_the_dense_leaf_sliced():
    from lowmem_jax.techniques.sparsity.layout import LeafSpec
    from lowmem_jax.techniques.sparsity.storage import COMPRESSED, CompressedStack

    shape = (3, 4, 5)
    n, cap = 60, 24
    spec = LeafSpec("stack/w", shape, n, cap - 4, cap)
    rng = np.random.default_rng(1)
    pattern = np.full(cap, n, np.int32)
    pattern[: cap - 4] = rng.choice(n, cap - 4, replace=False)
    values = jnp.asarray(rng.normal(size=cap), jnp.float32)
    stack = COMPRESSED.materialize_blockwise(values, jnp.asarray(pattern), spec)
    assert isinstance(stack, CompressedStack) and stack.shape == shape
    dense = COMPRESSED.materialize(values, jnp.asarray(pattern), spec)
    np.testing.assert_array_equal(stack.dense(), dense)
    for i in range(3):
        np.testing.assert_array_equal(jax.jit(stack.block)(jnp.int32(i)), dense[i])
    # A cast reaches the values (a pytree child); the indices stay int32.
    half = jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, stack)
    assert half.dtype == jnp.float16 and half.indices.dtype == jnp.int32


@pytest.mark.slow
def test_blockwise_stacks_give_the_gradients_of_the_dense_materialization(monkeypatch):
    """Under remat the step's loss reads the scanned stacks' compressed weights block by block;
    its gradient w.r.t. the stored values equals the one through the whole dense
    materialization (without remat the stacks are densified whole: ``CompressedStack.dense``,
    checked against ``materialize`` above)."""
    from lowmem_jax.core.base import differentiated_loss
    from lowmem_jax.workloads import build, workload

    cfg = sparsity.SparseConfig(
        algorithm="dsr", density=0.2, distribution="uniform", compressed=True
    )
    setup = build(workload("wrn-22-1", 8, image_size=8), lm.Plan(remat="full", sparsity=cfg))
    batch = setup.example_batch()
    state = setup.init_state(batch)

    def grads(opt):
        loss, wrt = differentiated_loss(setup.loss_fn, opt, state.params, state.opt_state)
        rng = jax.random.PRNGKey(1)
        return jax.jit(jax.grad(lambda p: loss(p, state.model_state, batch, rng)[0]))(wrt)

    blockwise = grads(setup.tx)
    # Not told which leaves are stacked, the step hands the scan the leaves' sliceable forms
    # (CompressedBlock); without those, dense weights built before the model runs, and says so.
    sliced, whole = unnamed_stacks(grads, setup.tx, monkeypatch)
    for other in (sliced, whole):
        assert_trees_close_to_scale(blockwise, other)  # three programs: float32 roundoff
