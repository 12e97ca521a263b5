"""Low precision (:mod:`lowmem_jax.techniques.precision.policy`): the ``precision`` policy."""

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks, StepHooks
from lowmem_jax.techniques.precision import policy as precision_lib
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
    ),
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
    step=StepHooks(loss=lambda loss_fn, plan: precision_lib.cast_loss_fn(loss_fn, plan.policy)),
    report=ReportHooks(rows=rows_of("precision", "mixed_fp16", _ROWS), verdict=_took_effect),
)
