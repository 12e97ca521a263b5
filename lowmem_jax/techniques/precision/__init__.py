"""Low precision (:mod:`lowmem_jax.techniques.precision.policy`): the ``precision`` policy, and
how bfloat16 parameters are rounded after their update (:mod:`.rounding`)."""

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks, StepHooks
from lowmem_jax.techniques.precision import policy as precision_lib
from lowmem_jax.techniques.precision import rounding
from lowmem_jax.techniques.precision.policy import (
    POLICIES,
    Policy,
    cast_floating,
    cast_loss_fn,
    get_policy,
)

__all__ = [
    "TECHNIQUE",
    "POLICIES",
    "Policy",
    "cast_floating",
    "cast_loss_fn",
    "get_policy",
]


def _configure_model(model, plan):
    """The compute dtype on a Linen model with a ``dtype`` field, and on every layer of an NNX
    model (a copy) whose ``dtype`` is ``None`` (else e.g. ``nnx.BatchNorm`` computes in the
    dtype of its float32 statistics); layers with an explicit ``dtype`` keep it."""
    dtype = plan.policy.compute_dtype
    if isinstance(model, nnx.Module):
        configured = nnx.clone(model)  # the user's module stays as it was
        for _, layer in nnx.iter_graph(configured):
            if isinstance(layer, nnx.Module) and getattr(layer, "dtype", False) is None:
                layer.dtype = dtype
        return configured
    return model.clone(dtype=dtype) if hasattr(model, "dtype") else model


#: How 16-bit parameters are rounded after their update (``Plan.param_rounding``).
PARAM_ROUNDING = ("nearest", "stochastic")


def _validate(plan) -> None:
    precision_lib.get_policy(plan.precision)
    if plan.param_rounding not in PARAM_ROUNDING:
        raise ValueError(
            f"Unknown param_rounding={plan.param_rounding!r}; allowed values: "
            f"{list(PARAM_ROUNDING)}"
        )
    if plan.param_rounding == "stochastic" and plan.policy.param_dtype != jnp.bfloat16:
        raise ValueError(
            f"param_rounding='stochastic' rounds bfloat16 parameters; precision="
            f"{plan.precision!r} stores them in {jnp.dtype(plan.policy.param_dtype).name} "
            "(allowed with: 'bf16')"
        )
    if plan.param_rounding == "stochastic" and plan.optimizer_update == "host":
        raise ValueError(
            "param_rounding='stochastic' does not combine with optimizer_update='host': the "
            "host applies the update there, rounded to the nearest"
        )


def _apply(apply_fn, plan):
    """``param_rounding="stochastic"``: the bfloat16 parameters' update rounded stochastically
    (:mod:`.rounding`)."""
    if plan.param_rounding != "stochastic":
        return apply_fn
    return rounding.apply_updates_stochastically


def _outside(config, limit):
    return None if config["precision"] in limit else f"precision {config['precision']}"


def _took_effect(evidence, plan):
    """The matmuls and convolutions of the step (backward included) whose first operand is in
    the compute dtype."""
    dtype = jnp.dtype(plan.policy.compute_dtype)
    if dtype == jnp.float32:
        return None
    names = ("dot_general", "conv_general_dilated")
    ops = [eqn for eqn, _ in evidence.equations() if eqn.primitive.name in names]
    half = [eqn for eqn in ops if eqn.invars[0].aval.dtype == dtype]
    text = f"{len(half)} of {len(ops)} matmuls and convolutions compute in {dtype.name}"
    if ops and not half:  # the model casts back: its layers fix their own dtype
        text += (
            f"; the model's layers cast to a dtype of their own: set it to {dtype.name} where "
            "the model takes it (its layers' or config's `dtype`, e.g. transformers' "
            "`Module(config, dtype=...)`); the plan sets only a top-level Linen `dtype` field "
            "and NNX layers whose `dtype` is None"
        )
    if plan.param_rounding == "stochastic":
        draws = [eqn for eqn, _ in evidence.equations() if eqn.primitive.name == "random_bits"]
        text += f"; the update rounded stochastically ({len(draws)} leaves' random bits)"
    return Verdict("precision", bool(half), text)


# Its rows in `lowmem report`: (name, plan fields).
_ROWS = [(p, {"precision": p}) for p in ("mixed_bf16", "mixed_fp16", "bf16", "fp16")]


TECHNIQUE = Technique(
    name="precision",
    fields=(
        PlanField(
            "precision",
            str,
            "fp32",
            "a :mod:`~lowmem_jax.techniques.precision.policy` policy name (``fp32``, ``bf16``, "
            "``fp16``, "
            "``mixed_bf16``, ``mixed_fp16``).",
            help="dtype policy: fp32; bf16/fp16 (params and compute half); mixed_bf16/mixed_fp16 "
            "(fp32 master weights, half compute)",
            choices=tuple(sorted(precision_lib.POLICIES)),
        ),
        PlanField(
            "param_rounding",
            str,
            "nearest",
            "how bfloat16 parameters (``precision='bf16'``: no float32 master copy) are rounded "
            "after each update: ``nearest`` or ``stochastic`` (unbiased; a named departure "
            "from the report's float32 master weights, :mod:`.rounding`).",
            help="how bf16 parameters are rounded after each update: nearest, or stochastic "
            "(unbiased: small updates accumulate in expectation; with --precision bf16)",
            choices=PARAM_ROUNDING,
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: plan.precision + (" sr" if plan.param_rounding == "stochastic" else ""),
    # The report kept float32 master weights (fp16 compute with loss scaling).
    envelope=EnvelopeRule(
        "precisions",
        {
            "report": ("fp32", "mixed_fp16", "mixed_bf16"),
            "any": tuple(sorted(precision_lib.POLICIES)),
        },
        _outside,
        lambda limit: (
            "fp32 master weights"
            if all(p == "fp32" or p.startswith("mixed") for p in limit)
            else "any precision"
        ),
    ),
    axis=Axis(
        "precision",
        ("fp32", "mixed_bf16", "mixed_fp16", "bf16", "fp16"),
        plan_fields=lambda value: {"precision": value},
        within=lambda value, limit, batch_size: value in limit,
        parts=("stored", "activations"),
        own_ratio=True,
        stored_falls=False,
    ),
    model=ModelHooks(configure=_configure_model),
    step=StepHooks(
        loss=lambda loss_fn, plan: precision_lib.cast_loss_fn(loss_fn, plan.policy),
        apply=_apply,
    ),
    report=ReportHooks(rows=rows_of("precision", "mixed_fp16", _ROWS), verdict=_took_effect),
)
