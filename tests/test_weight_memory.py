"""Weight streaming (Plan.weight_memory="pinned_host"): every parameter in host memory between
steps, moved to the device a block at a time inside a stack's loop, a layer at a time outside.

XLA:CPU has one memory, so these tests check what it can show: the same values as the step with
the weights on the device, where each leaf lives between steps, and, in the traced step, that
nothing but a move reads host memory outside the host's own computation (JAX's avals carry each
value's memory space)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BNNet, assert_trees_close, classification_batch, to_numpy
from flax import nnx
from jax.sharding import SingleDeviceSharding

import lowmem_jax as lm
from lowmem_jax import workloads
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.core import jaxprs
from lowmem_jax.planning.search import plan_name
from lowmem_jax.techniques import weight_memory
from lowmem_jax.techniques.shard.offload import on_host

HOST = {"optimizer_memory": "pinned_host", "optimizer_update": "host", "remat": "full"}
STREAMED = lm.Plan(weight_memory="pinned_host", **HOST)


def _kinds(tree):
    return [leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)]


def test_streamed_weights_train_as_the_device_resident_ones_and_stay_in_host_memory():
    """Three steps of WRN-22-1 in mixed float16 (its stacks stream, a group's lone first block
    too, the stem and head where they run; the gradients unscaled on the host), the second with
    a NaN pixel (skipped, the loss scale halved): the same states as the plan without
    streaming, every parameter in pinned_host before and after every step."""
    work = workloads.workload("wrn-22-1", batch_size=8, image_size=8)
    fields = {**HOST, "precision": "mixed_fp16"}
    runs = []
    for plan in (lm.Plan(**fields), lm.Plan(weight_memory="pinned_host", **fields)):
        setup = workloads.build(work, plan)
        batch = setup.example_batch()
        state = setup.init_state(batch)
        states = []
        for i in range(3):
            nan = batch if i != 1 else {**batch, "image": batch["image"].at[0, 0, 0, 0].set(np.nan)}
            state, _ = setup.step(state, nan)  # donated: kept as numpy
            states.append(to_numpy(state))
        runs.append((states, state))
    for plain, streamed in zip(runs[0][0], runs[1][0], strict=True):
        assert_trees_close(streamed, plain, rtol=1e-6, atol=1e-7)
    last = runs[1][1]
    assert last.skipped_steps == 1 and float(last.loss_scale.loss_scale) == 2.0**14
    assert set(_kinds(last.params)) == set(_kinds(last.opt_state)) == {"pinned_host"}
    assert set(_kinds(runs[0][1].params)) == {"device"}


@pytest.mark.parametrize("model", ["wrn-22-1", "dynamicconv-small"])
def test_the_verdict_counts_the_moves_and_finds_no_device_computation_on_host_memory(model):
    setup = workloads.build(workloads.workload(model, batch_size=8, seq_len=6), STREAMED)
    (verdict,) = [v for v in setup.verdicts() if v.technique == "weight_memory"]
    assert verdict.took_effect, verdict.evidence
    assert "streamed from pinned_host" in verdict.evidence and "read host" not in verdict.evidence
    n = len(jax.tree.leaves(setup.abstract_state().params))
    assert f"{n} of {n} parameter arrays" in verdict.evidence


def test_the_verdict_says_so_when_a_device_computation_reads_the_streamed_weights(monkeypatch):
    """A layout that computes on a block's weights before moving them (here a multiply by one)
    reads host memory on the device: the check finds it and the technique did not take effect
    (a value mixing host and device memory JAX refuses itself, at trace time)."""

    def computes_first(self, p):
        return jax.device_put(jax.tree.map(lambda a: a * 1.0, p), jax.memory.Space.Device)

    monkeypatch.setattr(lm.techniques.weight_memory.ToDevice, "__call__", computes_first)
    setup = workloads.build(workloads.workload("wrn-22-1", batch_size=8, image_size=8), STREAMED)
    (verdict,) = [v for v in setup.verdicts() if v.technique == "weight_memory"]
    assert not verdict.took_effect
    assert "device computations read host memory (mul)" in verdict.evidence


def test_host_memory_reads_finds_device_computation_on_host_values_only():
    host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.device_put(jnp.ones(3), host)

    def moved(a):
        return jax.device_put(a, jax.memory.Space.Device) * 2

    def scanned(stack):  # a loop over a host stack, each slice moved first
        return jax.lax.scan(lambda h, w: (h + moved(w), None), jnp.zeros(3), stack)[0]

    assert jaxprs.host_memory_reads(jax.make_jaxpr(moved)(x).jaxpr) == []
    assert jaxprs.host_memory_reads(jax.make_jaxpr(on_host(lambda a: a * 2))(x).jaxpr) == []
    stack = jax.device_put(jnp.ones((4, 3)), host)
    assert jaxprs.host_memory_reads(jax.make_jaxpr(scanned)(stack).jaxpr) == []
    unmoved = jax.make_jaxpr(lambda s: jax.lax.scan(lambda h, w: (h + w, None), 0.0 * s[0], s))
    assert "add" in jaxprs.host_memory_reads(unmoved(stack).jaxpr)


@pytest.mark.parametrize(
    "fields, needs",
    [
        ({}, "optimizer_memory='pinned_host'"),
        ({"optimizer_memory": "pinned_host"}, "optimizer_update='host'"),
        ({**HOST, "sparsity": lm.sparsity.SparseConfig(density=0.5)}, "sparsity=None"),
    ],
)
def test_a_setting_it_cannot_stream_under_is_refused_in_one_line(fields, needs):
    with pytest.raises(ValueError, match="weight_memory='pinned_host' needs") as raised:
        lm.Plan(weight_memory="pinned_host", **fields)
    assert needs in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=r"Unknown weight_memory='disk'; allowed values"):
        lm.Plan(weight_memory="disk")
    with pytest.raises(ValueError, match=r"^streamed_layers='stacks' needs weight_memory="):
        lm.Plan(streamed_layers="stacks")
    with pytest.raises(ValueError, match=r"Unknown streamed_layers='some'; allowed values"):
        lm.Plan(streamed_layers="some", weight_memory="pinned_host", **HOST)


def test_the_stacks_alone_stream_and_the_layers_outside_stay_on_the_device():
    """``streamed_layers="stacks"`` (the first arrangement, kept as an option): the stacks'
    blocks in host memory, the stem, final norm and classifier on the device; a step equals the
    plan without streaming, and the verdict counts the stacks' arrays as all it should stream."""
    work = workloads.workload("wrn-16-1", batch_size=8, image_size=8)
    stacks = lm.Plan(weight_memory="pinned_host", streamed_layers="stacks", **HOST)
    got = []
    for plan in (lm.Plan(**HOST), stacks):
        setup = workloads.build(work, plan)
        batch = setup.example_batch()
        state, _ = setup.step(setup.init_state(batch), batch)
        got.append(to_numpy(state))
    assert_trees_close(got[1], got[0], rtol=1e-6, atol=1e-7)
    kinds = {path[0].key: leaf.sharding.memory_kind
             for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]}  # fmt: skip
    outside = {"stem", "bn_final", "classifier"}
    assert {kinds[k] for k in outside} == {"device"}
    assert {v for k, v in kinds.items() if k not in outside} == {"pinned_host"}
    (verdict,) = [v for v in setup.verdicts() if v.technique == "weight_memory"]
    assert verdict.took_effect and "the layers outside the stacks on the device" in verdict.evidence
    assert "weights streamed (stacks)" in plan_name(stacks)


def test_lowmem_analyze_streams_the_weights_and_refuses_a_bad_flag(capsys):
    flags = ["--model", "wrn-22-1", "--batch-size", "8", "--weight-memory", "pinned_host"]
    with pytest.raises(SystemExit) as exited:  # no --optimizer-memory pinned_host
        cli.main(["analyze", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "weight_memory='pinned_host' needs optimizer_memory" in err
    host_flags = ["--optimizer-memory", "pinned_host", "--optimizer-update", "host"]
    assert cli.main(["analyze", *flags, *host_flags, "--remat", "full"]) == 0
    out = capsys.readouterr().out
    assert "weight_memory" in out and "streamed from pinned_host" in out


# Mixed precision on one microbatch: WRN-22-1's test above; fp32: the CLI test below.
@pytest.mark.parametrize("precision, microbatches", [("fp16", 2)])
def test_the_transformer_s_streamed_layers_train_as_the_device_resident_ones(
    precision, microbatches
):
    """The small DynamicConv Transformer (encoder and decoder stacks, each kernel size a stack;
    embeddings and output projection outside them, moved where used): two steps equal to the
    plan without streaming; in float16 (no master copy, loss scaling) the streamed gradients
    are unscaled on the host;
    over 2 microbatches the streamed blocks' gradients are summed in host memory, by the host."""
    work = workloads.workload("dynamicconv-small", batch_size=8, seq_len=6)
    fields = {**HOST, "precision": precision, "microbatches": microbatches}
    got = []
    for plan in (lm.Plan(**fields), lm.Plan(weight_memory="pinned_host", **fields)):
        setup = workloads.build(work, plan)
        batch = setup.example_batch()
        state = setup.init_state(batch)
        for _ in range(2):
            state, metrics = setup.step(state, batch)
        got.append((to_numpy(state), float(metrics["loss"]), _kinds(state.params)))
    assert_trees_close(got[1][0], got[0][0], rtol=1e-6, atol=1e-7)
    assert got[1][1] == pytest.approx(got[0][1], rel=1e-6)
    assert set(got[1][2]) == {"pinned_host"}  # the embeddings and output projection too


class _ScannedNet(nn.Module):
    """A user's Linen model: a Dense stem, three residual Dense + BatchNorm blocks as one
    ``nn.scan`` stack (its own, not a :class:`~lowmem_jax.ScannedBlocks`), a Dense head."""

    @nn.compact
    def __call__(self, x, train=True):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                y = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(h))
                return h + nn.relu(y), None

        stack = nn.scan(Block, variable_axes={"params": 0, "batch_stats": 0},
                        split_rngs={"params": True}, length=3)  # fmt: skip
        h, _ = stack()(nn.Dense(16)(x), None)
        return nn.Dense(3)(h)


class _NNXNet(nnx.Module):
    """A user's NNX model: Linear, BatchNorm, ReLU, Linear."""

    def __init__(self, rngs):
        self.hidden, self.norm = nnx.Linear(5, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.norm(self.hidden(x))))


def _nnx_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@pytest.mark.parametrize("name, remat", [("bnnet", "none"), ("scanned", "full"), ("nnx", "none")])
def test_any_model_streams_each_layer_s_parameters_where_it_reads_them(name, remat):
    """A Linen or NNX model without layouts: every parameter in host memory, each layer's moved
    to the device where the layer reads it (a box Flax unboxes, or NNX converts), under the
    layer's own checkpoint (remat none) or its block's (remat full: the scan's repeated block),
    its gradient back; two steps (BatchNorm, Adam, the update on the host) equal the plan
    without streaming, and the verdict finds moves, in the scan's loop too, and no device
    computation on host memory."""
    batch = classification_batch(8)
    if name == "nnx":
        model = _NNXNet(nnx.Rngs(0))
        work = lm.custom_workload(name, model, batch, loss=_nnx_loss, optimizer=optax.adam(1e-2))
    else:
        model = BNNet() if name == "bnnet" else _ScannedNet()
        work = lm.custom_workload(
            name, model, batch, loss=lm.classifier_loss_fn, optimizer=optax.adam(1e-2),
            init=lambda m, rng, b: m.init(rng, b["image"], train=False),
        )  # fmt: skip
    got = []
    fields = {**HOST, "remat": remat}
    for plan in (lm.Plan(**fields), lm.Plan(weight_memory="pinned_host", **fields)):
        setup = lm.build(work, plan)
        state = setup.init_state(batch)
        for _ in range(2):
            state, _ = setup.step(state, batch)
        got.append(to_numpy(state))
    assert_trees_close(got[1], got[0], rtol=1e-6, atol=1e-7)
    assert set(_kinds(state.params)) == {"pinned_host"}
    (verdict,) = [v for v in setup.verdicts() if v.technique == "weight_memory"]
    assert verdict.took_effect and "device computations read host memory" not in verdict.evidence
    arrays = len(jax.tree.leaves(state.params))
    moves, in_loops = map(int, re.search(r"(\d+) moves to the device \((\d+) inside loops",
                                         verdict.evidence).groups())  # fmt: skip
    assert moves >= 2 * arrays  # each moved again by its checkpoint's backward pass
    assert (in_loops > 0) == isinstance(model, _ScannedNet)


# A model without layouts needs no remat: each layer that reads a streamed weight is checkpointed.
PER_LAYER = lm.Plan(weight_memory="pinned_host", **{**HOST, "remat": "none"})


def test_a_hand_written_step_streams_from_the_state_train_state_create_places():
    """``TrainState.create`` lays the state out as the plan's techniques do (the parameters in
    host memory here), so a step written by hand with ``make_train_step`` streams as
    ``lm.build``'s does."""
    model = PER_LAYER.configure_model(BNNet())
    batch = classification_batch(8)
    variables = model.init(jax.random.PRNGKey(0), batch["image"], train=False)
    tx = PER_LAYER.wrap_optimizer(optax.adam(1e-2), variables["params"])
    state = lm.TrainState.create(params=variables["params"], tx=tx, plan=PER_LAYER,
                                 model_state={"batch_stats": variables["batch_stats"]})  # fmt: skip
    assert set(_kinds(state.params)) == {"pinned_host"}
    step = lm.make_train_step(lm.classifier_loss_fn(model), tx, PER_LAYER)
    state, metrics = step(state, batch)
    assert int(metrics["skipped_steps"]) == 0 and set(_kinds(state.params)) == {"pinned_host"}


def test_a_parameter_read_twice_sums_its_gradients_in_host_memory_and_the_verdict_says_so():
    """Read twice (once unboxed by ``self.param``, once raw: GPT-2's tied output layer reads its
    embedding so), a streamed parameter is moved twice and its two gradients come back to host
    memory separately, where the device adds them: the verdict names that computation and says
    streaming did not fully take effect, rather than passing it."""

    class ReadTwice(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            w = self.param("w", nn.initializers.lecun_normal(), (5, 3))
            return x @ w + x @ self.get_variable("params", "w")[...]

    batch = classification_batch(8)
    work = lm.custom_workload(
        "read-twice", ReadTwice(), batch, loss=lm.classifier_loss_fn, optimizer=optax.sgd(0.1),
        init=lambda m, rng, b: m.init(rng, b["image"]),
    )  # fmt: skip
    (verdict,) = [v for v in lm.build(work, PER_LAYER).verdicts()
                  if v.technique == "weight_memory"]  # fmt: skip
    assert not verdict.took_effect
    assert "device computations read host memory (add" in verdict.evidence


def test_a_model_streaming_cannot_reach_is_refused_in_one_line():
    """The stacks alone of a model without a ``param_layout`` (nothing names its stacks), and
    a model with layouts without remat: refused where the plan configures the model."""
    stacks = lm.Plan(weight_memory="pinned_host", streamed_layers="stacks",
                     **{**HOST, "remat": "none"})  # fmt: skip
    for model in (BNNet(), _NNXNet(nnx.Rngs(0))):
        with pytest.raises(ValueError, match=r"needs a model with a param_layout field") as e:
            stacks.configure_model(model)
        assert f"{type(model).__name__} has none" in str(e.value) and "\n" not in str(e.value)
    no_remat = lm.Plan(weight_memory="pinned_host", **{**HOST, "remat": "none"})
    with pytest.raises(ValueError, match=r"needs remat \(e.g. full\) on a model with layouts"):
        no_remat.configure_model(lm.models.WideResNet(depth=10, width=1))


def test_the_readme_s_weight_streaming_figures_are_the_benchmarks():
    """The README's technique row and distributed.md quote, for each benchmark, the largest
    unit streaming moves to the device at once (a stack's block or a layer outside the stacks;
    analytic: the state's shapes) and its largest block: recomputed here from the models. Every
    parameter is laid out in host memory."""
    import pathlib

    root = pathlib.Path(__file__).parent.parent
    readme = " ".join((root / "README.md").read_text().split())
    docs = " ".join((root / "docs/distributed.md").read_text().split())
    mib = 2**20
    figures = {}
    for model, batch in (("wrn-28-2", 128), ("dynamicconv-iwslt", 100)):
        state = workloads.build(workloads.workload(model, batch), STREAMED).abstract_state()
        leaves = jax.tree.leaves(state.params)
        assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
        sizes = weight_memory.units(state.params)
        assert sum(sizes.values()) < sum(x.size * x.dtype.itemsize for x in leaves)  # per block
        blocks = [
            b for name, b in sizes.items() if name.startswith(("group", "encoder", "decoder"))
        ]
        total = sum(x.size * x.dtype.itemsize for x in leaves)
        figures[model] = (max(sizes.values()) / mib, total / mib, max(blocks) / mib)
    (wrn, wrn_total, wrn_block), (dc, dc_total, dc_block) = figures.values()
    assert (f"at most {wrn:.2f} of WRN-28-2's {wrn_total:.2f} MiB, {dc:.1f} of the IWSLT "
            f"transformer's {dc_total:.1f}") in readme  # fmt: skip
    assert f"WRN-28-2 {wrn:.2f} of its {wrn_total:.2f} MiB (a block)" in docs
    assert f"{dc / dc_block:.1f} times its largest layer's {dc_block:.1f} MiB" in docs
    assert wrn == wrn_block and dc <= 2 * dc_block  # the 2 blocks, both benchmarks


def test_the_transformer_moves_each_outer_table_once_the_activations_it_meets_exist():
    """The embedding tables and the output projection are moved to the device after an
    optimization barrier (the target tables with what they meet: the encoder's output, the
    decoder's output; the source table, used first, alone), so XLA cannot move them at the
    step's start and hold them through the passes before their use."""
    work = workloads.workload("dynamicconv-small", batch_size=8, seq_len=6)
    setup = workloads.build(work, STREAMED)
    state = setup.abstract_state()
    step = setup.step.__wrapped__  # the traced step, not its jit (as the verdicts trace it)
    jaxpr = jax.make_jaxpr(step)(state, setup.abstract_batch()).jaxpr
    host = jax.memory.Space.Host
    joined = {
        tuple(v.aval.shape for v in eqn.invars)
        for eqn, _ in jaxprs.equations(jaxpr)
        if eqn.primitive.name == "optimization_barrier"
        and getattr(eqn.invars[0].aval, "memory_space", None) == host
    }
    vocab, c = state.params["embed_out"].shape
    src = state.params["src_embed"]["embedding"].shape
    b, t = setup.abstract_batch()["tgt_in"].shape
    assert joined == {(src,), ((vocab, c), (b, t, c))}  # each later table with what it meets
    moves = [eqn for eqn, depth in jaxprs.equations(jaxpr) if depth == 0
             and eqn.primitive.name == "device_put"
             and eqn.params["devices"] == (jax.memory.Space.Device,)
             and eqn.invars[0].aval.shape in (src, (vocab, c))
             and getattr(eqn.invars[0].aval, "memory_space", None) == host]  # fmt: skip
    barriers = {id(v) for eqn, _ in jaxprs.equations(jaxpr)
                if eqn.primitive.name == "optimization_barrier" for v in eqn.outvars}  # fmt: skip
    assert len(moves) >= 3 and all(id(m.invars[0]) in barriers for m in moves)


def test_shared_decoder_embeddings_moved_where_used_compute_what_attend_computes():
    """With ``share_decoder_embeddings`` the output projection is the decoder's input table,
    moved where it is used: logits and gradients equal ``nn.Embed.attend``'s (float32
    tolerance)."""
    from lowmem_jax.models import DynamicConvTransformer

    model = DynamicConvTransformer.small(share_decoder_embeddings=True, dropout=0.0)
    src = jnp.array([[3, 4, 5, 1], [6, 7, 1, 1]])
    tgt = jnp.array([[2, 8, 9], [2, 10, 1]])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), src, tgt)["params"]
    moved = model.clone(outer_param_layout=lm.techniques.weight_memory.ToDevice())

    def loss(m, p):
        return jnp.sum(m.apply({"params": p}, src, tgt) ** 2)

    logits = [jax.jit(m.apply)({"params": params}, src, tgt) for m in (moved, model)]
    np.testing.assert_allclose(*logits, rtol=1e-5, atol=1e-6)  # an einsum against a dot
    grads = [jax.jit(jax.grad(lambda p, m=m: loss(m, p)))(params) for m in (moved, model)]
    assert_trees_close(*grads, rtol=1e-5, atol=1e-4)


def _zero_cotangents_through_barriers(setup) -> int:
    """Barrier operands that are a broadcast zero (a cotangent the differentiation made up)."""
    step = setup.step.__wrapped__
    jaxpr = jax.make_jaxpr(step)(setup.abstract_state(), setup.abstract_batch()).jaxpr
    eqns = [eqn for eqn, _ in jaxprs.equations(jaxpr)]
    zeros = {id(eqn.outvars[0]) for eqn in eqns if eqn.primitive.name == "broadcast_in_dim"
             and getattr(eqn.invars[0], "val", None) is not None
             and not np.any(eqn.invars[0].val)}  # fmt: skip
    return sum(id(v) in zeros for eqn in eqns if eqn.primitive.name == "optimization_barrier"
               for v in eqn.invars)  # fmt: skip


def test_the_moves_barriers_make_up_no_zero_cotangent(monkeypatch):
    """``at_use`` returns what it joined the parameter with, and the model goes on with that:
    had it dropped it, differentiating the barrier would materialise a zero cotangent of that
    activation's size (one more buffer in the compiled step: 7.8 MiB on the IWSLT transformer,
    XLA:CPU)."""
    work = workloads.workload("dynamicconv-small", batch_size=8, seq_len=6)
    assert _zero_cotangents_through_barriers(workloads.build(work, STREAMED)) == 0

    def dropped(layout, param, after=None):  # the barrier's second output unused
        param, _ = jax.lax.optimization_barrier((param, after))
        return layout(param), after

    monkeypatch.setattr(lm.models.dynamic_conv.model, "at_use", dropped)
    assert _zero_cotangents_through_barriers(workloads.build(work, STREAMED)) > 0


def test_lowmem_train_streams_a_translation_model_and_decodes_it(tmp_path, capsys):
    """Training streams every parameter; decoding (greedy and beam BLEU at the end) reads them
    whole, so the evaluator moves streamed parameters to the device first (it failed with
    ``memory_space of all inputs passed to dot_general must be the same`` before)."""
    flags = ["--dataset", "synthetic-copy", "--steps", "2", "--eval-every", "2",
             "--precision", "fp32", "--microbatches", "1", "--remat", "full",
             "--weight-memory", "pinned_host", "--optimizer-memory", "pinned_host",
             "--optimizer-update", "host", "--beam-size", "2", "--max-tokens", "256",
             "--checkpoint-dir", str(tmp_path / "ck")]  # fmt: skip
    assert cli.main(["train", *flags]) == 0
    out = capsys.readouterr().out
    assert "BLEU greedy" in out and "beam-2" in out


def test_a_layer_laid_out_where_it_runs_initialises_as_without_the_layout():
    """``with_layout`` maps a layer's parameters only when it runs: mapped at initialisation,
    the stored parameters were the laid-out ones (a bfloat16 cast's rounding kept, found by
    the mixed-precision test above)."""
    from lowmem_jax.models.wide_resnet import WideResNet

    images = jnp.ones((2, 8, 8, 3))
    model = WideResNet(depth=10, width=1)
    laid_out = model.clone(outer_param_layout=lm.techniques.weight_memory.ToDevice(jnp.bfloat16))
    init = [jax.jit(m.init, static_argnames="train")(jax.random.PRNGKey(0), images, train=False)
            for m in (model, laid_out)]  # fmt: skip
    assert_trees_close(init[1], init[0], rtol=0, atol=0)


def test_factorized_layers_stream_as_any_other():
    """WRN-22-1 with Tucker-factorized convolutions (the stem and classifier too): the factors
    move where their layer runs, in the stacks and outside them; two steps equal the plan
    without streaming."""
    from lowmem_jax.techniques.factorize import FactorConfig

    work = workloads.workload("wrn-22-1", batch_size=8, image_size=8)
    factorize = FactorConfig(method="tucker", compression=0.25, keep_first_last=False)
    got = []
    for memory in ("device", "pinned_host"):
        setup = workloads.build(work, lm.Plan(weight_memory=memory, factorize=factorize, **HOST))
        batch = setup.example_batch()
        state = setup.init_state(batch)
        for _ in range(2):
            state, _ = setup.step(state, batch)
        got.append(to_numpy(state))
    assert_trees_close(got[1], got[0], rtol=1e-6, atol=1e-7)
    assert set(got[1].params["stem"]) == {"first", "core", "last"}  # factorized, streamed


@pytest.mark.parametrize("stored, compute", [(jnp.float32, jnp.bfloat16), (jnp.int32, jnp.bfloat16),
                                             (jnp.float32, None)])  # fmt: skip
def test_a_streamed_leaf_states_the_shape_and_dtype_of_what_a_layer_reads(stored, compute):
    """``shape`` and ``dtype`` (``LazyLeaf``'s: the dense weights') are those of the moved
    array a layer receives, floating values cast to the compute dtype."""
    leaf = lm.techniques.weight_memory.StreamedLeaf(jnp.ones((3, 2), stored), compute)
    moved = leaf.dense()
    assert (leaf.shape, leaf.dtype) == (moved.shape, moved.dtype)
    assert moved.sharding.memory_kind == "device"
