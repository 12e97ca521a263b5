"""Low-bit optimizer state (:mod:`lowmem_jax.techniques.optimizer_state.quantized`):
``optimizer_state``, ``optimizer_state_rounding``."""

import jax
import jax.numpy as jnp

from lowmem_jax.codecs.quantization import Quantized, quantized_nbytes
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import OptimizerHooks, ReportHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.optimizer_state import quantized as optimizer_state_lib
from lowmem_jax.techniques.optimizer_state.quantized import (
    FORMATS,
    QUANTIZED_FORMATS,
    QuantizedState,
    QuantizedStateOptimizer,
    quantized_state,
)

__all__ = [
    "TECHNIQUE",
    "FORMATS",
    "QUANTIZED_FORMATS",
    "QuantizedState",
    "QuantizedStateOptimizer",
    "quantized_state",
]

#: How int8 / int4 codes are rounded: to the nearest (the papers' rule) or stochastically.
ROUNDING = ("nearest", "stochastic")


def _validate(plan) -> None:
    optimizer_state_lib.check_format(plan.optimizer_state)
    rounding = plan.optimizer_state_rounding
    if rounding not in ROUNDING:
        raise ValueError(
            f"Unknown optimizer_state_rounding={rounding!r}; allowed values: {list(ROUNDING)}"
        )
    quantized = optimizer_state_lib.QUANTIZED_FORMATS
    if plan.optimizer_state in quantized and plan.optimizer_update == "host":
        raise ValueError(
            f"optimizer_state={plan.optimizer_state!r} runs with optimizer_update='device' only "
            "(got 'host'): quantizing on the host mixes host memory with the constants and "
            "indices JAX makes on the device; the state still lives in pinned_host with the "
            "update on the device, or use optimizer_state in ['auto', 'fp32', 'bf16']"
        )
    if rounding != "nearest" and plan.optimizer_state not in quantized:
        raise ValueError(
            f"optimizer_state_rounding={rounding!r} applies to optimizer_state in "
            f"{list(quantized)} only (got {plan.optimizer_state!r})"
        )


def _outside(config, limit):
    state = config.get("optimizer_state", "auto")
    return None if state in limit else f"optimizer state {state}"


def _stored_state(tx, plan, params):
    """The stored format wraps the user's transformation innermost: under sparse training its
    slots keep the stored parameters' shapes (a quantized slot is reset in its codes, so no
    float32 copy of the state is made when weights regrow) and the update is separable by
    leaf, so an int8 / int4 state is decoded one group of leaves at a time. ``auto`` with
    16-bit parameters stores it in bfloat16; with float32 parameters leaves it as ``tx``
    makes it."""
    fmt = plan.optimizer_state
    if fmt == "auto" and plan.policy.param_dtype == jnp.float32:
        return tx
    stochastic = plan.optimizer_state_rounding == "stochastic"
    return optimizer_state_lib.quantized_state(tx, fmt, stochastic_rounding=stochastic)


def _schedule(evidence) -> str:
    """How the step's quantized-state optimizer updates: in groups of leaves, or all at once
    and why
    (:meth:`lowmem_jax.techniques.optimizer_state.quantized.QuantizedStateOptimizer.schedule`)."""
    opt = evidence.tx
    while opt is not None and not isinstance(opt, optimizer_state_lib.QuantizedStateOptimizer):
        opt = getattr(opt, "inner", None)
    if opt is None:
        return ""
    grads = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        ),
        evidence.state.params,
    )
    stored = evidence.state.opt_state
    while not isinstance(stored, optimizer_state_lib.QuantizedState):
        stored = stored.inner_state
    groups, why = opt.schedule(grads, stored.inner_state, grads)
    if groups is None:
        return f"; decoded all at once ({why})"
    return f"; decoded and updated in {why}"


def _took_effect(evidence, plan):
    """How many of the optimizer state's arrays are stored in the format (quantized leaves,
    or floating leaves of its dtype), their bytes, and how the update decodes them."""
    fmt = plan.optimizer_state
    half = plan.policy.param_dtype != jnp.float32
    if fmt == "auto" and not half:
        return None
    if fmt == "fp32" and not half:
        return Verdict("optimizer_state", False, "float32 parameters: a float32 state either way")
    leaves = jax.tree.leaves(evidence.state.opt_state, is_leaf=lambda x: isinstance(x, Quantized))
    arrays = [
        x
        for x in leaves
        if isinstance(x, Quantized) or (jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0)
    ]
    rest = ""
    if fmt in optimizer_state_lib.QUANTIZED_FORMATS:
        stored = [x for x in arrays if isinstance(x, Quantized)]
        nbytes = sum(quantized_nbytes(x) for x in stored)
        fmt += ", rounded stochastically" * (plan.optimizer_state_rounding == "stochastic")
        if len(stored) < len(arrays):
            rest = "; the others stay float32 (under 4,096 elements)"
    else:
        dtype = jnp.dtype(jnp.float32 if fmt == "fp32" else jnp.bfloat16)
        stored = [x for x in arrays if x.dtype == dtype]
        nbytes = sum(x.size * x.dtype.itemsize for x in stored)
        fmt = dtype.name
    return Verdict(
        "optimizer_state",
        bool(stored),
        f"{len(stored)} of {len(arrays)} state arrays stored in {fmt} ({nbytes / MIB:.2f} MiB)"
        + rest
        + _schedule(evidence),
    )


# Its rows in `lowmem report`: (name, plan fields).
_ROWS = [(f"state {f}", {"optimizer_state": f}) for f in ("bf16", "int8", "int4")]


TECHNIQUE = Technique(
    name="optimizer_state",
    fields=(
        PlanField(
            "optimizer_state",
            str,
            "auto",
            "the stored format of the optimizer's state (a "
            ":mod:`~lowmem_jax.techniques.optimizer_state.quantized` "
            "format): ``auto`` (float32, or bfloat16 when the parameters are 16-bit), ``fp32``, "
            "``bf16``, ``int8``, ``int4``. The update's arithmetic is float32 whenever the state "
            "or the parameters are stored in fewer bits.",
            help="stored format of the optimizer state: auto (fp32; bf16 when the parameters are "
            "16-bit), fp32, bf16, int8 (block-wise dynamic quantization, Dettmers et al. 2022), "
            "int4 (Li et al. 2023); leaves under 4096 elements stay fp32. Updates are computed in "
            "fp32",
            choices=optimizer_state_lib.FORMATS,
        ),
        PlanField(
            "optimizer_state_rounding",
            str,
            "nearest",
            "how ``int8`` / ``int4`` codes are rounded: ``nearest`` (the 8-bit and 4-bit "
            "papers' rule) or ``stochastic`` (unbiased, a departure: with the second moment "
            "factored, 4-bit Adam then fits the least-squares test as float32 Adam does).",
            help="rounding of int8/int4 optimizer-state codes: nearest (the papers') or "
            "stochastic (unbiased; 4-bit Adam converges as fp32 Adam with --second-moment "
            "factored)",
            choices=ROUNDING,
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.optimizer_state == "auto" else f"state {plan.optimizer_state}",
    # 8 bits or more: Dettmers et al. 2022 matched 32-bit Adam; 4-bit states lose accuracy.
    envelope=EnvelopeRule(
        "optimizer_states",
        {"report": ("auto", "fp32", "bf16", "int8"), "any": optimizer_state_lib.FORMATS},
        _outside,
        lambda limit: f"optimizer states down to {limit[-1]}",
    ),
    axis=Axis(
        "optimizer_state",
        ("auto", "bf16", "int8", "int4"),
        plan_fields=lambda value: {"optimizer_state": value},
        within=lambda value, limit, batch_size: value in limit,
        own_ratio=True,
    ),
    optimizer=OptimizerHooks(inner=_stored_state),
    report=ReportHooks(rows=rows_of("optimizer state", "state int8", _ROWS), verdict=_took_effect),
)
