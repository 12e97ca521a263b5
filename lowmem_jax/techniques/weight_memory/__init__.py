"""Weight streaming (``weight_memory``): every parameter in host memory between steps, each
moved to the device where the step uses it: a stack's blocks one at a time in its loop.

With ``weight_memory="pinned_host"`` every parameter lives in page-locked host memory between
steps, laid out by :func:`state_shardings`. The model moves them in through two layouts, both a
:class:`~.streaming.ToDevice` (move, then cast to the compute dtype):
``param_layout`` for a :class:`~lowmem_jax.ScannedBlocks` stack (``[n, ...]``, its leading axis
the blocks): inside the loop it moves one block's parameters, inside the block's checkpoint
(remat is required for such a model), so the backward pass moves them again rather than
keeping every block's copy; a stack of one block (run outside a loop) is moved before it is
indexed.
``outer_param_layout`` for the layers outside the stacks (stem, classifier, embedding tables,
output projection): moved where each is used (the bundled WideResNet and DynamicConv Transformer
take both; ``streamed_layers="stacks"`` keeps these on the device and streams the stacks
alone). The transpose of a move sends the gradient back to host memory. The update runs where
the state and the parameters live (``optimizer_memory="pinned_host"``, ``optimizer_update="host"``:
:class:`lowmem_jax.techniques.shard.offload.HostUpdate` applies it there too). Between steps the
device holds no parameter; during a step, one unit at a time: a stack's block or an outer layer
(:func:`units`). Under float16's loss scaling the streamed gradients are unscaled on the host
(:func:`lowmem_jax.compose.step.scaled_grad_fn`).

Any other Linen model (no layouts) streams through its reads: inside the step its parameters in
host memory reach the layers as :class:`~.streaming.StreamedLeaf` boxes (Flax's
``nn.map_variables`` over the model's call), each moved and cast where a layer reads it, and
every such layer runs under its own checkpoint
(:func:`lowmem_jax.blocks.lazy_layers.checkpoint_lazy_layers`), so its backward pass moves its
weights again; inside a block that remat already checkpoints (a ``remat_blocks`` class, an
``nn.scan`` body) the block's backward pass does, one block's weights at a time. With remat over the
whole forward (a model without repeated blocks) that backward pass holds every layer's moved weights
at once: ``remat="none"`` suits such a model. An NNX model's ``nnx.Param`` values are boxed
the same way for the length of its call.

The check (:func:`_took_effect`) reads the traced step: every equation outside the host's
computation that reads host memory must be a move
(:func:`lowmem_jax.core.jaxprs.host_memory_reads`), so no part of the step brings a whole stack to
the device. XLA:CPU has one memory, so the bytes show only on a GPU
(``benchmarks/weight_streaming.py`` probes the same arrangement there).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lowmem_jax.blocks import lazy_layers
from lowmem_jax.blocks import scanned as scanned_blocks
from lowmem_jax.core import base, jaxprs
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.technique import PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import LayoutHooks, ModelHooks, ReportHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.weight_memory.streaming import (
    StreamedLeaf,
    ToDevice,
    read_where_used,
    units,
)

__all__ = ["TECHNIQUE", "state_shardings", "units", "ToDevice", "StreamedLeaf"]

#: The layers weight streaming keeps in host memory: every one, or the stacks' blocks alone.
STREAMED_LAYERS = ("all", "stacks")


def _validate(plan) -> None:
    sharding_lib.check_memory_kind(plan.weight_memory, "weight_memory")
    base.choose(dict.fromkeys(STREAMED_LAYERS), plan.streamed_layers, "streamed_layers")
    if plan.weight_memory == "device":
        if plan.streamed_layers != "all":
            raise ValueError(
                f"streamed_layers={plan.streamed_layers!r} needs weight_memory='pinned_host' "
                "(the layers it keeps in host memory)"
            )
        return
    needs = {
        "optimizer_memory": ("pinned_host", "the update runs where the streamed weights live"),
        "optimizer_update": ("host", "the update runs where the streamed weights live"),
        "shard": ("none", "streaming runs on one device"),
        "pipeline": (1, "streaming runs on one device"),
        "sparsity": (None, "a sparse layer's stored form is read outside its block's loop"),
    }
    for field, (value, why) in needs.items():
        if getattr(plan, field) != value:
            raise ValueError(
                f"weight_memory='pinned_host' needs {field}={value!r} (got "
                f"{getattr(plan, field)!r}): {why}"
            )


def _configure_model(model, plan):
    if plan.weight_memory == "device":
        return model
    to_device = ToDevice(plan.policy.compute_dtype)
    linen = not isinstance(model, nnx.Module)
    if hasattr(model, "param_layout") and plan.remat == "none":
        raise ValueError(
            "weight_memory='pinned_host' needs remat (e.g. full) on a model with layouts: each "
            "block's weights are moved again in the backward pass, not kept on the device"
        )
    if plan.streamed_layers == "stacks":
        if not (linen and hasattr(model, "param_layout")):
            raise ValueError(
                "streamed_layers='stacks' needs a model with a param_layout field (the bundled "
                f"WideResNet and DynamicConv) to find its stacks; {type(model).__name__} has none"
            )
        return model.clone(param_layout=to_device)
    if linen and hasattr(model, "param_layout") and hasattr(model, "outer_param_layout"):
        return model.clone(param_layout=to_device, outer_param_layout=to_device)
    # Any other model: each layer moves what it reads, under its own checkpoint, so that its
    # backward pass moves it again rather than keeping the forward pass's copy
    return lazy_layers.checkpoint_lazy_layers(read_where_used(model, plan))


def _streamed(path, plan) -> bool:
    """A parameter ``plan`` keeps in host memory: every one, or a stack's (``stacks``)."""
    names = [getattr(key, "key", None) for key in path]
    return plan.streamed_layers == "all" or scanned_blocks.in_stack(names)


def state_shardings(state, plan):
    """Every streamed parameter (:func:`_streamed`) in ``plan.weight_memory``, every other leaf
    as placed by default; ``None`` where the weights live on the device."""
    if plan.weight_memory == "device":
        return None
    mesh = plan.mesh()
    host = NamedSharding(mesh, PartitionSpec(), memory_kind=plan.weight_memory)
    default = NamedSharding(mesh, PartitionSpec())
    params = jax.tree_util.tree_map_with_path(
        lambda path, _: host if _streamed(path, plan) else default, state.params
    )
    return jax.tree.map(lambda _: default, state).replace(params=params)


def _took_effect(evidence, plan):
    """The parameters in host memory, the moves (in the loops and outside), and no device
    computation reading host memory."""
    if plan.weight_memory == "device":
        return None
    paths = jax.tree_util.tree_flatten_with_path(evidence.state.params)[0]
    leaves = [x for _, x in paths]
    host = [x for x in leaves if getattr(x, "sharding", None) is not None
            and x.sharding.memory_kind == plan.weight_memory]  # fmt: skip
    wanted = sum(_streamed(path, plan) for path, _ in paths)
    streamed = sum(x.size * x.dtype.itemsize for x in host)
    sizes = units(evidence.state.params, stacks_only=plan.streamed_layers == "stacks")
    largest = max(sizes, key=sizes.get)
    moves = [
        loops for eqn, loops in evidence.equations()
        if eqn.primitive.name == "device_put"
        and any(v.aval.memory_space == jax.memory.Space.Host for v in eqn.invars)
    ]  # fmt: skip
    reads = jaxprs.host_memory_reads(evidence.jaxpr)
    said = (
        f"{len(host)} of {len(leaves)} parameter arrays ({streamed / MIB:.2f} MiB) streamed from "
        f"{plan.weight_memory}, {len(moves)} moves to the device ({sum(map(bool, moves))} "
        f"inside loops), a unit at a time ("
        + ("a stack's block, a layer outside the stacks" if plan.streamed_layers == "all"
           else "a stack's block; the layers outside the stacks on the device")
        + f"), the largest {largest} ({sizes[largest] / MIB:.2f} MiB)"
    )  # fmt: skip
    if reads:
        said += f"; but {len(reads)} device computations read host memory ({reads[0]})"
    ok = len(host) == wanted and bool(moves) and not reads
    return Verdict("weight_memory", ok, said)


TECHNIQUE = Technique(
    name="weight_memory",
    fields=(
        PlanField(
            "weight_memory",
            str,
            "device",
            "where the parameters live between steps: ``device``, or ``pinned_host`` (weight "
            "streaming: a stack's blocks moved to the device one at a time in its loop, each "
            "layer outside the stacks where it is used, each gradient back; any other Linen "
            "model's layers each where they read them; needs ``optimizer_memory='pinned_host'`` "
            "and ``optimizer_update='host'``, and remat on a model with layouts: "
            ":mod:`lowmem_jax.techniques.weight_memory`).",
            help="where the parameters live between steps: device, or pinned_host (streamed "
            "to the device a block or layer at a time; needs --optimizer-memory pinned_host "
            "--optimizer-update host, and --remat on the bundled models; XLA:CPU has one "
            "memory, so the bytes it saves show on a GPU only)",
            choices=sharding_lib.MEMORY_KINDS,
            omit_default=True,
        ),
        PlanField(
            "streamed_layers",
            str,
            "all",
            "the parameters ``weight_memory='pinned_host'`` keeps in host memory: ``all``, or "
            "``stacks`` (the scanned blocks' alone; the layers outside the stacks, such as "
            "embedding tables and the output projection, stay on the device).",
            help="with --weight-memory pinned_host: stream all parameters, or the stacks' "
            "blocks alone (stacks: the layers outside them stay on the device)",
            choices=STREAMED_LAYERS,
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: (
        None
        if plan.weight_memory == "device"
        else "weights streamed" + (" (stacks)" if plan.streamed_layers == "stacks" else "")
    ),
    # The same arithmetic with the weights elsewhere between steps: inside every envelope.
    envelope=None,
    # Not searched: XLA:CPU, where the planner compiles, drops memory kinds (one memory).
    axis=None,
    model=ModelHooks(configure=_configure_model),
    layout=LayoutHooks(state_shardings=state_shardings),
    report=ReportHooks(verdict=_took_effect),
)
