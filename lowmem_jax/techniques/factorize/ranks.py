"""Ranks chosen from trained weights: retained energy, or VBMF as Kim et al. (2016) did.

Both read the singular values of a layer's unfoldings (host float64 SVDs, once per layer):

* a low-rank layer (dense, 1x1, or ``method="lowrank"``): the matrix ``[KH KW S, T]``;
* Tucker-2: ``R1`` from the input-channel unfolding ``[S, KH KW T]`` and ``R2`` from the
  output-channel one ``[T, KH KW S]`` (Kim et al.: VBMF on the mode-3 and mode-4 unfoldings).

``energy``: the least ``R`` with ``sum_{i<R} s_i^2 >= energy * sum_i s_i^2``.

``vbmf``: the rank of the empirical variational Bayesian matrix factorization's global analytic
solution (Nakajima, Sugiyama, Babacan and Tomioka 2013, JMLR 14). For ``Y [L, M]`` with
``L <= M``, ``alpha = L / M`` and singular values ``g_h``: with ``tau_bar`` the positive zero of
``log(t + 1) + alpha log(t / alpha + 1) - t`` and ``x_bar = (1 + tau_bar)(1 + alpha / tau_bar)``,
component ``h`` is kept iff ``g_h^2 > M sigma^2 x_bar``; the noise variance ``sigma^2`` minimises

    sum_h psi0(x_h) + [x_h > x_bar] psi1(x_h),   x_h = g_h^2 / (M sigma^2),
    psi0(x) = x - log x,   psi1(x) = log(tau(x) + 1) + alpha log(tau(x) / alpha + 1) - tau(x),
    tau(x) = (x - (1 + alpha) + sqrt((x - (1 + alpha))^2 - 4 alpha)) / 2,

over the paper's bracket ``[max(g_{H+1}^2 / (M x_bar), mean_{h>H} g_h^2 / M), sum g^2 / (L M)]``,
``H = min(ceil(L / (1 + alpha)) - 1, L)``.

Layers inside a scanned stack must share their shapes, so ranks are kept per *(layer name,
kernel shape)*: the largest rank chosen for any layer with that key (:func:`select_ranks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import optimize

from lowmem_jax.techniques.factorize.config import FactorConfig, layer_method
from lowmem_jax.techniques.factorize.layers import FACTOR_NAMES

__all__ = ["energy_rank", "vbmf_rank", "layer_ranks", "select_ranks"]


def energy_rank(singular_values: np.ndarray, energy: float) -> int:
    """The least ``R >= 1`` whose leading ``singular_values`` keep ``energy`` of the sum of
    squares (module docstring)."""
    power = np.asarray(singular_values, np.float64) ** 2
    cumulative = np.cumsum(power)
    if cumulative[-1] == 0.0:
        return 1
    # A hair of slack so energy=1.0 does not depend on the last ulp of the sum.
    return int(np.searchsorted(cumulative, energy * cumulative[-1] * (1 - 1e-12)) + 1)


def _tau_bar(alpha: float) -> float:
    def psi(t):
        return math.log(t + 1) + alpha * math.log(t / alpha + 1) - t

    return optimize.brentq(psi, 1e-3 * math.sqrt(alpha), 1e3)


def vbmf_rank(matrix: np.ndarray) -> int:
    """The EVBMF rank of ``matrix`` (module docstring; 0 when it is all noise)."""
    y = np.asarray(matrix, np.float64)
    if y.shape[0] > y.shape[1]:
        y = y.T
    rows, cols = y.shape
    alpha = rows / cols
    s = np.linalg.svd(y, compute_uv=False)
    if not np.any(s > 0.0):
        return 0
    tau_bar = _tau_bar(alpha)
    x_bar = (1 + tau_bar) * (1 + alpha / tau_bar)
    h_bar = int(min(math.ceil(rows / (1 + alpha)) - 1, rows))
    lower = max(s[h_bar] ** 2 / (cols * x_bar), np.mean(s[h_bar:] ** 2) / cols)
    upper = np.sum(s**2) / (rows * cols)

    def objective(sigma2):
        x = s**2 / (cols * sigma2)
        big = x[x > x_bar]
        tau = 0.5 * (big - (1 + alpha) + np.sqrt((big - (1 + alpha)) ** 2 - 4 * alpha))
        psi1 = np.log(tau + 1) + alpha * np.log(tau / alpha + 1) - tau
        return np.sum(x - np.log(x)) + np.sum(psi1)

    sigma2 = optimize.minimize_scalar(
        objective, bounds=(min(lower, upper), upper), method="bounded"
    ).x
    return int(np.sum(s**2 > cols * sigma2 * x_bar))


def _matrix_rank(matrix: np.ndarray, config: FactorConfig) -> int:
    if config.rank_rule == "vbmf":
        return vbmf_rank(matrix)
    return energy_rank(np.linalg.svd(matrix, compute_uv=False), config.energy)


def layer_ranks(kernel: np.ndarray, config: FactorConfig) -> tuple[int, ...]:
    """The ranks ``config.rank_rule`` (``energy`` or ``vbmf``) chooses for one trained dense
    ``kernel`` (``[KH, KW, S, T]`` or ``[S, T]``), clipped to ``[1, what the method can use]``."""
    kernel = np.asarray(kernel, np.float64)
    *spatial, s, t = kernel.shape
    k2 = math.prod(spatial)
    if layer_method(config.method, kernel.shape) == "lowrank":
        r = _matrix_rank(kernel.reshape(k2 * s, t), config)
        return (max(1, min(r, k2 * s, t)),)
    modes = np.moveaxis(kernel, (-2, -1), (0, 1))  # [S, T, KH, KW]
    r1 = _matrix_rank(modes.reshape(s, -1), config)
    r2 = _matrix_rank(np.swapaxes(modes, 0, 1).reshape(t, -1), config)
    return (max(1, min(r1, s)), max(1, min(r2, t)))


def select_ranks(dense: Any, factored: Any, config: FactorConfig) -> FactorConfig:
    """``config`` with its ``ranks`` table filled from a trained dense model.

    ``dense``: the dense model's parameters (nested dicts of arrays); ``factored``: the
    factorized model's parameter shapes at any ranks (``jax.eval_shape`` of its ``init``), which
    say where the factorized layers are. Every factorized layer's dense ``kernel`` (each layer of
    a scanned stack, whose leading axes are the stack's) gets :func:`layer_ranks`; the table keeps
    per ``(layer name, kernel shape)`` the largest. ``config.rank_rule="compression"`` returns
    ``config`` unchanged.
    """
    if config.rank_rule == "compression":
        return config
    table: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}

    def visit(dense_node, factored_node, name):
        if not isinstance(factored_node, dict) or not isinstance(dense_node, dict):
            return
        methods = [m for m, names in FACTOR_NAMES.items() if all(n in factored_node for n in names)]
        if methods and "kernel" in dense_node and "kernel" not in factored_node:
            last = factored_node["last"]["kernel"]
            kernel = np.asarray(dense_node["kernel"])
            leading = last.ndim - 2
            shape = tuple(kernel.shape[leading:])
            for layer in kernel.reshape(-1, *shape):
                ranks = layer_ranks(layer, config)
                old = table.get((name, shape), ranks)
                table[(name, shape)] = tuple(max(a, b) for a, b in zip(old, ranks, strict=True))
            return
        for key, child in factored_node.items():
            visit(dense_node.get(key), child, key)

    visit(dense, factored, "")
    ranks = tuple((name, shape, r) for (name, shape), r in sorted(table.items()))
    return dataclasses.replace(config, ranks=ranks)
