"""The registry of named workloads and the one builder of a step and its state."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILE, TINY_TRANSLATION

import lowmem_jax as lm
from lowmem_jax.core.jaxprs import traced_equations
from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.precision import policy as precision
from lowmem_jax.workloads import build, recipes, translation_is_sparse, workload

# --- the registry ------------------------------------------------------------------------


def _shapes(batch):
    return {k: (v.shape, jnp.dtype(v.dtype)) for k, v in batch.items()}


def test_wrn_workloads_are_classification_with_image_batches():
    work = workload("wrn-16-2")
    assert work.name == "wrn-16-2" and work.task == "classification"
    assert isinstance(work.model, lm.models.WideResNet)
    assert (work.model.depth, work.model.width, work.model.num_classes) == (16, 2, 10)
    assert work.batch_size == 128 and work.init_inputs == ("image",)
    assert _shapes(work.batch) == {
        "image": ((128, 32, 32, 3), jnp.float32),
        "label": ((128,), jnp.int32),
    }
    assert work.recipe.optimizer == "sgd_nesterov" and work.recipe.schedule == "cosine"
    assert work.is_sparse is sparsity.default_is_sparse

    small = workload("wrn-10-1", 8, image_size=8)
    assert (small.model.depth, small.model.width) == (10, 1) and small.batch_size == 8
    assert _shapes(small.batch)["image"] == ((8, 8, 8, 3), jnp.float32)
    # Real data's shapes (one-channel digits), at another batch size.
    data = {"image": np.zeros((2, 16, 16, 1), np.float32), "label": np.zeros(2, np.int32)}
    resized = small.with_batch(data, batch_size=64)
    assert _shapes(resized.batch) == {
        "image": ((64, 16, 16, 1), jnp.float32),
        "label": ((64,), jnp.int32),
    }
    assert resized.batch_size == 64 and small.with_batch(data).batch_size == 2


@pytest.mark.parametrize(
    "name, batch_size, embed_dim, warmup", [("dynamicconv-small", 100, 64, 50),
                                            ("dynamicconv-iwslt", 4, 512, 4000)]
)  # fmt: skip
def test_dynamicconv_workloads_are_translation_with_token_batches(
    name, batch_size, embed_dim, warmup
):
    work = workload(name, None if name == "dynamicconv-small" else 4, seq_len=8)
    assert work.task == "translation" and work.batch_size == batch_size
    assert isinstance(work.model, lm.models.DynamicConvTransformer)
    assert work.model.embed_dim == embed_dim
    assert work.init_inputs == ("src", "tgt_in")
    tokens = ((batch_size, 8), jnp.int32)
    assert _shapes(work.batch) == {"src": tokens, "tgt_in": tokens, "tgt_out": tokens}
    assert work.recipe.optimizer == "adamw" and work.recipe.schedule == "inverse_sqrt"
    assert work.recipe.warmup == warmup and work.recipe.label_smoothing == 0.1
    assert work.is_sparse is translation_is_sparse
    assert workload(name).batch["src"].shape == (100, 40)  # the recipe's 4,000 tokens


def test_the_example_batch_of_a_small_vocabulary_gives_a_finite_loss():
    """dynamicconv-small's vocabularies are 32 tokens: example tokens up to 1,000 made every
    label out of range (a NaN loss, every step skipped)."""
    setup = lm.build(workload("dynamicconv-small", 4, seq_len=8, **TINY_TRANSLATION), lm.Plan())
    batch = setup.example_batch()
    assert all(int(x.max()) < 32 and int(x.min()) >= 4 for x in batch.values())
    state = setup.init_state(batch)
    loss, _ = setup.loss_fn(state.params, state.model_state, batch, jax.random.key(0))
    assert jnp.isfinite(loss)


def test_model_overrides_reach_the_model():
    model = workload("dynamicconv-small", dropout=0.0, **TINY_TRANSLATION).model
    assert model.dropout == 0.0 and model.embed_dim == 32 and model.encoder_kernel_sizes == (3,)
    assert workload("wrn-10-1", num_classes=7).model.num_classes == 7


@pytest.mark.parametrize("name", ["resnet-50", "wrn-16", "dynamicconv", "", None])
def test_unknown_workload_names_the_allowed_values(name):
    with pytest.raises(ValueError, match=r"Unknown model=.*allowed values: wrn-D-K") as err:
        workload(name)
    assert "dynamicconv-small" in str(err.value) and "dynamicconv-iwslt" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"batch_size": 0}, "batch_size"), ({"seq_len": 0}, "seq_len"), ({"image_size": 0}, "image")],
)
def test_workload_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        workload("wrn-10-1", **kwargs)


# --- the builder -------------------------------------------------------------------------

# Static: the builder is under test, not the rewiring (whose compile would triple the time).
SPARSE = sparsity.SparseConfig(
    algorithm="static", density=0.2, distribution="uniform", compressed=True
)


def _hand_composed(work, plan, batch):
    """The step and state of ``work`` under ``plan``, composed from the library's parts."""
    model = plan.configure_model(work.model)
    rng = jax.random.PRNGKey(0)

    def init(images):
        return model.init(rng, images[:2], train=False)

    params = jax.eval_shape(init, batch["image"])["params"]
    # The recipe: SGD Nesterov, weight decay on kernels, cosine schedule (one step long).
    schedule = optax.cosine_decay_schedule(0.1, 1)
    tx = plan.wrap_optimizer(recipes.sgd_nesterov(schedule, 0.9, 5e-4), params)

    def init_state(images):
        variables = init(images)
        return lm.TrainState.create(
            params=variables["params"],
            tx=tx,
            plan=plan,
            model_state={"batch_stats": variables["batch_stats"]},
            rng=rng,
        )

    step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    return step, jax.jit(init_state, compiler_options=FAST_COMPILE)(batch["image"]), tx


def _assert_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


@pytest.mark.parametrize("sparse", [None, SPARSE], ids=["dense", "compressed"])
def test_built_step_equals_the_hand_composed_step(sparse):
    plan = lm.Plan(microbatches=2, sparsity=sparse)
    work = workload("wrn-10-1", 8, image_size=8)
    setup = build(work, plan)
    assert setup.workload is work and setup.plan == plan  # nothing to fill in for a WRN
    assert setup.config == {"model": "wrn-10-1", "batch_size": 8, **plan.to_dict()}
    assert setup.recipe == work.recipe  # analysis and training: the same optimizer
    assert isinstance(setup.tx, sparsity.SparseTraining) == (sparse is not None)
    batch = setup.example_batch()
    assert _shapes(batch) == _shapes(work.batch)
    assert set(np.unique(batch["label"])) <= set(range(10))

    step, state, tx = _hand_composed(work, plan, batch)
    # The same state as setup.init_state builds (its values: the loop tests train from it).
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    assert setup.abstract_state() == abstract
    built = jax.tree.map(jnp.copy, state)  # the built step donates its state

    # One real step each (compiled alike), from equal states.
    built, _ = setup.step.lower(built, batch).compile(FAST_COMPILE)(built, batch)
    state, metrics = step.lower(state, batch).compile(FAST_COMPILE)(state, batch)
    assert bool(metrics["grads_finite"]) and int(built.step) == 1
    _assert_close(built, state)  # parameters, optimizer state (pattern), BatchNorm, counters
    assert jax.tree.structure(lm.model_params(built, setup.tx)) == jax.tree.structure(
        lm.model_params(state, tx)
    )
    if sparse is not None:  # compressed: values [capacity] stored; gradients w.r.t. them
        assert setup.tx.grads_wrt_stored
        assert built.params["stem"]["kernel"].ndim == 1
        assert sparsity.density_report(setup.tx, built.opt_state)["nnz"] == (
            setup.tx.layout.total_budget
        )


@pytest.mark.parametrize("sparse", [None, SPARSE], ids=["dense", "compressed"])
def test_setup_analyze_is_lm_analyze_of_its_parts(sparse):
    setup = build(workload("wrn-10-1", 8, image_size=8), lm.Plan(microbatches=2, sparsity=sparse))
    report = setup.analyze()
    direct = lm.analyze(
        setup.step,
        setup.abstract_state(),
        setup.workload.batch,
        loss_fn=setup.loss_fn,
        plan=setup.plan,
        tx=setup.tx,
    )
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes"):
        assert report.xla[key] == direct.xla[key], key
    for key in ("model_bytes", "optimizer_bytes", "activation_bytes", "input_bytes", "total_bytes"):
        assert report.analytic[key] == direct.analytic[key], key
    assert report.analytic["optimizer_breakdown"] == direct.analytic["optimizer_breakdown"]
    assert report.param_count == direct.param_count and report.flops == direct.flops
    assert report.config == setup.config


def test_sparse_translation_plan_gets_the_workload_leaves_and_end_step():
    work = workload("dynamicconv-small", 4, seq_len=8, **TINY_TRANSLATION)
    plan = lm.Plan(sparsity=sparsity.SparseConfig(algorithm="rigl", compressed=True))
    setup = build(work, plan, total_steps=100)
    assert setup.plan.sparsity.is_sparse is translation_is_sparse
    assert setup.plan.sparsity.end_step == int(0.75 * 100)
    assert all("weight_linear" not in key for key in setup.tx.layout.keys)
    assert setup.tx.config == setup.plan.sparsity
    assert setup.recipe == work.recipe  # a run's length: the recipe's own schedule
    assert build(work, plan).plan.sparsity.end_step is None  # no run length: never stops
    # A plan's own choices are kept.
    own = dataclasses.replace(
        plan.sparsity, end_step=10, is_sparse=lambda path, shape: "fc1" in path and len(shape) > 1
    )
    kept = build(work, dataclasses.replace(plan, sparsity=own), total_steps=100).plan.sparsity
    assert kept.end_step == 10 and kept.is_sparse is own.is_sparse


def test_snip_masks_come_from_the_gradient_on_the_init_batch():
    snip = sparsity.SparseConfig(
        algorithm="static", init="snip", density=0.2, distribution="uniform", compressed=True
    )
    setup = build(workload("wrn-10-1", 8, image_size=8), lm.Plan(sparsity=snip))
    assert setup.tx.needs_init_grads
    assert not lm.core.base.as_optimizer(optax.sgd(0.1)).needs_init_grads
    batch = setup.example_batch()
    state = setup.init_state(batch)
    # By hand: the loss's gradient on the whole batch at the initial parameters (jitted: op by
    # op, a WRN's gradient takes minutes on CPU).
    loss_fn = precision.cast_loss_fn(setup.loss_fn, setup.plan.policy)
    magnitude = dataclasses.replace(snip, init="magnitude", capacity_factor=1.25)
    dense = jax.eval_shape(lambda s: lm.model_params(s, setup.tx), setup.abstract_state())
    by_magnitude = sparsity.sparse_training(setup.tx.inner, magnitude, dense)

    @jax.jit
    def by_hand(batch):
        variables = setup.model.init(jax.random.PRNGKey(0), batch["image"][:2], train=False)
        model_state = {"batch_stats": variables["batch_stats"]}
        grads = jax.grad(lambda p: loss_fn(p, model_state, batch, None)[0])(variables["params"])
        return (
            setup.tx.store(variables["params"], grads)[1].pattern,
            by_magnitude.store(variables["params"])[1].pattern,
        )

    expected, magnitude_pattern = by_hand(batch)
    jax.tree.map(np.testing.assert_array_equal, state.opt_state.pattern, expected)
    # The gradient mattered: magnitude masks keep other weights.
    sizes = {s.key: s.size for s in setup.tx.layout.leaves}

    def kept(pattern, key):
        idx = np.asarray(pattern[key])
        return set(idx[idx < sizes[key]].tolist())

    assert any(kept(expected, k) != kept(magnitude_pattern, k) for k in sizes)


def test_build_rejects_a_batch_the_microbatches_do_not_divide():
    with pytest.raises(ValueError, match="microbatches=3"):
        build(workload("wrn-10-1", 8, image_size=8), lm.Plan(microbatches=3))


# --- the plain baseline ----------------------------------------------------------------------


def test_the_plain_step_is_plain_and_agrees_with_the_lowmem_fp32_step():
    """Plain, ours (no technique: unrolled, XLA's convolution) and ours scanned with the
    loop-friendly convolution take the same step."""
    work = workload("wrn-10-1", 8, image_size=8)
    plain, ours = lm.workloads.build_plain(work), build(work, lm.Plan())
    scanned_work = dataclasses.replace(work, model=work.model.clone(unroll=False))
    scanned = build(scanned_work, lm.Plan())
    assert plain.config["plain"] and (plain.model.unroll, plain.model.conv_impl) == (True, "xla")
    assert (ours.model.unroll, ours.model.conv_impl) == (None, "xla")
    assert (scanned.model.unroll, scanned.model.conv_impl) == (False, "auto")
    batch = plain.example_batch()
    after = {}
    for name, setup in (("plain", plain), ("ours", ours), ("scanned", scanned)):
        state = setup.init_state(batch)
        eqns = {e.primitive.name for e in traced_equations(setup.step, state, batch)}
        # lowmem's step checks finiteness (to skip a step); the plain one does not.
        assert ("is_finite" in eqns) == (name != "plain"), (name, eqns)
        after[name], _ = setup.step(state, batch)
    for name in ("ours", "scanned"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
            after["plain"].params, after[name].params,
        )  # fmt: skip
    report = lm.analyze_model("wrn-10-1", 8, None, image_size=8)
    assert report.config["plain"] and report.xla["total_bytes"] > 0


@pytest.mark.parametrize(
    "plan, unroll, conv_impl",
    [
        (lm.Plan(), None, "xla"),
        (lm.Plan(microbatches=2), None, "auto"),  # the microbatches' loop
        (lm.Plan(remat="full"), None, "auto"),  # remat'd stacks stay loops
        (lm.Plan(remat="blocks:none*2,full,none*3"), None, "auto"),
        (lm.Plan(), False, "auto"),  # scanned stacks
        (lm.Plan(remat="full"), True, "xla"),
        (lm.Plan(precision="mixed_fp16"), None, "auto"),  # float16 stacks stay loops
        (lm.Plan(precision="mixed_bf16"), None, "xla"),
    ],
)
def test_xla_convolution_exactly_when_the_step_has_no_loop(plan, unroll, conv_impl):
    model = lm.models.WideResNet(depth=16, width=1, unroll=unroll)
    assert plan.configure_model(model).conv_impl == conv_impl
    assert plan.configure_model(model.clone(conv_impl="loop_friendly")).conv_impl == (
        "loop_friendly"
    )


def test_variable_shapes_trace_once_per_model_and_inputs():
    """A search builds one model many times: equal models share one trace; a model with an
    unhashable field (a list) is traced each time, not refused."""
    from lowmem_jax.workloads.setup import variable_shapes

    class ListWidths(nn.Module):
        widths: list

        @nn.compact
        def __call__(self, images, train):
            return nn.Dense(self.widths[0])(images.reshape(images.shape[0], -1))

    work = workload("wrn-10-1", 8, image_size=8)
    assert variable_shapes(work.model, work) is variable_shapes(work.model.clone(), work)
    listed = variable_shapes(ListWidths([3]), work)
    assert listed["params"]["Dense_0"]["kernel"].shape == (8 * 8 * 3, 3)
    assert variable_shapes(ListWidths([3]), work) is not listed
