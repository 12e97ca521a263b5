"""Rematerialization (:mod:`lowmem_jax.remat`): the ``remat`` policy and ``remat_blocks``."""

from flax import nnx

from lowmem_jax import remat as remat_lib
from lowmem_jax.technique import Axis, Technique


def _validate(plan) -> None:
    remat_lib.parse_policy(plan.remat)
    if not isinstance(plan.remat_blocks, tuple) or not all(
        isinstance(n, str) and n for n in plan.remat_blocks
    ):
        raise ValueError(f"remat_blocks must be a tuple of class names, got {plan.remat_blocks!r}")


def _configure_model(model, plan):
    """A Linen model with a ``remat`` attribute (the bundled ones) applies the policy per block
    itself; any other model gets :func:`lowmem_jax.remat.remat_module` (per block of the
    classes in ``remat_blocks``, or the whole forward)."""
    if isinstance(model, nnx.Module) or not hasattr(model, "remat"):
        return remat_lib.remat_module(model, plan.remat, plan.remat_blocks)
    if plan.remat_blocks:
        raise ValueError(
            f"remat_blocks={plan.remat_blocks} is for models without a `remat` attribute; "
            f"{type(model).__name__} applies remat={plan.remat!r} itself"
        )
    return model.clone(remat=plan.remat)


TECHNIQUE = Technique(
    name="remat",
    fields=("remat", "remat_blocks"),
    validate=_validate,
    label=lambda plan: None if plan.remat == "none" else f"remat {plan.remat}",
    configure_model=_configure_model,
    compiler_options=lambda plan: remat_lib.compiler_options(plan.remat),
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
