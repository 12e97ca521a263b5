"""Factorized layers (CTDR's tensor decomposition): CP, Tucker-2 and low-rank kernels.

A :class:`FactorConfig` names the method and the ranks; :class:`lowmem_jax.Plan` carries it
(``Plan(factorize=FactorConfig(...))``) and sets it on a bundled model's ``factorize`` field,
whose convolutions and dense layers then build :class:`FactorizedConv` / :class:`LowRankDense`
instead (the first and last layers stay dense by default); any other Linen or NNX model has its
``Dense`` / ``Linear`` / ``Conv`` layers replaced without edits to its code
(:func:`factorize_module`). Combined with remat, the extra
activations between factors (tagged :data:`FACTOR_HIDDEN`) are recomputed rather than stored:
the combination of Memory Efficient Combination of Tensor Decomposition and Recomputation
(CTDR).

Two ways in: train factorized from scratch (spectral initialisation), or decompose a trained
dense model's parameters (:func:`decompose_params`) and fine-tune.
"""

from __future__ import annotations

from lowmem_jax.techniques.factorize.any_model import factorize_module
from lowmem_jax.techniques.factorize.config import (
    FACTOR_HIDDEN,
    METHODS,
    RANK_RULES,
    FactorConfig,
    compression_ranks,
    layer_method,
)
from lowmem_jax.techniques.factorize.convert import decompose_params
from lowmem_jax.techniques.factorize.decompose import (
    cp,
    cp_to_tensor,
    low_rank,
    low_rank_to_tensor,
    relative_error,
    tucker2,
    tucker2_to_tensor,
)
from lowmem_jax.techniques.factorize.layers import (
    FACTOR_NAMES,
    FactorizedConv,
    LowRankDense,
    NNXFactorized,
    apply_dense,
    conv_layer,
    dense_layer,
    factor_shapes,
    factorize_kernel,
    reconstruct_kernel,
)
from lowmem_jax.techniques.factorize.ranks import energy_rank, layer_ranks, select_ranks, vbmf_rank

__all__ = [
    "FACTOR_HIDDEN",
    "FACTOR_NAMES",
    "METHODS",
    "RANK_RULES",
    "FactorConfig",
    "FactorizedConv",
    "LowRankDense",
    "NNXFactorized",
    "apply_dense",
    "compression_ranks",
    "conv_layer",
    "cp",
    "cp_to_tensor",
    "decompose_params",
    "dense_layer",
    "energy_rank",
    "factor_shapes",
    "factorize_kernel",
    "factorize_module",
    "layer_method",
    "layer_ranks",
    "low_rank",
    "low_rank_to_tensor",
    "reconstruct_kernel",
    "relative_error",
    "select_ranks",
    "tucker2",
    "tucker2_to_tensor",
    "vbmf_rank",
]

import argparse
import math

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, Flags, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks, WorkloadHooks
from lowmem_jax.techniques.factorize.warm_start import DECOMPOSE


def _validate(plan) -> None:
    if plan.factorize is not None and not isinstance(plan.factorize, FactorConfig):
        raise ValueError(
            f"factorize must be a lowmem_jax.techniques.factorize.FactorConfig or None, got "
            f"{type(plan.factorize).__name__}"
        )


def _configure_model(model, plan):
    """A Linen model with a ``factorize`` field (the bundled ones) chooses its layers itself;
    any other Linen or NNX model gets :func:`lowmem_jax.techniques.factorize.factorize_module`."""
    if plan.factorize is None:
        return model
    if isinstance(model, nnx.Module) or not hasattr(model, "factorize"):
        return factorize_module(model, plan.factorize)
    if plan.factorize.layers:
        raise ValueError(
            f"factorize layers={list(plan.factorize.layers)} selects the layers of a model "
            f"without a `factorize` field; {type(model).__name__} chooses its own (stem and "
            f"classifier dense: keep_first_last)"
        )
    return model.clone(factorize=plan.factorize)


def _add_flags(parser: argparse.ArgumentParser, base) -> None:
    group = parser.add_argument_group("factorized layers (lowmem_jax.techniques.factorize)")
    group.add_argument(
        "--factorize",
        default="none",
        choices=("none", *METHODS),
        help="factorize the convolutions (cp: Lebedev et al.; tucker: Tucker-2, Kim et al.; "
        "lowrank: KxK to R channels, then 1x1) and dense layers (always low-rank); the first and "
        "last layers stay dense. Default: %(default)s",
    )
    group.add_argument(
        "--factor-compression",
        type=float,
        default=0.25,
        help="fraction of each factorized layer's parameters its factors keep (sets the ranks "
        "under --factor-ranks compression). Default: %(default)s",
    )
    group.add_argument(
        "--factor-ranks",
        default="compression",
        choices=RANK_RULES,
        help="how ranks are chosen: by --factor-compression, or from the --decompose-from "
        "model's weights (tucker, lowrank): energy (keep --factor-energy of the squared "
        "singular values) or vbmf (Kim et al.'s VBMF). Default: %(default)s",
    )
    group.add_argument(
        "--factor-energy",
        type=float,
        default=0.9,
        help="retained energy for --factor-ranks energy. Default: %(default)s",
    )


def _fields(args: argparse.Namespace) -> dict:
    if args.factorize == "none":
        return {"factorize": None}
    return {
        "factorize": FactorConfig(
            method=args.factorize,
            compression=args.factor_compression,
            rank_rule=args.factor_ranks,
            energy=args.factor_energy,
        )
    }


def _argv(plan) -> list[str]:
    factor = plan.factorize
    if factor is None:
        return []
    argv = ["--factorize", factor.method]
    if factor.compression != 0.25:
        argv += ["--factor-compression", repr(factor.compression)]
    if factor.rank_rule != "compression":
        argv += ["--factor-ranks", factor.rank_rule]
    if factor.energy != 0.9:
        argv += ["--factor-energy", repr(factor.energy)]
    return argv


def _factorized_layers(tree) -> int:
    """The layers whose parameters are factors (``first`` ... ``last``), a stack's layers each
    (the leading axes of its ``last`` factor, ``[..., R, T]``)."""
    if not isinstance(tree, dict):
        return 0
    if "first" in tree and "last" in tree:
        last = tree["last"]["kernel"] if isinstance(tree["last"], dict) else tree["last"]
        return math.prod(jnp.shape(last)[:-2])
    return sum(_factorized_layers(v) for v in tree.values())


def _took_effect(evidence, plan):
    """The layers whose parameters are factors."""
    if plan.factorize is None:
        return None
    n = _factorized_layers(evidence.state.params)
    return Verdict("factorize", n > 0, f"{n} layers factorized ({plan.factorize.method})")


# Its rows in `lowmem report`: (name, plan fields).
_ROWS = [("factorize tucker 25%", {"factorize": FactorConfig("tucker", 0.25)})]


TECHNIQUE = Technique(
    name="factorize",
    fields=(
        PlanField(
            "factorize",
            FactorConfig | None,
            None,
            "a :class:`~lowmem_jax.techniques.factorize.FactorConfig` (CP / Tucker-2 / low-rank "
            "layers: "
            "a bundled model's own, any other Linen or NNX model's Dense / Linear / Conv layers "
            "by :func:`lowmem_jax.techniques.factorize.factorize_module`), or ``None``.",
        ),
    ),
    validate=_validate,
    label=lambda plan: (
        None
        if plan.factorize is None
        else f"{plan.factorize.method} {plan.factorize.compression:.0%}"
    ),
    flags=Flags(
        add=_add_flags,
        fields=_fields,
        argv=_argv,
        given=lambda args: ["--factorize"] if args.factorize != "none" else [],
    ),
    # The report did not study factorized layers: outside its envelope.
    envelope=EnvelopeRule(
        "factorize",
        {"report": False, "any": True},
        lambda config, limit: (
            "factorized layers" if config.get("factorize") and not limit else None
        ),
        lambda limit: "" if limit else "no factorized layers",
    ),
    axis=Axis(
        "factorize",
        (None, FactorConfig("tucker", 0.25)),
        plan_fields=lambda value: {"factorize": value},
        within=lambda value, limit, batch_size: value is None or limit,
        compute=True,
        parts=("stored", "activations"),
    ),
    model=ModelHooks(configure=_configure_model),
    workload=WorkloadHooks(warm_start=DECOMPOSE),
    report=ReportHooks(
        rows=rows_of("factorization", "factorize tucker 25%", _ROWS),
        verdict=_took_effect,
    ),
)
