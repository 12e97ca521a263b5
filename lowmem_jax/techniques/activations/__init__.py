"""Compressed activations: ``activations``, the residuals the backward pass reads stored in fewer
bits (ActNN; :mod:`.residuals`, loops: :mod:`.loops`)."""

from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ReportHooks, StepHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.activations import residuals as compression_lib
from lowmem_jax.techniques.activations.residuals import (
    FORMATS,
    ActivationSpec,
    CompressedBodies,
    ResidualReport,
    compiler_options,
    compress,
    compress_activation,
    compress_residuals,
    decompress,
    parse_spec,
    residual_report,
)

__all__ = [
    "TECHNIQUE",
    "FORMATS",
    "ActivationSpec",
    "CompressedBodies",
    "ResidualReport",
    "compiler_options",
    "compress",
    "compress_activation",
    "compress_residuals",
    "decompress",
    "parse_spec",
    "residual_report",
]


def _wrap_loss(loss_fn, plan):
    """The model's loss with its activation residuals compressed: those that depend on the
    batch (argument 2 of ``loss_fn(params, model_state, batch, rng)``); loops (scanned block
    stacks, a model's own scans) compress per iteration inside the loop."""
    return compression_lib.compress_residuals(loss_fn, plan.activations, data_argnums=(2,))


def _outside(config, limit):
    fmt = config.get("activations", "none")
    return None if fmt in limit else f"activations {fmt}"


def _took_effect(evidence, plan):
    """The residuals the step stores compressed (its ``compress_activation`` calls: floating
    ones in the format, boolean masks in bits), with their bytes before and after; calls inside
    a loop count once."""
    spec = compression_lib.parse_spec(plan.activations)
    if not spec.enabled:
        return None
    # Autodiff may split a call, leaving pieces that compute constants (no operands) or,
    # once a trace of the step is cached, nothing (no results: e.g. factorized layers' calls).
    calls = [
        eqn.params["jaxpr"]
        for eqn, _ in evidence.equations()
        if eqn.primitive.name in ("pjit", "jit")
        and eqn.params.get("name") == compression_lib.compress_activation.__name__
        and eqn.params["jaxpr"].in_avals
        and eqn.params["jaxpr"].out_avals
    ]
    before = sum(_nbytes(jaxpr.in_avals[0]) for jaxpr in calls)
    after = sum(_nbytes(jaxpr.out_avals[0]) for jaxpr in calls)
    return Verdict(
        "activations",
        bool(calls),
        f"{len(calls)} activation residuals stored in {spec.name} (masks in bits): "
        f"{before / MIB:.2f} -> "
        f"{after / MIB:.2f} MiB per call (a loop's body counts once)",
    )


def _nbytes(aval) -> int:
    return aval.size * aval.dtype.itemsize


TECHNIQUE = Technique(
    name="activations",
    fields=(
        PlanField(
            "activations",
            str,
            "none",
            "the stored format of the activation residuals the backward pass reads "
            "(:mod:`lowmem_jax.techniques.activations.residuals`): ``none``, ``bf16``, ``int8``, "
            "``int4``, ``int2`` (per-group minimum and range, stochastic rounding as in "
            "ActNN; ``int8:nearest`` etc. round to nearest). The forward pass is exact; "
            "weight gradients and gradients through nonlinearities see the compression.",
            help="stored format of the activations the backward pass reads: none, bf16, int8, "
            "int4, int2 (ActNN-style per-group quantization with stochastic rounding; "
            "NAME:nearest rounds to nearest). Forward values are exact",
            choices=None,
            omit_default=True,
        ),
    ),
    validate=lambda plan: compression_lib.parse_spec(plan.activations),
    label=lambda plan: None if plan.activations == "none" else f"act {plan.activations}",
    # Not in the report. Measured: within -0.5 points on digits at int8 and int2, but -6.68 BLEU
    # (int8) and -54.74 (int2) on the translation stand-in: inside no envelope but "any".
    envelope=EnvelopeRule(
        "activations",
        {"report": ("none",), "any": compression_lib.FORMATS},
        _outside,
        lambda limit: "activations stored whole" if list(limit) == ["none"] else "",
    ),
    # Outside the report's envelope only (above). Each format decodes into temporaries of its
    # own, so each is a corner (at a class's least-memory plans, int2 everywhere made all five
    # conformance models' smallest any-envelope plans 1-4% larger than without it: GPT-2 41.2
    # -> 42.5 MiB, ResNet-18 6.9 -> 7.0). Not in the default space: the analytic count (the
    # compressed residuals, not their float transients) predicts fits that XLA does not
    # confirm; on WRN-10-1 b16 at 3 MiB (any) it cost 6 more compiles, 3.5x the time, and
    # answered a lossier plan (bf16 + act int4 + microbatches 4 instead of fp32 + microbatches 8).
    axis=Axis(
        "activations",
        compression_lib.FORMATS,
        plan_fields=lambda value: {"activations": value},
        within=lambda value, limit, batch_size: value in limit,
        parts=("activations",),
        own_ratio=True,
        in_default_space=False,
    ),
    step=StepHooks(
        loss=_wrap_loss,
        compiler_options=lambda plan: compression_lib.compiler_options(plan.activations),
    ),
    report=ReportHooks(
        rows=rows_of(
            "activations",
            "act int8",
            [(f"act {f}", {"activations": f}) for f in ("bf16", "int8", "int2")],
        ),
        verdict=_took_effect,
    ),
)
