"""Loss scaling (:mod:`lowmem_jax.loss_scale`): ``loss_scale`` and its settings."""

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax.technique import PlanField, Technique, Verdict


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


def _took_effect(evidence, plan):
    """The loss scale the state carries (``auto`` resolves by the precision)."""
    kind = plan.loss_scale_kind
    if plan.loss_scale == "auto" and kind == "none":
        return None
    scale = type(evidence.state.loss_scale).__name__
    took = kind != "none"
    return Verdict(
        "loss_scale", took, f"{kind} loss scale ({scale}), from {plan.initial_loss_scale:g}"
    )


TECHNIQUE = Technique(
    name="loss_scale",
    order=20,
    fields=(
        PlanField(
            "loss_scale",
            str,
            "auto",
            '``"auto"`` (dynamic when computing in float16, else none), ``"none"``, '
            '``"static"`` or ``"dynamic"``.',
            help="loss scaling; auto = dynamic when computing in float16, else none. Non-finite "
            "gradients skip the whole update",
            choices=("auto", *loss_scale_lib.LOSS_SCALES),
        ),
        PlanField("initial_loss_scale", float, 2.0**15, "the first loss scale (2**15)."),
        PlanField(
            "loss_scale_period", int, 2000, "finite steps before a dynamic scale grows (2000)."
        ),
        PlanField("loss_scale_factor", float, 2.0, "a dynamic scale's growth and back-off (2)."),
        PlanField("min_loss_scale", float, 1.0, "a dynamic scale's floor (1)."),
    ),
    validate=_validate,
    # Accuracy-neutral by design: a step with non-finite gradients is skipped and counted.
    envelope=None,
    axis=None,  # follows the precision (auto)
    took_effect=_took_effect,
)
