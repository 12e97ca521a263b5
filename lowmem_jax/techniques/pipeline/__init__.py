"""Pipeline parallelism (:mod:`lowmem_jax.techniques.pipeline.gpipe`): ``pipeline`` stages,
``pipeline_microbatches``.

With ``plan.pipeline = S > 1`` the step is one SPMD program over a mesh with a ``"stage"``
axis of ``S`` devices: every scanned block stack whose length divides by ``S`` keeps its
blocks' parameters and optimizer state split over the stages and runs as a GPipe pipeline;
the rest of the model (and a stack that does not divide) is replicated over the stages,
computed by each on the whole batch. With ``shard`` (any ZeRO stage) beside it the
mesh has a ``"data"`` axis too (``devices`` of them, each with ``S`` stages): each data device
runs the pipeline on its share of the batch, and the state's layouts over the two axes merge
per leaf (:meth:`lowmem_jax.Plan.state_shardings`); ``zero3`` gathers each block's parameters
inside its stage, over the data devices.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from lowmem_jax.blocks import scanned as scanned_blocks
from lowmem_jax.core import base
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.technique import Axis, PlanField, Technique, Verdict, examples_rule
from lowmem_jax.core.technique_hooks import LayoutHooks, ModelHooks, ReportHooks, StepHooks
from lowmem_jax.techniques.pipeline import gpipe as pipeline_lib
from lowmem_jax.techniques.pipeline.gpipe import (
    STAGE,
    Pipeline,
    PipelinedStacks,
    bubble_fraction,
    microbatch_count,
    run,
)

__all__ = [
    "TECHNIQUE",
    "state_specs",
    "STAGE",
    "Pipeline",
    "PipelinedStacks",
    "bubble_fraction",
    "microbatch_count",
    "run",
]


#: Where the parameters and optimizer state outside the pipelined stacks live.
REST = ("replicate", "partition")


def _validate(plan) -> None:
    for field, least in (("pipeline", 1), ("pipeline_microbatches", 0)):
        base.check_int(getattr(plan, field), field, least)
    if plan.pipeline_rest not in REST:
        raise ValueError(
            f"Unknown pipeline_rest={plan.pipeline_rest!r}; allowed values: {list(REST)}"
        )
    if plan.pipeline == 1:
        for field, off in (("pipeline_microbatches", 0), ("pipeline_rest", "replicate")):
            if getattr(plan, field) != off:
                raise ValueError(
                    f"{field}={getattr(plan, field)!r} needs pipeline >= 2 (the stages of a "
                    "pipeline)"
                )
        return
    for field, allowed in (
        ("grad_compression", ("none",)),
        ("optimizer_update", ("device",)),
    ):
        if getattr(plan, field) not in allowed:
            raise ValueError(
                f"pipeline={plan.pipeline} runs with {field} in {list(allowed)} only (got "
                f"{getattr(plan, field)!r})"
            )


def _mesh_axis(plan):
    """``("stage", S)``; refused where JAX sees fewer than ``S`` devices."""
    if plan.pipeline == 1:
        return None
    visible = jax.devices()
    if plan.pipeline > len(visible):
        raise ValueError(
            f"pipeline={plan.pipeline} needs {plan.pipeline} devices; JAX sees {len(visible)} "
            f"{jax.default_backend()} device(s) (on CPU, `lowmem ... --pipeline "
            f"{plan.pipeline}` asks for host devices, as does "
            f"lowmem_jax.core.mesh.set_cpu_devices({plan.pipeline}) before JAX starts)"
        )
    return (pipeline_lib.STAGE, plan.pipeline)


def _mesh(plan):
    return plan.mesh() if plan.pipeline > 1 else None


def _split(path, leaf, stages: int) -> bool:
    """A stacked leaf whose blocks divide over the stages (parameters and their optimizer
    state alike: the optimizer's state keeps the parameters' paths)."""
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    shape = getattr(leaf, "shape", ())
    return scanned_blocks.in_stack(names) and len(shape) >= 1 and shape[0] % stages == 0


def _leaf_spec(path, leaf, stages: int, rest: bool) -> PartitionSpec:
    """Split over the stages along its blocks (a pipelined stack's leaf); else, with ``rest``,
    along its largest axis they divide; else replicated."""
    if _split(path, leaf, stages):
        return PartitionSpec(pipeline_lib.STAGE)
    if rest:
        return sharding_lib.leaf_spec(tuple(leaf.shape), stages, pipeline_lib.STAGE)
    return PartitionSpec()


def state_specs(state, plan):
    """A ``PartitionSpec`` per leaf of the train ``state`` (arrays or shapes): a stacked leaf
    of the parameters, the optimizer state or the model state (BatchNorm's running averages)
    split along its blocks over ``"stage"`` where they divide by ``plan.pipeline``; with
    ``pipeline_rest="partition"`` every other leaf of the parameters and optimizer state split
    along its largest axis the stages divide (:func:`lowmem_jax.core.mesh.leaf_spec`); the rest
    replicated."""
    partition = plan.pipeline_rest == "partition"
    specs = jax.tree.map(lambda _: PartitionSpec(), state)
    return specs.replace(**{
        part: jax.tree_util.tree_map_with_path(
            functools.partial(_leaf_spec, stages=plan.pipeline,
                              rest=partition and part != "model_state"),
            getattr(state, part),
        )
        for part in ("params", "opt_state", "model_state")
    })  # fmt: skip


def _state_shardings(state, plan):
    mesh = _mesh(plan)
    return None if mesh is None else sharding_lib.named(mesh, state_specs(state, plan))


def _pipelined_stacks(plan):
    """The per-block hook running the model's stacks as pipelines (a fresh one per trace)."""
    if plan.pipeline == 1:
        return None
    settings = pipeline_lib.Pipeline(plan.pipeline, plan.pipeline_microbatches, _mesh(plan))
    return pipeline_lib.PipelinedStacks(settings)


def _gathered(loss, plan):
    """``pipeline_rest="partition"``: the parameters outside the pipelined stacks gathered
    whole where the loss reads them (the transpose reduce-scatters their gradient), as ZeRO-3
    gathers them; the stacks stay split over the stages."""
    if plan.pipeline == 1 or plan.pipeline_rest != "partition":
        return loss
    mesh = _mesh(plan)

    def loss_of_gathered(params, *args):
        specs = jax.tree_util.tree_map_with_path(
            functools.partial(_leaf_spec, stages=plan.pipeline, rest=False), params
        )
        return loss(sharding_lib.constrain(params, mesh, specs), *args)

    return loss_of_gathered


def _laid_out(step, plan):
    """The state laid out over the mesh (every technique's layout, merged) on the way in and
    out."""
    mesh = _mesh(plan)
    if mesh is None:
        return step

    @functools.wraps(step)
    def laid_out_step(state, batch):
        # The merged layout, not its memory kinds: shard moves an offloaded state in and out.
        specs = jax.tree.map(lambda s: s.spec, plan.state_shardings(state))
        new_state, metrics = step(sharding_lib.constrain(state, mesh, specs), batch)
        return sharding_lib.constrain(new_state, mesh, specs), metrics

    return laid_out_step


def _took_effect(evidence, plan):
    """The stacks split over the stages (``ppermute`` in the step), the microbatches and the
    bubble, the shares of the parameters' bytes split and partitioned."""
    stages = plan.pipeline
    if stages == 1:
        return None
    sends = sum(eqn.primitive.name == "ppermute" for eqn, _ in evidence.equations())
    examples = jax.tree.leaves(evidence.batch)[0].shape[0] // plan.microbatches
    data = sharding_lib.data_devices(plan.mesh())
    count = pipeline_lib.microbatch_count(examples // data, stages, plan.pipeline_microbatches)
    specs = jax.tree.leaves(state_specs(evidence.state, plan).params,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))  # fmt: skip
    leaves = jax.tree_util.tree_flatten_with_path(evidence.state.params)[0]
    nbytes = [leaf.size * leaf.dtype.itemsize for _, leaf in leaves]
    total = max(sum(nbytes), 1)
    # A partitioned leaf outside the stacks may be split along its axis 0 too: ask the paths.
    split = sum(n for n, (path, leaf) in zip(nbytes, leaves, strict=True)
                if _split(path, leaf, stages))  # fmt: skip
    spread = sum(n for n, spec in zip(nbytes, specs, strict=True) if spec != PartitionSpec())
    rest = ""
    if plan.pipeline_rest == "partition":
        rest = f", {(spread - split) / total:.0%} more partitioned over them"
    return Verdict(
        "pipeline",
        sends > 0 and split > 0,
        f"{split / total:.0%} of the parameters' bytes split over {stages} stages{rest} "
        f"({sends} ppermute per step); GPipe over {count} microbatch{'es' * (count != 1)} of "
        f"{examples // (count * data)} example{'s' * (examples != count * data)}"
        + (f" on each of {data} data-parallel devices" if data > 1 else "")
        + f", bubble {pipeline_lib.bubble_fraction(stages, count):.0%}",
    )


def _examples(config):
    """A pipeline microbatch's examples (over every data device's share of it), where a stack's
    batch is split: BatchNorm inside a pipelined stack normalises each pipeline microbatch as
    microbatching's does. With ``devices=0`` beside ``shard`` the data devices are not known
    here: counted as one, which gives the default count of microbatches its largest value (the
    conservative side)."""
    stages = config.get("pipeline", 1)
    if stages == 1:
        return None
    examples = config["batch_size"] // config.get("microbatches", 1)
    data = max(config.get("devices", 0) if config.get("shard", "none") != "none" else 1, 1)
    count = pipeline_lib.microbatch_count(
        examples // data, stages, config.get("pipeline_microbatches", 0)
    )
    return examples // count if count > 1 else None


# The step's arithmetic, but BatchNorm inside a pipelined stack normalises per microbatch (as
# GPipe does): microbatching's limit, applied to every model as that one is.
_ENVELOPE = examples_rule("min_pipeline_microbatch_examples", "pipeline microbatches", _examples)


def _host_devices(args) -> None:
    """``S`` host devices, times ``--devices`` (the data axis) with ``--shard``."""
    stages = getattr(args, "pipeline", 1)
    if isinstance(stages, int) and stages > 1:
        data = getattr(args, "devices", 0) if getattr(args, "shard", "none") != "none" else 0
        sharding_lib.set_cpu_devices(stages * max(data or 1, 1))


TECHNIQUE = Technique(
    name="pipeline",
    fields=(
        PlanField(
            "pipeline",
            int,
            1,
            "the stages ``S`` of a GPipe pipeline (:mod:`~lowmem_jax.techniques.pipeline.gpipe`): "
            "each scanned "
            "block stack whose length divides by ``S`` is split over ``S`` devices, its "
            "blocks' parameters and optimizer state with it; ``1``: no pipeline.",
            help="GPipe stages: split each scanned block stack that divides by S over S "
            "devices (its parameters and optimizer state with it); figures are per device",
            omit_default=True,
        ),
        PlanField(
            "pipeline_rest",
            str,
            "replicate",
            "where the parameters and optimizer state outside the pipelined stacks live: "
            "``replicate`` (on every stage, which computes them on the whole batch) or "
            "``partition`` (split over the stages as ZeRO-3 splits them, gathered where the "
            "model reads them: per-device bytes fall, each step all-gathers them).",
            help="the parameters and optimizer state outside the pipelined stacks: replicate "
            "(on every stage) or partition (split over the stages as ZeRO-3 does, gathered "
            "where used)",
            choices=REST,
            omit_default=True,
        ),
        PlanField(
            "pipeline_microbatches",
            int,
            0,
            "the microbatches ``M`` a pipelined stack's batch is split into (``0``: the "
            "largest divisor of its examples at most ``4 S``); the stages idle "
            "``(S - 1) / (M + S - 1)`` of the time.",
            help="microbatches flowing through the pipeline's stages (0: the largest divisor "
            "of the batch at most 4 x stages)",
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.pipeline == 1 else f"pipeline {plan.pipeline}",
    envelope=_ENVELOPE,
    # Searched where the planner has several devices: the stage counts that divide them (the
    # rest, data devices). Inside an envelope only if it is at the batch's one microbatch and
    # one data device; the whole plan's rule is the planner's check
    axis=Axis(
        "pipeline",
        (1, 2, 4, 8),
        plan_fields=lambda stages: {"pipeline": stages},
        within=lambda stages, limit, batch_size: (
            _ENVELOPE.outside({"pipeline": stages, "batch_size": batch_size}, limit) is None
        ),
        parts=("stored", "activations"),  # the stacks' layout; each device's examples
        own_ratio=True,
        in_default_space=False,
        stored_falls=False,  # more stages leave fewer data devices for ZeRO to split over
        over_devices=lambda devices: tuple(s for s in range(1, devices + 1) if devices % s == 0),
    ),
    model=ModelHooks(block=_pipelined_stacks),
    step=StepHooks(stored_loss=_gathered, step=_laid_out),
    layout=LayoutHooks(
        mesh_axis=_mesh_axis,
        state_shardings=_state_shardings,
        one_device=lambda plan: (
            {"pipeline": 1, "pipeline_microbatches": 0, "pipeline_rest": "replicate"}
            if plan.pipeline > 1
            else {}
        ),  # fmt: skip
        host_devices=_host_devices,
    ),
    report=ReportHooks(verdict=_took_effect),
)
