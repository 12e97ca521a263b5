"""Low-bit optimizer state (:mod:`lowmem_jax.optimizer_state`): ``optimizer_state``."""

from lowmem_jax import optimizer_state as optimizer_state_lib
from lowmem_jax.technique import Axis, EnvelopeRule, Technique


def _outside(config, limit):
    state = config.get("optimizer_state", "auto")
    return None if state in limit else f"optimizer state {state}"


TECHNIQUE = Technique(
    name="optimizer_state",
    fields=("optimizer_state",),
    validate=lambda plan: optimizer_state_lib.check_format(plan.optimizer_state),
    label=lambda plan: None if plan.optimizer_state == "auto" else f"state {plan.optimizer_state}",
    # 8 bits or more: Dettmers et al. 2022 matched 32-bit Adam; 4-bit states lose accuracy.
    envelope=EnvelopeRule(
        "optimizer_states",
        {"report": ("auto", "fp32", "bf16", "int8"), "any": optimizer_state_lib.FORMATS},
        _outside,
    ),
    axis=Axis(
        "optimizer_state",
        ("auto", "bf16", "int8", "int4"),
        plan_fields=lambda value: {"optimizer_state": value},
        within=lambda value, limit, batch_size: value in limit,
    ),
)
