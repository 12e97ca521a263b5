"""The batch's stored images (``input_dtype``): ``uint8`` raw pixels, normalised inside the
step by the model (:func:`lowmem_jax.workloads.build` honours it)."""

import jax
import jax.numpy as jnp

from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ReportHooks, WorkloadHooks

#: How a batch may store its images (``Plan.input_dtype``).
INPUT_DTYPES = ("float32", "uint8")


def _validate(plan) -> None:
    if plan.input_dtype not in INPUT_DTYPES:
        raise ValueError(
            f"Unknown input_dtype={plan.input_dtype!r}; allowed values: {list(INPUT_DTYPES)}"
        )


def _took_effect(evidence, plan):
    """The batch's arrays stored in ``input_dtype``."""
    if plan.input_dtype == "float32":
        return None
    dtype = jnp.dtype(plan.input_dtype)
    stored = [x for x in jax.tree.leaves(evidence.batch) if x.dtype == dtype]
    nbytes = sum(x.size * x.dtype.itemsize for x in stored)
    return Verdict(
        "input_dtype",
        bool(stored),
        f"{len(stored)} batch arrays stored as {dtype.name} ({nbytes} B)",
    )


def _rows(context):
    """Its rows in `lowmem report`: (name, plan fields); none where the batch has no images."""
    return [("uint8 input", {"input_dtype": "uint8"})] if context.images else []


TECHNIQUE = Technique(
    name="input_dtype",
    fields=(
        PlanField(
            "input_dtype",
            str,
            "float32",
            "how the batch's images are stored: ``float32`` (normalised by the data pipeline) or "
            "``uint8`` (raw pixels, 4x fewer bytes; the model normalises each microbatch inside "
            "the step: the bundled WideResNet's ``pixel_mean`` / ``pixel_std``). A contract "
            "between the data and the model: :func:`lowmem_jax.workloads.build` and the image "
            "tasks honour it; ``make_train_step`` takes the batch it is given.",
            help="how batches store images: float32 (normalised by the data pipeline) or uint8 "
            "(raw pixels, 4x smaller; the model normalises each microbatch inside the step)",
            choices=INPUT_DTYPES,
            omit_default=True,
        ),
    ),
    validate=_validate,
    # Raw pixels normalised inside the step are the same images: inside every envelope.
    envelope=None,
    # Not searched: the planner's workloads are not all image batches.
    axis=None,
    workload=WorkloadHooks(
        bind=lambda work, plan, total_steps: (work.with_input_dtype(plan.input_dtype), plan)
    ),
    report=ReportHooks(rows=rows_of("input", "uint8 input", _rows), verdict=_took_effect),
)
