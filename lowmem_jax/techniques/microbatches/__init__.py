"""Microbatching: ``microbatches``, a count per batch, its gradients accumulated with
``lax.scan`` (:mod:`.accumulate`)."""

import jax
from flax import nnx

from lowmem_jax.blocks.scanned import straight_line
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.batches import check_num_microbatches, split_batch
from lowmem_jax.core.report_hooks import ReportRow
from lowmem_jax.core.technique import Axis, PlanField, Technique, Verdict, examples_rule
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks, StepHooks, WorkloadHooks
from lowmem_jax.techniques.microbatches.accumulate import accumulate_gradients, compiler_options

__all__ = [
    "TECHNIQUE",
    "accumulate_gradients",
    "split_batch",
    "check_num_microbatches",
    "compiler_options",
]


def _examples(config):
    """A microbatch's examples, where the batch is split."""
    k = config["microbatches"]
    return config["batch_size"] // k if k > 1 else None


def _configure_model(model, plan):
    """A Linen model whose ``conv_impl`` is ``"auto"`` (the bundled ones) gets ``"xla"`` when the
    step has no loop (one microbatch, every stack unrolled:
    :func:`lowmem_jax.blocks.scanned.straight_line`): the loop-friendly convolution is for
    XLA:CPU's loop bodies; in a step with no loop XLA's own keeps fewer buffers."""
    if (
        not isinstance(model, nnx.Module)
        and getattr(model, "conv_impl", None) == "auto"
        and plan.microbatches == 1
        and straight_line(getattr(model, "unroll", False), plan.remat, plan.policy.compute_dtype)
    ):
        return model.clone(conv_impl="xla")
    return model


def _fits(work, plan, total_steps):
    """The workload's batch splits into the plan's microbatches, each over the plan's data
    devices (every device takes its share of every microbatch)."""
    batch_size, k = work.batch_size, plan.microbatches
    if batch_size % k:
        raise ValueError(f"batch_size={batch_size} is not divisible by microbatches={k}")
    devices = sharding_lib.data_devices(plan.mesh())
    if batch_size % (k * devices):
        raise ValueError(
            f"batch_size={batch_size} is not divisible by microbatches={k} x devices={devices} "
            "(the plan's device mesh: each device takes its share of every microbatch)"
        )
    return work, plan


def _accumulate(grad_fn, plan):
    """``grad_fn`` accumulated over ``plan.microbatches`` slices (``lax.scan``); over a mesh each
    microbatch takes its examples from every device's shard (``split_batch``'s ``shards``),
    unless the batch is already one device's (traced inside a ``shard_map``)."""
    mesh = plan.mesh()

    def accumulated(*args):
        shards = sharding_lib.shards_in_batch(mesh)
        return accumulate_gradients(grad_fn, plan.microbatches, shards)(*args)

    return accumulated if plan.microbatches > 1 else grad_fn


def _took_effect(evidence, plan):
    """A loop of ``microbatches`` iterations around the gradient."""
    k = plan.microbatches
    if k == 1:
        return None
    loops = [
        eqn for eqn, _ in evidence.equations()
        if eqn.primitive.name == "scan" and eqn.params.get("length") == k
    ]  # fmt: skip
    examples = jax.tree.leaves(evidence.batch)[0].shape[0] // k
    hoisting = "; no loop-invariant code motion" if compiler_options(k) else ""
    return Verdict(
        "microbatches",
        bool(loops),
        f"gradients accumulated over {k} microbatches of {examples} examples (lax.scan{hoisting})",
    )


def _report_rows(context):
    """Microbatches of 64, 32, ..., 2 examples, each the largest divisor of the batch size at
    most that (100: 50, 25, 10, 5, 2); the one nearest 8 examples in the default grid."""
    targets = (64, 32, 16, 8, 4, 2)
    sizes = sorted({context.examples(t) for t in targets} - {None}, reverse=True)
    nearest = min(sizes, key=lambda size: abs(size - 8), default=None)
    return tuple(
        ReportRow(f"microbatch {size}", "microbatching",
                  {"microbatches": context.batch_size // size}, quick=size == nearest)
        for size in sizes
    )  # fmt: skip


TECHNIQUE = Technique(
    name="microbatches",
    fields=(
        PlanField(
            "microbatches",
            int,
            1,
            "``k >= 1`` slices per batch, accumulated with ``lax.scan``.",
            help="split each batch into K microbatches and accumulate gradients with lax.scan "
            "(BatchNorm uses per-microbatch statistics)",
        ),
    ),
    validate=lambda plan: check_num_microbatches(plan.microbatches),
    # As the flag reads (--microbatches 4: a count); a report row's "mb k" is k examples each.
    label=lambda plan: f"microbatches {plan.microbatches}" if plan.microbatches > 1 else None,
    # The report kept accuracy down to microbatches of about 8 examples (BatchNorm statistics
    # per microbatch); applied to every model, which is conservative for those without it.
    envelope=examples_rule("min_microbatch_examples", "microbatches", _examples),
    axis=Axis(
        "microbatches",
        None,
        plan_fields=lambda value: {"microbatches": value},
        within=lambda value, limit, batch_size: value == 1 or batch_size // value >= limit,
        candidates=lambda batch_size: tuple(
            m for m in range(1, batch_size + 1) if batch_size % m == 0
        ),
    ),
    model=ModelHooks(configure=_configure_model),
    step=StepHooks(
        grad_fn=_accumulate,
        compiler_options=lambda plan: compiler_options(plan.microbatches),
    ),
    workload=WorkloadHooks(bind=_fits),
    report=ReportHooks(rows=_report_rows, verdict=_took_effect),
)
