"""GPipe pipeline parallelism (lowmem_jax.techniques.pipeline.gpipe): the stages compute what one
device does.

Needs host devices set before JAX starts: tests/test_sharding.py runs this file in a pytest
process of its own with ``LOWMEM_TEST_DEVICES=8`` (read by conftest). Alone:
``LOWMEM_TEST_DEVICES=8 python -m pytest tests/pipeline_cases.py``.
"""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, assert_trees_close, classification_batch, to_numpy
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_technique import _settings

import lowmem_jax as lm
from lowmem_jax.blocks import hooks as block_hooks
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.core import mesh as sharding
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.techniques.pipeline import gpipe as pipeline_lib
from lowmem_jax.workloads.recipes import Recipe

# The tiny DynamicConv Transformer with stacks of 4 encoder and 2 decoder layers, no dropout.
TRANSLATION = {
    "embed_dim": 16, "ffn_dim": 32, "num_heads": 2,
    "encoder_kernel_sizes": (3, 3, 3, 3), "decoder_kernel_sizes": (3, 3), "dropout": 0.0,
}  # fmt: skip


# SGD with momentum, a constant rate: Adam's first steps would hide the gradient's size.
SGD = Recipe("sgd_nesterov", 0.1, "constant")


def _steps(work, plan, batches):
    """Two steps of ``plan`` on ``work`` from the same initial state: the host parameters and
    losses, the last state, the setup."""
    setup = lm.build(work, plan, recipe=SGD)
    state = setup.init_state(batches[0])
    out = []
    for batch in batches:
        state, metrics = setup.step(state, batch)
        out.append((to_numpy(state.params), float(metrics["loss"])))
    return out, state, setup


def _compare(work, plan, seeds=(0, 1)):
    """``plan`` and the one-device step take the same two steps."""
    batches = [lm.build(work, lm.Plan()).example_batch(seed) for seed in seeds]
    got, state, setup = _steps(work, plan, batches)
    want, _, _ = _steps(work, lm.Plan(), batches)
    for (g, g_loss), (w, w_loss) in zip(got, want, strict=True):
        np.testing.assert_allclose(g_loss, w_loss, rtol=1e-5)
        assert_trees_close(g, w, rtol=2e-5, atol=2e-6)
    return state, setup


@pytest.mark.parametrize("stages, microbatches, rest", [(2, 4, "replicate"), (4, 2, "partition")])
def test_the_pipelined_transformer_equals_the_one_device_step(stages, microbatches, rest):
    """LayerNorm only: a stack run per microbatch computes what it does on the whole batch.
    With 4 stages the 2-layer decoder stack does not divide: it stays whole, here partitioned
    over the stages with the embeddings (pipeline_rest), gathered where the model reads it."""
    work = lm.workload("dynamicconv-small", 8, seq_len=6, **TRANSLATION)
    plan = lm.Plan(pipeline=stages, pipeline_microbatches=microbatches, pipeline_rest=rest)
    state, setup = _compare(work, plan)
    encoder = state.params["encoder_k3_0"]["stack"]
    decoder = state.params["decoder_k3_0"]["stack"]
    kernel = jax.tree.leaves(encoder)[0]
    assert kernel.sharding.spec == P(pipeline_lib.STAGE)
    assert len(kernel.sharding.device_set) == stages
    stage = pipeline_lib.STAGE
    embed = state.params["src_embed"]["embedding"]
    assert (stage in embed.sharding.spec) == (rest == "partition")
    decoder_specs = [leaf.sharding.spec for leaf in jax.tree.leaves(decoder)]
    if stages == 2:  # pipelined
        assert set(decoder_specs) == {P(stage)}
    else:  # partitioned along another axis than its layers'
        assert any(stage in spec[1:] for spec in decoder_specs)
        assert not any(spec[:1] == (stage,) for spec in decoder_specs)
    (verdict,) = [v for v in setup.verdicts() if v.technique == "pipeline"]
    assert verdict.took_effect
    assert f"{microbatches} microbatches" in verdict.evidence
    bubble = pipeline_lib.bubble_fraction(stages, microbatches)
    assert f"bubble {bubble:.0%}" in verdict.evidence


def test_a_pipelined_wide_resnet_with_one_microbatch_equals_the_one_device_step():
    """WRN-22-1: its three stacks of 2 blocks split over 2 stages; with one microbatch
    BatchNorm sees the whole batch, as on one device (parameters and running averages)."""
    work = lm.workload("wrn-22-1", 8, image_size=8)
    state, _ = _compare(work, lm.Plan(pipeline=2, pipeline_microbatches=1))
    stats = state.model_state["batch_stats"]["group2_rest"]["stack"]
    assert jax.tree.leaves(stats)[0].sharding.spec == P(pipeline_lib.STAGE)


class _Block(nn.Module):
    """Dense + BatchNorm + tanh, residual: a block with running averages."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(x.shape[-1])(x))
        return x + jnp.tanh(h)


class _UnitBlock(nn.Module):
    """Dense, then scaled to unit norm: not differentiable at zero (0/0), as at the zeros a
    stage would otherwise compute on in its idle ticks."""

    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(x.shape[-1])(x)
        return x + h / jnp.sqrt(jnp.sum(h * h, axis=-1, keepdims=True))


def _stack_gradients(stages, microbatches, variables, x, block=_Block):
    """The loss's gradient and the new running averages of a stack of 4 blocks pipelined over
    ``stages`` (``1``: the microbatches one after another on one device)."""
    stack = lm.ScannedBlocks(block, 4)
    mesh = sharding.device_mesh({"data": 1, pipeline_lib.STAGE: stages})
    settings = pipeline_lib.Pipeline(stages, microbatches, mesh)

    def loss(params):
        trace = pipeline_lib.PipelinedStacks(settings)  # the pipeline's per-block hook
        with block_hooks.active(trace):
            y, updated = stack.apply({**variables, "params": params}, x, train=True,
                                     mutable=["batch_stats"])  # fmt: skip
        updated = updated or {}
        assert trace.stacks == [(4, True)]
        return jnp.sum(jnp.sin(y)), updated

    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 4)])
def test_each_stage_updates_its_running_averages_microbatch_by_microbatch(stages, microbatches):
    """BatchNorm inside the pipeline normalises per microbatch (GPipe's rule), and the
    running averages follow the microbatches in order: as the same microbatches run one after
    another through the whole stack on one device (a pipeline of one stage)."""
    x = jax.random.normal(jax.random.key(1), (8, 6))
    init = jax.jit(lambda key, x: lm.ScannedBlocks(_Block, 4).init(key, x, train=False))
    variables = init(jax.random.key(0), x)
    got = _stack_gradients(stages, microbatches, variables, x)
    want = _stack_gradients(1, microbatches, variables, x)
    assert_trees_close(to_numpy(got), to_numpy(want), rtol=2e-5, atol=1e-6)
    whole = _stack_gradients(1, 1, variables, x)  # one microbatch: other statistics
    assert not np.allclose(want[1]["batch_stats"]["stack"]["BatchNorm_0"]["mean"],
                           whole[1]["batch_stats"]["stack"]["BatchNorm_0"]["mean"])  # fmt: skip


def test_the_idle_ticks_leave_no_nan_in_the_gradient():
    x = jax.random.normal(jax.random.key(1), (8, 6))
    init = jax.jit(lambda key, x: lm.ScannedBlocks(_UnitBlock, 4).init(key, x, train=False))
    variables = init(jax.random.key(0), x)
    (got, _), (want, _) = (_stack_gradients(s, 4, variables, x, _UnitBlock) for s in (4, 1))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(to_numpy(got)))
    assert_trees_close(to_numpy(got), to_numpy(want), rtol=2e-5, atol=1e-6)


def test_a_pipeline_that_cannot_apply_is_refused_in_one_line():
    wrn = lm.workload("wrn-16-1", 8, image_size=8)  # six stacks of one block
    with pytest.raises(
        ValueError,
        match=r"pipeline=2 divides none of the model's block stacks "
        r"\(lengths \[1, 1, 1, 1, 1, 1\]; stage counts that divide one: none\)",
    ):
        lm.build(wrn, lm.Plan(pipeline=2)).analyze()
    wrn = lm.workload("wrn-28-2", 8, image_size=8)  # stacks of 1 and 3 blocks: 3 stages only
    with pytest.raises(ValueError, match=r"\[1, 3, 1, 3, 1, 3\]; stage counts that divide one: "
                       r"\[3\]"):  # fmt: skip
        lm.build(wrn, lm.Plan(pipeline=4)).analyze()
    user = lm.custom_workload(
        "mlp", MLP(), classification_batch(8), loss=lm.classifier_loss_fn,
        optimizer=optax.sgd(0.1), init=lambda m, rng, b: m.init(rng, b["image"]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="it has no ScannedBlocks stack"):
        lm.build(user, lm.Plan(pipeline=2)).analyze()
    with pytest.raises(ValueError, match="pipeline_microbatches=3 does not divide the 8"):
        lm.build(lm.workload("wrn-22-1", 8, image_size=8),
                 lm.Plan(pipeline=2, pipeline_microbatches=3)).analyze()  # fmt: skip
    with pytest.raises(ValueError, match=r"pipeline=16 needs 16 devices; JAX sees 8"):
        lm.Plan(pipeline=16).mesh()
    with pytest.raises(ValueError, match=r"the mesh \(data=4, stage=4\) needs 16 devices: "
                       "JAX sees 8"):  # fmt: skip
        lm.Plan(pipeline=4, shard="dp", devices=4).mesh()


def test_the_command_line_refuses_a_pipeline_with_compressed_gradients_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "--pipeline", "2", "--shard", "dp", "--grad-compression", "int8"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1
    assert "pipeline=2 runs with grad_compression in ['none'] only (got 'int8')" in lines[0]


@pytest.mark.parametrize("model, shard", [("dynamicconv", "zero3"), ("wrn", "zero2")])
def test_stages_beside_data_parallelism_equal_the_one_device_step(model, shard):
    """A (data 2, stage 2) mesh: each data device pipelines its half of the batch over its
    two stages. The stacked leaves split over both axes where ZeRO partitions them (the
    stages along the blocks, the data devices along another axis: zero3 gathers a block's
    parameters inside its stage), over the stages alone where it does not (zero2's
    parameters). WRN-22-1 with one microbatch: BatchNorm's statistics over the whole batch,
    as on one device; its optimizer state kept in host memory between steps (ZeRO-Offload's
    placement beside the stages)."""
    if model == "wrn":
        work, microbatches = lm.workload("wrn-22-1", 8, image_size=8), 1
        stack = ("group2_rest", "stack")
    else:
        work, microbatches = lm.workload("dynamicconv-small", 8, seq_len=6, **TRANSLATION), 0
        stack = ("encoder_k3_0", "stack")
    plan = lm.Plan(pipeline=2, pipeline_microbatches=microbatches, shard=shard, devices=2,
                   optimizer_memory="pinned_host" if model == "wrn" else "device")  # fmt: skip
    state, setup = _compare(work, plan)
    stage, data = pipeline_lib.STAGE, "data"
    assert setup.plan.mesh().shape == {data: 2, stage: 2}
    kernels = [leaf for leaf in jax.tree.leaves(state.params[stack[0]][stack[1]])
               if leaf.ndim >= 3]  # fmt: skip
    assert kernels and all(k.sharding.spec[0] == stage for k in kernels)
    assert all((data in k.sharding.spec[1:]) == (shard == "zero3") for k in kernels)
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state)
               if leaf.shape in {k.shape for k in kernels}]  # fmt: skip
    assert moments and all(m.sharding.spec[0] == stage for m in moments)
    if model == "wrn":  # ZeRO-Offload beside the stages: the slices kept in host memory
        assert {m.sharding.memory_kind for m in moments} == {"pinned_host"}
    assert all((data in m.sharding.spec[1:]) == (shard != "dp") for m in moments)
    found = {v.technique: v for v in setup.verdicts()}
    assert found["pipeline"].took_effect and found["shard"].took_effect
    assert "on each of 2 data-parallel devices" in found["pipeline"].evidence


def test_lowmem_analyze_gives_the_per_device_bytes_of_the_stages(capsys):
    """Over 2 stages each device holds half of the stacked blocks' parameters and optimizer
    state: XLA's argument bytes per device fall against the one-device step's."""
    code = cli.main(["analyze", "--model", "wrn-22-1", "--batch-size", "8", "--pipeline", "2",
                     "--json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["mesh_devices"] == 2 and result["config"]["devices"] == 0
    assert result["xla_vs_single_device"]["argument_bytes"] < 0.75
    (verdict,) = [v for v in result["verdicts"] if v["technique"] == "pipeline"]
    assert verdict["took_effect"] and "split over 2 stages" in verdict["evidence"]


@settings(max_examples=4, deadline=None)
@given(setting=st.sampled_from(list(_settings())))
@example(setting=next(s for s in _settings() if s[1].remat == "sqrt"))
@example(setting=next(s for s in _settings() if s[1].activations == "int8"))
def test_a_pipeline_with_any_other_setting_refuses_in_one_line_or_both_take_effect(setting):
    """The pipeline beside each other technique's settings (tests/test_technique.py's, a
    sample each run): refused in one line naming a field of one of them, or both verdicts
    say they took effect (where the other can act on this model)."""
    name, plan = setting
    work = lm.workload("dynamicconv-small", 8, seq_len=6, **TRANSLATION)
    fields = {f.name for t in TECHNIQUES if t.name in (name, "pipeline") for f in t.fields}
    try:
        plan = dataclasses.replace(plan, pipeline=2)
        setup = lm.build(work.with_input_dtype(plan.input_dtype), plan)
        found = {v.technique: v for v in setup.verdicts()}
    except ValueError as err:
        line = str(err).splitlines()[0]
        assert any(f in line for f in fields), (setting, line)
        return
    assert found["pipeline"].took_effect, found["pipeline"]
    assert name in found, (setting, found)


def test_remat_weighs_the_residuals_the_stages_save():
    """Remat's verdict inlines the checkpoints inside the pipeline's shard_map too (it said
    "not weighed" there)."""
    work = lm.workload("wrn-22-1", 8, image_size=8)
    found = {v.technique: v for v in lm.build(work, lm.Plan(remat="full", pipeline=2)).verdicts()}
    assert found["pipeline"].took_effect
    saved = found["remat"].evidence.split("saved residuals ")[1].split(" MiB")[0]
    without, with_ = (float(x) for x in saved.split(" -> "))
    assert with_ < without
