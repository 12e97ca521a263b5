"""Rematerialization (:mod:`lowmem_jax.remat`): the ``remat`` policy and ``remat_blocks``."""

from lowmem_jax import remat as remat_lib
from lowmem_jax.technique import Axis, Technique


def _validate(plan) -> None:
    remat_lib.parse_policy(plan.remat)
    if not isinstance(plan.remat_blocks, tuple) or not all(
        isinstance(n, str) and n for n in plan.remat_blocks
    ):
        raise ValueError(f"remat_blocks must be a tuple of class names, got {plan.remat_blocks!r}")


TECHNIQUE = Technique(
    name="remat",
    fields=("remat", "remat_blocks"),
    validate=_validate,
    label=lambda plan: None if plan.remat == "none" else f"remat {plan.remat}",
    envelope=None,  # numerically exact: no accuracy limit
    # "blocks": the per-block schedules the planner finds (lowmem_jax.remat_schedule).
    axis=Axis(
        "remat",
        ("none", "dots", "full", "sqrt", "blocks"),
        plan_fields=lambda value: {"remat": value},
        within=lambda value, limit, batch_size: True,
        compute=True,
        families=("blocks",),
    ),
)
