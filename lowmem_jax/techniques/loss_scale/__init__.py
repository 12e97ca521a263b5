"""Loss scaling (:mod:`lowmem_jax.techniques.loss_scale.scale`): ``loss_scale`` and its settings."""

from lowmem_jax.core.technique import PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ReportHooks
from lowmem_jax.techniques.loss_scale import scale as loss_scale_lib
from lowmem_jax.techniques.loss_scale.scale import (
    LOSS_SCALES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    make_loss_scale,
    select_tree,
)

__all__ = [
    "TECHNIQUE",
    "LOSS_SCALES",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "make_loss_scale",
    "select_tree",
]


def _validate(plan) -> None:
    """Every setting on construction, whatever the precision (a settings mistake should not
    wait for the float16 run that reads it), each error naming its Plan field."""
    if plan.loss_scale != "auto" and plan.loss_scale not in loss_scale_lib.LOSS_SCALES:
        raise ValueError(
            f"Unknown loss_scale={plan.loss_scale!r}; allowed values: "
            f"{['auto', *loss_scale_lib.LOSS_SCALES]}"
        )
    initial, period = plan.initial_loss_scale, plan.loss_scale_period
    if not initial > 0:
        raise ValueError(f"initial_loss_scale must be > 0, got {initial}")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"loss_scale_period must be an integer >= 1, got {period!r}")
    if not plan.loss_scale_factor > 1:
        raise ValueError(f"loss_scale_factor must be > 1, got {plan.loss_scale_factor}")
    if not 0 < plan.min_loss_scale <= initial:
        raise ValueError(
            f"min_loss_scale must be in (0, initial_loss_scale={initial}], got "
            f"{plan.min_loss_scale}"
        )


def _took_effect(evidence, plan):
    """The loss scale the state carries (``auto`` resolves by the precision)."""
    kind = plan.loss_scale_kind
    if plan.loss_scale == "auto" and kind == "none":
        return None
    if evidence.state.loss_scale is None:
        return Verdict(
            "loss_scale", False, "the state carries no loss scale (lm.TrainState.create makes one)"
        )
    scale = type(evidence.state.loss_scale).__name__
    took = kind != "none"
    return Verdict(
        "loss_scale", took, f"{kind} loss scale ({scale}), from {plan.initial_loss_scale:g}"
    )


TECHNIQUE = Technique(
    name="loss_scale",
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
    report=ReportHooks(verdict=_took_effect),
)
