"""Jittable tensor decompositions of layer kernels, in float32: CP, Tucker-2, low-rank.

Shapes: a convolution kernel is HWIO ``[KH, KW, S, T]`` (S input, T output channels); a dense
kernel is ``[S, T]``. Everything here is traced JAX (``jit`` / ``vmap`` over stacked kernels):
fixed iteration counts, no host loop per layer, no float64. A batched SVD or pseudo-inverse
(``vmap`` over a stack's blocks) runs one matrix at a time (:func:`_svd`): jaxlib's LAPACK
kernels split a batch over XLA:CPU's intra-op threads and wait for them, so two batched calls
running at once on a two-thread pool wait for each other forever.

* :func:`low_rank` (truncated SVD): ``W [M, T] ~ A @ B`` with ``A = U_R sqrt(s_R)`` ``[M, R]``
  and ``B = sqrt(s_R) V_R^T`` ``[R, T]``: the best rank-R approximation in Frobenius norm
  (Eckart-Young). A convolution kernel is unfolded to ``M = KH * KW * S`` rows.
* :func:`tucker2` (Kim et al. 2016): ``K ~ G x_S U x_T V``, i.e.
  ``K[i, j, s, t] = sum_ab U[s, a] G[i, j, a, b] V[t, b]`` with orthonormal ``U [S, R1]``,
  ``V [T, R2]`` from the HOSVD (leading left singular vectors of the mode-S and mode-T
  unfoldings) and core ``G = K x_S U^T x_T V^T`` ``[KH, KW, R1, R2]``; ``hooi_iterations > 0``
  refines ``U`` and ``V`` by higher-order orthogonal iteration (De Lathauwer et al. 2000).
* :func:`cp` (Lebedev et al. 2015): ``K[i, j, s, t] ~ sum_r w_r Y[i, r] X[j, r] A[s, r] B[t, r]``
  by alternating least squares from the SVD initialisation (as TensorLy's ``parafac``), at most
  ``iterations`` sweeps, stopping when the relative error changes by less than ``tolerance``.
  Each sweep solves ``F_n = X_(n) (KR_{m != n} F_m) (*_{m != n} F_m^T F_m)^+`` for every mode
  ``n`` and moves the column norms into ``w``.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "low_rank",
    "tucker2",
    "cp",
    "cp_to_tensor",
    "tucker2_to_tensor",
    "low_rank_to_tensor",
    "relative_error",
]


@jax.custom_batching.sequential_vmap
def _svd(m: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The thin SVD ``(U, s, V^T)`` of ``m [rows, cols]``; batched, a loop over the matrices
    (module docstring: a batched LAPACK call can deadlock XLA:CPU's intra-op pool)."""
    return jnp.linalg.svd(m, full_matrices=False)


@jax.custom_batching.sequential_vmap
def _hermitian_pinv(m: jax.Array) -> jax.Array:
    """The pseudo-inverse of a symmetric ``m [R, R]``; batched, a loop (as :func:`_svd`)."""
    return jnp.linalg.pinv(m, hermitian=True)


def _leading_left_vectors(m: jax.Array, rank: int) -> jax.Array:
    """``[rows, rank]``: the leading left singular vectors of ``m`` (sign as the SVD gives it)."""
    u, _, _ = _svd(m)
    return u[:, :rank]


def _unfold(x: jax.Array, mode: int) -> jax.Array:
    """``[x.shape[mode], rest]``: the mode-``mode`` unfolding."""
    return jnp.moveaxis(x, mode, 0).reshape(x.shape[mode], -1)


def low_rank(w: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    """``(A [..., M, R], B [R, T])`` with ``A @ B`` the best rank-``rank`` approximation of ``w``.

    ``w``: ``[S, T]`` or a conv kernel ``[KH, KW, S, T]``; ``A`` keeps the leading axes
    (``[KH, KW, S, R]`` for a kernel). float32.
    """
    w = w.astype(jnp.float32)
    m = w.reshape(-1, w.shape[-1])
    u, s, vt = _svd(m)
    root = jnp.sqrt(s[:rank])
    a = (u[:, :rank] * root).reshape(*w.shape[:-1], rank)
    return a, root[:, None] * vt[:rank]


def low_rank_to_tensor(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` over the rank axis: the kernel ``[..., T]`` the two factors represent."""
    return jnp.einsum("...r,rt->...t", a, b)


def tucker2(
    kernel: jax.Array, ranks: tuple[int, int], hooi_iterations: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tucker-2 of ``kernel [KH, KW, S, T]`` on its channel modes: ``(U [S, R1], G [KH, KW, R1,
    R2], V [T, R2])``, ``U`` and ``V`` orthonormal (module docstring). float32."""
    k = kernel.astype(jnp.float32)
    r1, r2 = ranks
    u = _leading_left_vectors(_unfold(k, 2), r1)
    v = _leading_left_vectors(_unfold(k, 3), r2)

    def sweep(_, uv):
        u, v = uv
        u = _leading_left_vectors(_unfold(jnp.einsum("ijst,tb->ijsb", k, v), 2), r1)
        v = _leading_left_vectors(_unfold(jnp.einsum("ijst,sa->ijat", k, u), 3), r2)
        return u, v

    u, v = jax.lax.fori_loop(0, hooi_iterations, sweep, (u, v))
    core = jnp.einsum("ijst,sa,tb->ijab", k, u, v)
    return u, core, v


def tucker2_to_tensor(u: jax.Array, core: jax.Array, v: jax.Array) -> jax.Array:
    """``[KH, KW, S, T]``: ``sum_ab U[s, a] G[i, j, a, b] V[t, b]``."""
    return jnp.einsum("sa,ijab,tb->ijst", u, core, v)


def _mttkrp_spec(ndim: int, mode: int) -> str:
    """einsum spec of ``X_(mode) @ khatri_rao(other factors)``, e.g. ``abcd,bz,cz,dz->az``."""
    axes = string.ascii_lowercase[:ndim]
    others = [f"{axes[m]}z" for m in range(ndim) if m != mode]
    return f"{axes},{','.join(others)}->{axes[mode]}z"


def cp_to_tensor(weights: jax.Array, factors: Sequence[jax.Array]) -> jax.Array:
    """The tensor ``[I_0, I_1, ...]`` = ``sum_r w_r f_0[:, r] o f_1[:, r] o ...`` (outer
    products)."""
    axes = string.ascii_lowercase[: len(factors)]
    spec = "z," + ",".join(f"{a}z" for a in axes) + "->" + axes
    return jnp.einsum(spec, weights, *factors)


def relative_error(x: jax.Array, approx: jax.Array) -> jax.Array:
    """``||x - approx||_F / ||x||_F`` (float32 scalar)."""
    x = x.astype(jnp.float32)
    return jnp.linalg.norm((x - approx).ravel()) / jnp.linalg.norm(x.ravel())


def cp(
    x: jax.Array,
    rank: int,
    iterations: int = 100,
    tolerance: float = 1e-7,
    key: jax.Array | None = None,
) -> tuple[jax.Array, list[jax.Array]]:
    """CP decomposition of ``x`` (any order) by ALS: ``(weights [R], [F_n [I_n, R] ...])`` with
    unit-norm factor columns (module docstring).

    Initial factors: the leading ``R`` left singular vectors of each unfolding; columns beyond
    ``I_n`` (a rank above the mode's size) are standard normal from ``key`` (default
    ``PRNGKey(0)``). Stops after ``iterations`` sweeps or once the relative error changes by
    less than ``tolerance``.
    """
    x = x.astype(jnp.float32)
    key = jax.random.PRNGKey(0) if key is None else key
    keys = jax.random.split(key, x.ndim)
    factors = []
    for n, size in enumerate(x.shape):
        lead = _leading_left_vectors(_unfold(x, n), min(rank, size))
        if rank > size:
            extra = jax.random.normal(keys[n], (size, rank - size), jnp.float32)
            lead = jnp.concatenate([lead, extra], axis=1)
        factors.append(lead)
    weights = jnp.ones((rank,), jnp.float32)
    norm_x = jnp.linalg.norm(x.ravel())

    def sweep(factors):
        weights = jnp.ones((rank,), jnp.float32)
        for n in range(x.ndim):
            gram = jnp.ones((rank, rank), jnp.float32)
            for m, f in enumerate(factors):
                if m != n:
                    gram = gram * (f.T @ f)
            others = [f for m, f in enumerate(factors) if m != n]
            mttkrp = jnp.einsum(_mttkrp_spec(x.ndim, n), x, *others)
            f = mttkrp @ _hermitian_pinv(gram)
            weights = jnp.linalg.norm(f, axis=0)
            factors[n] = f / jnp.where(weights > 0, weights, 1.0)
        return weights, factors

    def error(weights, factors):
        return jnp.linalg.norm((x - cp_to_tensor(weights, factors)).ravel()) / norm_x

    def cond(carry):
        i, _, _, err, previous = carry
        return (i < iterations) & (jnp.abs(previous - err) >= tolerance)

    def body(carry):
        i, weights, factors, err, _ = carry
        weights, factors = sweep(list(factors))
        return i + 1, weights, factors, error(weights, factors), err

    start = (jnp.int32(0), weights, factors, jnp.float32(jnp.inf), jnp.float32(-jnp.inf))
    _, weights, factors, _, _ = jax.lax.while_loop(cond, body, start)
    return weights, list(factors)
