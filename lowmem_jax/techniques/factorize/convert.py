"""Decompose a trained dense model's parameters into a factorized model's (decompose, then
fine-tune: Lebedev et al. 2015, Kim et al. 2016)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.techniques.factorize.config import FactorConfig
from lowmem_jax.techniques.factorize.layers import FACTOR_NAMES, factorize_kernel

__all__ = ["decompose_params"]

PyTree = Any


def _method(node: dict) -> str | None:
    """The method of a factorized layer's parameter dict, or None for any other node."""
    for method in ("cp", "tucker", "lowrank"):  # most factors first: lowrank's are in each
        names = FACTOR_NAMES[method]
        if all(isinstance(node.get(n), dict) and "kernel" in node[n] for n in names):
            return method
    return None


def _ranks(method: str, factors: dict) -> tuple[int, ...]:
    if method == "tucker":
        return (factors["first"]["kernel"].shape[-1], factors["core"]["kernel"].shape[-1])
    return (factors["first"]["kernel"].shape[-1],)


def decompose_params(
    dense: PyTree, factored: PyTree, config: FactorConfig | None, path: tuple[str, ...] = ()
) -> PyTree:
    """The parameters of a factorized model whose layers approximate ``dense``'s.

    ``dense``: a dense model's parameters (nested dicts of arrays); ``factored``: the factorized
    model's parameters or their shapes (``jax.eval_shape`` of its ``init``), which give the
    structure, the ranks and the dtypes. Each factorized layer's ``kernel`` is decomposed
    (:func:`~lowmem_jax.techniques.factorize.factorize_kernel`; leading stack axes of scanned blocks
    are ``vmap``-ed over); every other leaf (biases, norms, the dense first and last layers) is
    copied (``config=None``: a tree without factorized layers, e.g. BatchNorm statistics,
    checked and copied).

    Raises:
      ValueError: a path where the two trees differ in structure or shape (a checkpoint of
        another model), naming the path.
    """
    where = "/".join(path) or "the root"
    if not isinstance(factored, dict):
        if isinstance(dense, dict) or jnp.shape(dense) != factored.shape:
            raise ValueError(
                f"the dense parameters do not match the model at {where}: "
                f"{jax.tree.map(jnp.shape, dense)} vs {factored.shape}"
            )
        return jnp.asarray(dense, factored.dtype)
    if not isinstance(dense, dict):
        raise ValueError(f"the dense parameters have no subtree at {where}")
    method = _method(factored)
    if method is not None and "kernel" in dense and "kernel" not in factored:
        kernel = jnp.asarray(dense["kernel"], jnp.float32)
        leading = factored["last"]["kernel"].ndim - 2  # stacked layers: [n, ...]
        ranks = _ranks(method, factored)

        def factorize(k):
            return factorize_kernel(config, method, k, ranks)

        for _ in range(leading):
            factorize = jax.vmap(factorize)
        factors = factorize(kernel)
        for name in FACTOR_NAMES[method]:
            if factors[name].shape != factored[name]["kernel"].shape:
                raise ValueError(
                    f"the dense kernel {kernel.shape} at {where} does not match the model's "
                    f"factors ({name} {factored[name]['kernel'].shape})"
                )
        out = {
            name: {"kernel": factors[name].astype(factored[name]["kernel"].dtype)}
            for name in FACTOR_NAMES[method]
        }
        for name, leaf in factored.items():
            if name not in out:
                out[name] = decompose_params(dense.get(name), leaf, config, (*path, name))
        return out
    missing = sorted(set(factored) - set(dense))
    if missing:
        raise ValueError(f"the dense parameters have no {missing} at {where}")
    return {
        name: decompose_params(dense[name], leaf, config, (*path, name))
        for name, leaf in factored.items()
    }
