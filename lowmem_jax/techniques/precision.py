"""Low precision (:mod:`lowmem_jax.precision`): the ``precision`` policy."""

from lowmem_jax import precision as precision_lib
from lowmem_jax.technique import Axis, EnvelopeRule, Technique


def _outside(config, limit):
    return None if config["precision"] in limit else f"precision {config['precision']}"


TECHNIQUE = Technique(
    name="precision",
    fields=("precision",),
    validate=lambda plan: precision_lib.get_policy(plan.precision),
    label=lambda plan: plan.precision,
    # The report kept float32 master weights (fp16 compute with loss scaling).
    envelope=EnvelopeRule(
        "precisions",
        {
            "report": ("fp32", "mixed_fp16", "mixed_bf16"),
            "any": tuple(sorted(precision_lib.POLICIES)),
        },
        _outside,
    ),
    axis=Axis(
        "precision",
        ("fp32", "mixed_bf16", "mixed_fp16", "bf16", "fp16"),
        plan_fields=lambda value: {"precision": value},
        within=lambda value, limit, batch_size: value in limit,
    ),
)
