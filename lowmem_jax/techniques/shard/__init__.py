"""ZeRO-style partitioning and offload (:mod:`.zero`, :mod:`lowmem_jax.core.mesh`): ``shard``,
``devices``, ``optimizer_memory``, ``optimizer_update``; compressed gradient communication
(:mod:`lowmem_jax.techniques.shard.compression`): ``grad_compression``, ``powersgd_rank``,
``topk_fraction``.

With ``plan.shard`` set, the step is one SPMD program over ``plan.mesh()``: the batch split over
its ``data`` axis, the state laid out by :func:`state_specs` (merged with the other techniques'
layouts) on the way in and out, from ``zero2`` on the gradients partitioned as the optimizer
state. ``optimizer_memory="pinned_host"``: the optimizer state lives in host memory between
steps, moved to the device for the update (after the gradient) and back; with
``optimizer_update="host"`` it stays there and the update runs there (ZeRO-Offload's way,
:mod:`lowmem_jax.techniques.shard.offload`).

With ``grad_compression`` (``dp`` or ``zero1``) each device's gradient, computed in a
``shard_map``, is reduced compressed with error feedback once per step by the outermost optimizer
(:class:`~lowmem_jax.techniques.shard.compression.CompressedGradients`); BatchNorm normalises with
each device's examples (as PyTorch's DistributedDataParallel), dropout from ``fold_in(rng,
device)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from lowmem_jax.blocks import scanned as scanned_blocks
from lowmem_jax.core import base
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import (
    LayoutHooks,
    ModelHooks,
    OptimizerHooks,
    ReportHooks,
    StepHooks,
)
from lowmem_jax.techniques.shard import compression as compression_lib
from lowmem_jax.techniques.shard import report_section as sharding_report
from lowmem_jax.techniques.shard.offload import (
    HOST_UPDATE,
    DeviceUpdate,
    HostUpdate,
    HostUpdateState,
)
from lowmem_jax.techniques.shard.zero import STAGES, Stage, stage

__all__ = ["TECHNIQUE", "state_specs", "state_shardings", "STAGES", "Stage", "stage"]


# The stages whose gradient is reduced whole on every device (compressed: grad_compression).
_COMPRESSIBLE = ("dp", "zero1")
#: Where the optimizer's update runs (``host``: :mod:`lowmem_jax.techniques.shard.offload`).
UPDATES = ("device", "host")


def _validate(plan) -> None:
    stage(plan.shard)
    devices = base.check_int(plan.devices, "devices", 0, " (0: all visible)")
    if devices and plan.shard == "none":
        raise ValueError(
            f"devices={devices} needs shard (dp, zero1, zero2 or zero3): without it the step "
            "runs on one device"
        )
    sharding_lib.check_memory_kind(plan.optimizer_memory, "optimizer_memory")
    base.choose(dict.fromkeys(UPDATES), plan.optimizer_update, "optimizer_update")
    host_update = (plan.optimizer_memory, plan.grad_compression) != ("pinned_host", "none")
    if plan.optimizer_update == "host" and host_update:
        raise ValueError(
            "optimizer_update='host' runs the update where the state lives: it needs "
            "optimizer_memory='pinned_host' and no grad_compression (got "
            f"{plan.optimizer_memory!r}, {plan.grad_compression!r})"
        )
    base.choose(dict.fromkeys(compression_lib.FORMATS), plan.grad_compression, "grad_compression")
    if plan.grad_compression != "none" and plan.shard not in _COMPRESSIBLE:
        raise ValueError(
            f"grad_compression={plan.grad_compression!r} needs shard=dp or zero1 (got "
            f"{plan.shard!r}): it reduces each device's whole gradient"
            + (", which zero2 and zero3 partition" if plan.shard != "none" else "")
        )
    base.check_int(plan.powersgd_rank, "powersgd_rank", 1)
    fraction = plan.topk_fraction
    number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not number or not 0 < fraction <= 1:
        raise ValueError(f"topk_fraction must be a number in (0, 1], got {fraction!r}")
    for field, default, method in (
        ("powersgd_rank", 4, "powersgd"),
        ("topk_fraction", 0.01, "topk"),
    ):
        if getattr(plan, field) != default and plan.grad_compression != method:
            raise ValueError(
                f"{field}={getattr(plan, field)} applies to grad_compression={method!r} only "
                f"(got {plan.grad_compression!r})"
            )


def state_specs(state: Any, plan: Any, num_shards: int) -> Any:
    """A :class:`~jax.sharding.PartitionSpec` per leaf of ``state`` (a
    :class:`lowmem_jax.TrainState` of arrays or shapes) under ``plan.shard``: the optimizer
    state partitioned from ``zero1`` on, the parameters at ``zero3``
    (:func:`lowmem_jax.core.mesh.leaf_spec`), everything else replicated."""
    zero = stage(plan.shard)
    specs = sharding_lib.tree_specs(state, num_shards, partition=False)
    opt = state.opt_state
    in_host = isinstance(opt, HostUpdateState)  # in host memory, updated on the device
    opt = opt.inner_state if in_host else opt
    opt_specs = sharding_lib.tree_specs(opt, num_shards, zero.optimizer_state)
    if isinstance(opt, compression_lib.CompressionState):  # a row per device
        rows = PartitionSpec(sharding_lib.AXIS)
        opt_specs = opt_specs._replace(
            errors=tuple(rows for _ in opt.errors),
            shared=tuple(PartitionSpec() for _ in opt.shared),
        )
    opt_specs = HostUpdateState(opt_specs) if in_host else opt_specs
    return specs.replace(
        params=sharding_lib.tree_specs(state.params, num_shards, zero.parameters),
        opt_state=opt_specs,
    )


def state_shardings(state: Any, plan: Any) -> Any:
    """:func:`state_specs` as ``NamedSharding`` on its mesh (``shard``'s), the optimizer state's in
    ``plan.optimizer_memory``; ``None`` without a mesh."""
    mesh = _mesh(plan)
    if mesh is None:
        return None
    specs = state_specs(state, plan, sharding_lib.data_devices(mesh))
    return sharding_lib.named(mesh, specs).replace(
        opt_state=sharding_lib.named(mesh, specs.opt_state, plan.optimizer_memory)
    )


def _mesh_axis(plan):
    """``("data", devices)`` (``0``: the visible devices the other axes leave); with
    ``shard="none"``, one device where ``optimizer_memory`` needs a sharding to name it."""
    if plan.shard != "none":
        return (sharding_lib.AXIS, plan.devices)
    if plan.optimizer_memory != "device":
        return (sharding_lib.AXIS, 1)
    return None


def _mesh(plan):  # where shard lays the step out
    return plan.mesh() if _mesh_axis(plan) is not None else None


def _one_device(plan):
    off = {"shard": "none", "devices": 0, "grad_compression": "none"}
    return {} if plan.shard == "none" else off


def _configure_model(model, plan):
    """zero3: a model with a ``param_layout`` field (the bundled ones) gathers each scanned
    block's partitioned parameters inside its loop, so one block's, not the whole model's, are
    whole on a device at a time."""
    if not stage(plan.shard).parameters or isinstance(model, nnx.Module):
        return model
    if not hasattr(model, "param_layout"):
        return model
    return model.clone(param_layout=functools.partial(sharding_lib.replicate, mesh=_mesh(plan)))


def _in_stack(path) -> bool:
    return scanned_blocks.in_stack([getattr(key, "key", None) for key in path])


def _gathered(loss, plan):
    """zero3: the partitioned parameters are gathered whole where the loss reads them (the
    transpose reduce-scatters their gradient); left to itself, XLA's partitioner lets the
    parameters' layout split the convolutions' channels instead of the batch. The stacks of
    scanned blocks stay partitioned here: a configured model gathers one block's inside its
    loop (:func:`_configure_model`)."""
    if not stage(plan.shard).parameters:
        return loss
    mesh = _mesh(plan)

    others = len(mesh.axis_names) > 1

    def stacked(leaf, spec):  # the dimensions "data" does not split: the other axes' (stages)
        return sharding_lib.left_open(spec, leaf.ndim) if others else spec

    def loss_of_gathered(p, *args):
        specs = jax.tree_util.tree_map_with_path(
            lambda path, leaf, spec: stacked(leaf, spec) if _in_stack(path) else PartitionSpec(),
            p,
            sharding_lib.tree_specs(p, sharding_lib.data_devices(mesh)),
        )
        return loss(sharding_lib.constrain(p, mesh, specs), *args)

    return loss_of_gathered


def _partitioned_grads(grad_fn, plan):
    """From ``zero2`` on, the gradients laid out as the optimizer state (reduce-scattered);
    with ``grad_compression``, each device's own
    (:func:`lowmem_jax.techniques.shard.compression.per_device_gradients`)."""
    mesh = _mesh(plan)
    if mesh is None:
        return grad_fn
    if plan.grad_compression != "none":
        return compression_lib.per_device_gradients(grad_fn, mesh, sharding_lib.AXIS)
    partition = stage(plan.shard).gradients
    others = len(mesh.axis_names) > 1

    def partitioned(*args):
        grads, model_state, metrics = grad_fn(*args)
        specs = sharding_lib.tree_specs(grads, sharding_lib.data_devices(mesh), partition)
        if others:  # the dimensions "data" does not split are the other axes' (a pipeline's)
            specs = jax.tree.map(
                lambda g, spec: sharding_lib.left_open(spec, g.ndim), grads, specs,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )  # fmt: skip
        return sharding_lib.constrain(grads, mesh, specs), model_state, metrics

    return partitioned


def _outermost_optimizer(tx, plan, params):
    """The optimizer outermost, reducing each device's gradient in ``plan.grad_compression``;
    its state in host memory (``optimizer_memory``), updated on the device or the host."""
    if plan.optimizer_update == "host":
        return HostUpdate(base.as_optimizer(tx))
    tx = _compressed(tx, plan, params)
    return tx if plan.optimizer_memory == "device" else DeviceUpdate(base.as_optimizer(tx))


def _compressed(tx, plan, params):
    if plan.grad_compression == "none":
        return tx
    if params is None:
        raise ValueError("a plan with grad_compression needs params in wrap_optimizer(tx, params)")
    inner = base.as_optimizer(tx)
    grads_like = params
    if inner.grads_wrt_stored:  # the gradient has the stored form's shapes
        grads_like = jax.eval_shape(lambda p: inner.store(p)[0], params)
    return compression_lib.CompressedGradients(
        inner,
        _mesh(plan),
        sharding_lib.AXIS,
        grads_like,
        method=plan.grad_compression,
        rank=plan.powersgd_rank,
        fraction=plan.topk_fraction,
        stacked=[
            _in_stack(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads_like)[0]
        ],
    )


def _laid_out(step, plan):
    """The state laid out over the mesh on the way in and out, the batch split over the
    devices; the optimizer state in ``plan.optimizer_memory`` (moved to the device, if at all,
    by its update: :mod:`lowmem_jax.techniques.shard.offload`)."""
    mesh = _mesh(plan)
    if mesh is None:
        return step

    @functools.wraps(step)  # the program keeps the step's name
    def laid_out_step(state, batch):
        shardings = plan.state_shardings(state)  # every technique's layout over the mesh, merged
        specs = jax.tree.map(lambda s: s.spec, shardings)

        def laid_out(tree):  # in host memory, the state keeps its memory kind
            if plan.optimizer_memory != "device":
                return jax.lax.with_sharding_constraint(tree, shardings)
            return sharding_lib.constrain(tree, mesh, specs)

        state = laid_out(state)
        batch = sharding_lib.constrain(batch, mesh, sharding_lib.batch_spec(batch))
        new_state, metrics = step(state, batch)
        return laid_out(new_state), metrics

    return laid_out_step


def _took_effect(evidence, plan):
    """The devices of the mesh and the share of the optimizer state partitioned over them;
    where the optimizer state lives between steps."""
    mesh = _mesh(plan)
    if mesh is None:
        return None
    parts = []
    if plan.shard != "none":
        partitioned = stage(plan.shard).optimizer_state
        state = evidence.state.opt_state
        data = sharding_lib.data_devices(mesh)
        share = sharding_lib.partitioned_fraction(state, data) if partitioned else 0.0
        parts.append(
            f"{plan.shard} over {data} devices: {share:.0%} of the optimizer state's "
            "bytes partitioned"
        )
    if plan.optimizer_memory != "device":
        parts.append(f"the optimizer state in {plan.optimizer_memory} memory between steps")
    took = sharding_lib.data_devices(mesh) > 1 or plan.optimizer_memory != "device"
    if plan.optimizer_update == "host":
        on_host = [e for e, _ in evidence.equations() if e.params.get("name") == HOST_UPDATE]
        parts.append(f"its update computed there ({len(on_host)} host computation per step)")
        took = took and bool(on_host)
    if plan.grad_compression != "none":  # what the compressed reduction sends
        said, sends = compression_lib.sent_as(evidence.tx, [e for e, _ in evidence.equations()])
        parts.append(said)
        took = took and sends
    return Verdict("shard", took, "; ".join(parts) or "one device: nothing partitioned")


TECHNIQUE = Technique(
    name="shard",
    fields=(
        PlanField(
            "shard",
            str,
            "none",
            "a :mod:`lowmem_jax.core.mesh` stage (``none``, ``dp``, ``zero1``, ``zero2``, "
            "``zero3``): the step runs over a data-parallel mesh with that much of the state "
            "partitioned; the batch size must divide by the devices (times ``microbatches``).",
            help="partition over a data-parallel mesh: dp (batch), zero1 (+ optimizer state), "
            "zero2 (+ gradients), zero3 (+ parameters); figures are per device",
            choices=STAGES,
        ),
        PlanField(
            "devices",
            int,
            0,
            "the devices of the mesh's ``data`` axis for ``shard`` (``0``: every device JAX "
            "sees, divided by the other axes': a pipeline's stages).",
            help="devices of the data-parallel axis for --shard (0: all visible, divided by "
            "--pipeline's stages)",
        ),
        PlanField(
            "optimizer_memory",
            str,
            "device",
            "the memory the optimizer state stays in between steps (a "
            ":data:`lowmem_jax.core.mesh.MEMORY_KINDS` name): ``device``, or ``pinned_host`` "
            "(host memory; the step moves it to the device for the update, once the gradient "
            "exists, and the new state back: "
            ":class:`~lowmem_jax.techniques.shard.offload.DeviceUpdate`).",
            help="where the optimizer state lives between steps: device, or pinned_host (host "
            "memory, moved to the device for the update and back, as ZeRO-Offload places it; "
            "XLA:CPU has one memory, so the device bytes it saves show on a GPU only)",
            choices=sharding_lib.MEMORY_KINDS,
        ),
        PlanField(
            "optimizer_update",
            str,
            "device",
            "where the optimizer's update runs: ``device``, or ``host`` (with "
            "``optimizer_memory='pinned_host'``: computed next to the state in host memory, "
            "ZeRO-Offload's way; :mod:`lowmem_jax.techniques.shard.offload`).",
            help="where the optimizer update runs: device, or host (with --optimizer-memory "
            "pinned_host: the state never leaves host memory, as in ZeRO-Offload)",
            choices=UPDATES,
            omit_default=True,
        ),
        PlanField(
            "grad_compression",
            str,
            "none",
            "how a data-parallel step (``shard`` ``dp`` or ``zero1``) reduces the gradient: "
            "``none`` (float32 all-reduce), ``int8``, ``powersgd`` or ``topk`` (each device's "
            "gradient, compressed with error feedback, once per step: "
            ":mod:`lowmem_jax.techniques.shard.compression`).",
            help="reduce the data-parallel gradient (--shard dp or zero1) compressed with "
            "error feedback, once per step: int8 (about 0.26x the bytes sent), powersgd "
            "(rank --powersgd-rank factors) or topk (the largest --topk-fraction of the "
            "entries); BatchNorm statistics become per device",
            choices=compression_lib.FORMATS,
            omit_default=True,
        ),
        PlanField(
            "powersgd_rank",
            int,
            4,
            'the rank of ``grad_compression="powersgd"``\'s factors.',
            help="the rank of --grad-compression powersgd's factors (default 4)",
            omit_default=True,
        ),
        PlanField(
            "topk_fraction",
            float,
            0.01,
            'the share of the gradient\'s entries ``grad_compression="topk"`` sends.',
            help="the share of the gradient's entries --grad-compression topk sends (default 0.01)",
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.shard == "none" else plan.shard,
    # Over more devices the same step, unless the gradient is compressed: an approximation
    # (error feedback carries the rest) the technical report did not study
    envelope=EnvelopeRule(
        "grad_compressions",
        {"report": ("none",), "any": compression_lib.FORMATS},
        lambda config, limit: (
            None
            if config.get("grad_compression", "none") in limit
            else f"{config['grad_compression']} gradient compression"
        ),
        lambda limit: "" if len(limit) > 1 else "gradients reduced whole",
    ),
    axis=Axis(  # searched where the planner has several devices (a budget per device)
        "shard",
        sharding_report.SHARD_STAGES,
        plan_fields=lambda stage: {"shard": stage},
        within=lambda stage, limit, batch_size: True,
        parts=("stored", "activations"),  # the state's layout; each device's examples
        own_ratio=True,
        corner="last",  # zero3 stores the least
        in_default_space=False,
        over_devices=lambda devices: sharding_report.SHARD_STAGES,
    ),
    model=ModelHooks(configure=_configure_model),
    optimizer=OptimizerHooks(wrap=_outermost_optimizer),
    step=StepHooks(stored_loss=_gathered, grad_fn=_partitioned_grads, step=_laid_out),
    layout=LayoutHooks(
        mesh_axis=_mesh_axis,
        state_shardings=state_shardings,
        one_device=_one_device,
        host_devices=sharding_report.use_host_devices,
    ),
    report=ReportHooks(verdict=_took_effect, section=sharding_report.SECTION),
)
