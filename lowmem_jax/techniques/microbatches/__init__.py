"""Microbatching (:mod:`lowmem_jax.techniques.microbatches.accumulate`): ``microbatches``, a count per batch."""

import jax

from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.report_hooks import ReportRow
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.techniques.microbatches import accumulate as microbatch_lib


def _outside(config, limit):
    examples = config["batch_size"] // config["microbatches"]
    if config["microbatches"] > 1 and examples < limit:
        return f"microbatches of {examples} examples (< {limit})"
    return None


def _accumulate(grad_fn, plan):
    """``grad_fn`` accumulated over ``plan.microbatches`` slices (``lax.scan``); over a mesh each
    microbatch takes its examples from every device's shard (``split_batch``'s ``shards``),
    unless the batch is already one device's (traced inside a ``shard_map``)."""
    mesh = plan.mesh()

    def accumulated(*args):
        shards = sharding_lib.shards_in_batch(mesh)
        return microbatch_lib.accumulate_gradients(grad_fn, plan.microbatches, shards)(*args)

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
    hoisting = "; no loop-invariant code motion" if microbatch_lib.compiler_options(k) else ""
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
                  {"microbatches": context.batch_size // size}, 20, quick=size == nearest)
        for size in sizes
    )  # fmt: skip


TECHNIQUE = Technique(
    name="microbatches",
    # Order: acts on the gradient (lax.scan accumulation)
    order=30,
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
    validate=lambda plan: microbatch_lib.check_num_microbatches(plan.microbatches),
    # As the flag reads (--microbatches 4: a count); a report row's "mb k" is k examples each.
    label=lambda plan: f"microbatches {plan.microbatches}" if plan.microbatches > 1 else None,
    wrap_grad_fn=_accumulate,
    compiler_options=lambda plan: microbatch_lib.compiler_options(plan.microbatches),
    # The report kept accuracy down to microbatches of about 8 examples (BatchNorm statistics
    # per microbatch); applied to every model, which is conservative for those without it.
    envelope=EnvelopeRule(
        "min_microbatch_examples",
        {"report": 8, "any": 1},
        _outside,
        lambda limit: f"microbatches of at least {limit} examples" if limit > 1 else "",
    ),
    axis=Axis(
        "microbatches",
        None,
        plan_fields=lambda value: {"microbatches": value},
        within=lambda value, limit, batch_size: value == 1 or batch_size // value >= limit,
        candidates=lambda batch_size: tuple(
            m for m in range(1, batch_size + 1) if batch_size % m == 0
        ),
    ),
    report_rows=_report_rows,
    took_effect=_took_effect,
)
