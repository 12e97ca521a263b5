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

from lowmem_jax.factorization.any_model import factorize_module
from lowmem_jax.factorization.config import (
    FACTOR_HIDDEN,
    METHODS,
    RANK_RULES,
    FactorConfig,
    compression_ranks,
    layer_method,
)
from lowmem_jax.factorization.convert import decompose_params
from lowmem_jax.factorization.decompose import (
    cp,
    cp_to_tensor,
    low_rank,
    low_rank_to_tensor,
    relative_error,
    tucker2,
    tucker2_to_tensor,
)
from lowmem_jax.factorization.layers import (
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
from lowmem_jax.factorization.ranks import energy_rank, layer_ranks, select_ranks, vbmf_rank

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
