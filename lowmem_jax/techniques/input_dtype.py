"""The batch's stored images (``input_dtype``): ``uint8`` raw pixels, normalised inside the
step by the model (:func:`lowmem_jax.workloads.build` honours it)."""

from lowmem_jax.technique import Technique

#: How a batch may store its images (``Plan.input_dtype``).
INPUT_DTYPES = ("float32", "uint8")


def _validate(plan) -> None:
    if plan.input_dtype not in INPUT_DTYPES:
        raise ValueError(
            f"Unknown input_dtype={plan.input_dtype!r}; allowed values: {list(INPUT_DTYPES)}"
        )


TECHNIQUE = Technique(
    name="input_dtype",
    fields=("input_dtype",),
    validate=_validate,
    # Raw pixels normalised inside the step are the same images: inside every envelope.
    envelope=None,
    # Not searched: the planner's workloads are not all image batches.
    axis=None,
)
