"""Loss scaling (:mod:`lowmem_jax.loss_scale`): ``loss_scale`` and its settings."""

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax.technique import Technique


def _validate(plan) -> None:
    if plan.loss_scale != "auto" and plan.loss_scale not in loss_scale_lib.LOSS_SCALES:
        raise ValueError(
            f"Unknown loss_scale={plan.loss_scale!r}; allowed values: "
            f"{['auto', *loss_scale_lib.LOSS_SCALES]}"
        )
    loss_scale_lib.check_settings(
        plan.loss_scale_kind,
        initial_scale=plan.initial_loss_scale,
        period=plan.loss_scale_period,
        factor=plan.loss_scale_factor,
        min_loss_scale=plan.min_loss_scale,
    )


TECHNIQUE = Technique(
    name="loss_scale",
    fields=(
        "loss_scale",
        "initial_loss_scale",
        "loss_scale_period",
        "loss_scale_factor",
        "min_loss_scale",
    ),
    validate=_validate,
    # Accuracy-neutral by design: a step with non-finite gradients is skipped and counted.
    envelope=None,
    axis=None,  # follows the precision (auto)
)
