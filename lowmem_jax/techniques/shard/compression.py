"""Compressed gradient communication for data parallelism: int8 or PowerSGD, with error
feedback.

Uncompressed data parallelism all-reduces the float32 gradient: on ``N`` devices under a ring
schedule each device sends ``2 (N - 1) / N x 4 n`` bytes for ``n`` gradient elements. Here each
device's own gradient ``g_d`` (computed on its examples alone) is reduced compressed.

**int8** (:func:`int8_mean`): in two compressed phases, each with error feedback (the
residual a compression leaves is added to what the next step sends; Seide et al. 2014,
Karimireddy et al. 2019; two-sided as in 1-bit Adam, Tang et al. 2021):

    v_d      = g_d + e_d                      e_d: device d's worker error, float32[n]
    c_d      = C(v_d);  e_d <- v_d - D(c_d)   all n elements, in N chunks of n / N
    all-to-all: device d receives chunk d of every c_j
    u_d      = (1/N) sum_j D(c_j)[chunk d] + s_d      s_d: its server error, float32[n / N]
    c'_d     = C(u_d);  s_d <- u_d - D(c'_d)
    all-gather: every device decodes the same sum_d-ordered chunks -> the mean gradient

``C`` is :mod:`lowmem_jax.codecs.activation_formats`' ``int8:nearest``: groups of 256 elements, each
with its float32 minimum and range, codes ``round((x - z) / r x 255)`` (error at most half a
step, ``r / 510``); the codes and the header of a group travel as one ``uint8`` row
(264 bytes per 256 elements). Each device sends ``2 (N - 1) / N x 1.03 n`` bytes: 0.26x the
float32 all-reduce's. Every device decodes the same gathered rows, so the mean is identical on
all of them. The error feedback makes the compression's error transient: the sum of what is
applied over ``T`` steps is the sum of the mean gradients minus the errors left after step
``T`` (at most one quantization step each).

**PowerSGD** (:func:`powersgd_mean`; Vogels et al. 2019) sends each layer's gradient matrix
(:func:`matrix_view`: a kernel as ``rows x cols``, each block of a stack of scanned blocks
apart) as two rank-``r`` factors instead: ``r (rows + cols)`` floats all-reduced instead of
``rows cols``; vectors (biases, normalisation scales) go whole. Its error feedback is one-sided
(each device keeps ``M - P Q^T``), and ``Q`` warm-starts the next step's power iteration.

**top-k** (:func:`topk_mean`) sends the largest ``k = fraction n`` entries of each device's
``g + e`` as (index, value) pairs by all-gather: ``(N - 1) 8 k`` bytes per device, ``N k / n``
of the float32 all-reduce's.

The errors are per-device state (global arrays with one row per device, laid out over the
``data`` axis): :class:`CompressedGradients` keeps them in the
optimizer state around the user's optimizer (``inner_state``), so a skipped step keeps them and
a checkpoint holds them. They tie the state to ``N``: a checkpoint restores onto the same
device count.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from lowmem_jax.codecs import activation_formats
from lowmem_jax.core.base import PyTree, Wrapper, as_optimizer

__all__ = [
    "FORMATS",
    "CompressionState",
    "CompressedGradients",
    "padded_size",
    "int8_mean",
    "compressible",
    "matrix_view",
    "powersgd_mean",
    "topk_mean",
    "topk_count",
    "per_device_gradients",
    "sent_as",
]

#: ``none``: the float32 gradient all-reduced; the others: the module docstring.
FORMATS = ("none", "int8", "powersgd", "topk")
_SPEC = activation_formats.parse_spec("int8:nearest")


def padded_size(n: int, devices: int) -> int:
    """``n`` rounded up to whole groups in each of ``devices`` equal chunks."""
    unit = _SPEC.group_size * devices
    return -(-n // unit) * unit


def _compress(x: jax.Array) -> jax.Array:
    """float32[m] (``m`` whole groups) -> uint8[m / 256, 264]."""
    return activation_formats.compress(x, _SPEC)


def _decompress(rows: jax.Array) -> jax.Array:
    """uint8[..., m / 256, 264] -> float32[..., m]."""
    *lead, groups, width = rows.shape
    size = math.prod(lead) * groups * _SPEC.group_size
    flat = activation_formats.decompress(rows.reshape(-1, width), (size,), jnp.float32, _SPEC)
    return flat.reshape(*lead, groups * _SPEC.group_size)


def int8_mean(
    flat: jax.Array, worker_error: jax.Array, server_error: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside ``shard_map`` over ``axis_name`` (``N`` devices): this device's gradient
    ``flat`` (float32[n], ``n`` from :func:`padded_size`) and its errors (float32[n],
    float32[n / N]) -> ``(mean over the devices, new worker error, new server error)``, the
    mean the same on every device (the module docstring's two phases)."""
    devices = lax.axis_size(axis_name)
    v = flat + worker_error
    rows = _compress(v)
    worker_error = v - _decompress(rows)
    received = lax.all_to_all(rows.reshape(devices, -1, rows.shape[-1]), axis_name, 0, 0)
    u = _decompress(received).mean(axis=0) + server_error
    chunk = _compress(u)
    server_error = u - _decompress(chunk)
    gathered = lax.all_gather(chunk, axis_name)  # [N, n / N / 256, 264], device order
    return _decompress(gathered).reshape(-1), worker_error, server_error


def matrix_view(shape: tuple[int, ...], stacked: bool = False) -> tuple[int, int, int]:
    """``(layers, rows, cols)``: the matrices PowerSGD sees in a leaf of ``shape``: one
    ``[prod(shape[:-1]), shape[-1]]`` (a Dense kernel ``[in, out]``, a convolution's
    ``[kh * kw * in, out]``), or with ``stacked`` (a stack of scanned blocks, leading axis the
    block) one per block."""
    layers, inner = (shape[0], shape[1:]) if stacked else (1, shape)
    return layers, math.prod(inner[:-1]), inner[-1] if inner else 1


def compressible(shape: tuple[int, ...], rank: int, stacked: bool = False) -> bool:
    """PowerSGD sends a gradient leaf as rank-``rank`` factors where that is fewer numbers: a
    matrix per layer (:func:`matrix_view`; rank >= 2 beyond the stack's axis) with
    ``rank (rows + cols) < rows cols``; other leaves go whole."""
    if len(shape) - stacked < 2:
        return False
    _, rows, cols = matrix_view(shape, stacked)
    return rank * (rows + cols) < rows * cols


def powersgd_mean(
    leaves: list[jax.Array],
    error: jax.Array,
    qs: list[jax.Array],
    axis_name: str,
    stacked: list[bool] | None = None,
) -> tuple[list[jax.Array], jax.Array, list[jax.Array]]:
    """Inside ``shard_map`` over ``axis_name``: this device's gradient ``leaves`` (float32,
    ``n`` elements in all), its error (float32[n]) and the previous step's ``qs`` (one
    ``[layers, cols, r]`` per :func:`compressible` leaf, in order; the same on every device)
    -> (the mean gradient's leaves, the same on every device; the new error; the new ``qs``).
    ``stacked``: which leaves are stacks of blocks (:func:`matrix_view`; default none).

    PowerSGD (Vogels et al. 2019, as their reference code and PyTorch's ``powerSGD_hook``):
    ``M = G + e`` per layer viewed ``[rows, cols]``; ``P = sum_devices M Q`` (all-reduce),
    orthonormalized (QR); ``Q = mean_devices M^T P`` (all-reduce); the mean is ``P Q^T``;
    ``e <- M - P Q^T``; ``Q`` warm-starts the next step. Other leaves are all-reduced whole
    (their error stays 0)."""
    stacked = stacked or [False] * len(leaves)
    flat = _concat(leaves) + error
    ms = _split(flat, leaves)
    rank = qs[0].shape[-1] if qs else 0
    picked = [i for i, x in enumerate(leaves) if qs and compressible(x.shape, rank, stacked[i])]
    views = [ms[i].reshape(matrix_view(ms[i].shape, stacked[i])) for i in picked]
    ps = lax.psum([m @ q for m, q in zip(views, qs, strict=True)], axis_name)
    ps = [lax.map(_orthonormal, p) for p in ps]
    qs = lax.pmean([jnp.swapaxes(m, 1, 2) @ p for m, p in zip(views, ps, strict=True)], axis_name)
    whole = [i for i in range(len(leaves)) if i not in picked]
    out = dict(zip(whole, lax.pmean([ms[i] for i in whole], axis_name), strict=True))
    for i, p, q in zip(picked, ps, qs, strict=True):
        out[i] = (p @ jnp.swapaxes(q, 1, 2)).reshape(leaves[i].shape)
    mean = [out[i] for i in range(len(leaves))]
    return mean, flat - _concat(mean), qs


def _orthonormal(p: jax.Array) -> jax.Array:
    """``Q`` of ``p [rows, r]``'s thin QR. Mapped one layer at a time: a batched LAPACK QR
    splits its batch over XLA:CPU's intra-op threads and waits for them, and two such calls at
    once deadlock a two-thread pool."""
    return jnp.linalg.qr(p)[0]


def _concat(leaves: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([x.reshape(-1) for x in leaves])


def _split(flat: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """``flat``'s leading elements as arrays shaped as ``like``'s, in order (:func:`_concat`'s
    inverse; padding after them dropped)."""
    starts = np.cumsum([0, *(x.size for x in like)]).tolist()
    return [flat[a : a + x.size].reshape(x.shape) for a, x in zip(starts, like, strict=False)]


def topk_mean(
    flat: jax.Array, error: jax.Array, k: int, axis_name: str
) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map`` over ``axis_name`` (``N`` devices): this device's gradient ``flat``
    (float32[n]) and its error -> ``(mean over the devices, new error)``.

    Top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with
    memory"; exchanged by all-gather as in Deep Gradient Compression, Lin et al. 2018, without
    its momentum correction): ``v = g + e``; the ``k`` entries of largest ``|v|`` are sent as
    (int32 index, float32 value) pairs and ``e <- v`` with them zeroed; every device adds the
    ``N`` devices' pairs into zeros, one device at a time (so the sum's order, and the mean, is
    the same on every device), and divides by ``N``."""
    v = flat + error
    _, index = lax.top_k(jnp.abs(v), k)
    values = v[index]
    error = v.at[index].set(0.0)
    indices, values = lax.all_gather(index, axis_name), lax.all_gather(values, axis_name)
    devices = lax.axis_size(axis_name)

    def add(d, total):  # one device's indices are distinct: an exact scatter
        return total.at[indices[d]].add(values[d])

    total = lax.fori_loop(0, devices, add, jnp.zeros_like(flat))
    return total / devices, error


def topk_count(n: int, fraction: float) -> int:
    """The entries top-k sends of ``n``: ``round(fraction n)``, at least 1."""
    return max(1, round(fraction * n))


class CompressionState(NamedTuple):
    """``errors``: per-device float32 arrays, row ``d`` device ``d``'s (int8: the worker error
    ``[N, n]`` and the server error ``[N, n / N]``; PowerSGD and top-k: ``[N, n]``);
    ``shared``: what every device holds the same (PowerSGD's ``Q``, ``[layers, cols, r]`` per
    factored leaf; otherwise none); ``inner_state``: the wrapped optimizer's state."""

    errors: tuple[jax.Array, ...]
    shared: tuple[jax.Array, ...]
    inner_state: PyTree


class CompressedGradients(Wrapper):
    """An optimizer whose :meth:`update` takes each device's own gradient, stacked
    (``[N, *leaf.shape]`` per leaf, row ``d`` on device ``d``), reduces it by ``method``
    (:func:`int8_mean`, :func:`powersgd_mean` or :func:`topk_mean`) and runs ``inner`` on the
    mean. The parameters' storage is ``inner``'s.

    Args:
      inner: the optimizer (an optax transformation or an :class:`Optimizer`).
      mesh: the data-parallel mesh; its one axis is ``axis_name``.
      grads_like: the gradient's leaves as arrays or shapes (what the step differentiates
        with respect to), for the errors' size and PowerSGD's factors.
      method: ``int8``, ``powersgd`` or ``topk`` (:data:`FORMATS`).
      rank: PowerSGD's rank.
      fraction: the share of the gradient's entries top-k sends.
      stacked: per leaf of ``grads_like``, whether it is a stack of blocks (PowerSGD factors
        each block's matrix: :func:`matrix_view`); default none.
    """

    def __init__(
        self,
        inner: Any,
        mesh: Mesh,
        axis_name: str,
        grads_like: PyTree,
        method: str = "int8",
        rank: int = 4,
        fraction: float = 0.01,
        stacked: list[bool] | None = None,
    ):
        if method not in FORMATS[1:]:
            raise ValueError(f"Unknown method={method!r}; allowed values: {list(FORMATS[1:])}")
        self.inner = as_optimizer(inner)
        self.mesh = mesh
        self.axis_name = axis_name
        self.method = method
        self.rank = rank
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(grads_like)]
        n = sum(math.prod(shape) for shape in self.shapes)
        self.size = padded_size(n, mesh.size) if method == "int8" else n
        self.stacked = list(stacked or [False] * len(self.shapes))
        self.factored = [
            matrix_view(shape, stack)
            for shape, stack in zip(self.shapes, self.stacked, strict=True)
            if method == "powersgd" and compressible(shape, rank, stack)
        ]
        self.k = topk_count(n, fraction)

    def _state(self, inner_state: PyTree) -> CompressionState:
        devices = self.mesh.size
        errors = [jnp.zeros((devices, self.size), jnp.float32)]
        if self.method == "int8":
            errors.append(jnp.zeros((devices, self.size // devices), jnp.float32))
        # Q starts as a fixed draw (the same on every device), then warm-starts each step.
        keys = jax.random.split(jax.random.key(0), max(len(self.factored), 1))
        shared = tuple(
            jax.random.normal(key, (layers, cols, self.rank), jnp.float32)
            for key, (layers, _, cols) in zip(keys, self.factored, strict=False)
        )
        return CompressionState(tuple(errors), shared, inner_state)

    def init(self, params: PyTree) -> CompressionState:
        return self._state(self.inner.init(params))

    def store(self, params: PyTree, grads: PyTree | None = None):
        stored, inner_state = self.inner.store(params, grads)
        return stored, self._state(inner_state)

    def mean(self, grads: PyTree, state: CompressionState) -> tuple[PyTree, CompressionState]:
        """The stacked per-device ``grads`` -> their compressed mean (each leaf's shape and
        dtype), and the state with the new errors (and PowerSGD's new ``Q``)."""
        rows = PartitionSpec(self.axis_name)
        errors_spec = tuple(rows for _ in state.errors)

        def local(grads, errors, shared):
            mine = [g[0].astype(jnp.float32) for g in jax.tree.leaves(grads)]
            errors = tuple(e[0] for e in errors)
            if self.method == "powersgd":
                mean, error, shared = powersgd_mean(
                    mine, *errors, list(shared), self.axis_name, self.stacked
                )
                errors = (error,)
            elif self.method == "topk":
                flat, error = topk_mean(_concat(mine), *errors, self.k, self.axis_name)
                mean, errors = _split(flat, mine), (error,)
            else:
                flat = _concat(mine)
                flat = jnp.pad(flat, (0, self.size - flat.shape[0]))
                flat, *errors = int8_mean(flat, *errors, self.axis_name)
                mean = _split(flat, mine)
            mean = [m.astype(g.dtype) for m, g in zip(mean, jax.tree.leaves(grads), strict=True)]
            errors = tuple(e[None] for e in errors)
            return jax.tree.structure(grads).unflatten(mean), errors, tuple(shared)

        mean, errors, shared = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(rows, errors_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), errors_spec, PartitionSpec()),
            # the mean and Q are the same on every device (decoded from one gather, or made of
            # all-reduced factors)
            check_vma=False,
        )(grads, state.errors, state.shared)
        return mean, state._replace(errors=errors, shared=shared)

    def update(self, grads, state: CompressionState, params=None):
        mean, state = self.mean(grads, state)
        updates, inner_state = self.inner.update(mean, state.inner_state, params)
        return updates, state._replace(inner_state=inner_state)

    def __repr__(self) -> str:
        return f"CompressedGradients({self.method} over {self.mesh.size} devices, {self.inner!r})"


def per_device_gradients(grad_fn: Any, mesh: Mesh, axis: str) -> Any:
    """``grad_fn(params, model_state, batch, rng)`` on each device's examples alone (the
    batch split over ``mesh``'s ``axis``): the gradients stacked, ``[N, *shape]`` (row ``d``
    device ``d``'s ``g_d``, laid out over the axis: nothing is reduced), what
    :class:`CompressedGradients` reduces; the float model state and metrics averaged over the
    devices; ``rng`` folded with the device's index."""

    def device_mean(tree):
        def mean(x):
            return jax.lax.pmean(x, axis) if jnp.issubdtype(x.dtype, jnp.inexact) else x

        return jax.tree.map(mean, tree)

    def local(params, model_state, batch, rng):
        if rng is not None:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
        grads, model_state, metrics = grad_fn(params, model_state, batch, rng)
        stacked = jax.tree.map(lambda g: g[None], grads)
        return stacked, device_mean(model_state), device_mean(metrics)

    def per_device(params, model_state, batch, rng):
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis), PartitionSpec()),
            out_specs=(PartitionSpec(axis), PartitionSpec(), PartitionSpec()),
            # no implicit reduction of the gradient (with check_vma, differentiating w.r.t.
            # the replicated params would psum it); the averaged outputs agree by pmean
            check_vma=False,
        )(params, model_state, batch, rng)

    return per_device


def sent_as(tx: CompressedGradients, equations: list[Any]) -> tuple[str, bool]:
    """How a step with ``tx`` (its optimizer) reduces the gradient, in words, and whether it
    compresses: int8 from the step's ``equations`` (its uint8 all-to-all), PowerSGD and top-k
    from what ``tx`` sends (factored leaves; ``k`` of ``n`` entries)."""
    if tx.method == "int8":
        sent = [e for e in equations if e.primitive.name == "all_to_all"]
        sent = [e for e in sent if e.invars[0].aval.dtype == jnp.uint8]
        said = f"({len(sent)} uint8 all-to-all per step)"
        return f"gradients reduced in int8 with error feedback {said}", bool(sent)
    if tx.method == "powersgd":
        return (
            f"gradients reduced by PowerSGD with error feedback: {len(tx.factored)} of "
            f"{len(tx.shapes)} leaves sent as rank-{tx.rank} factors, the rest whole",
            len(tx.factored) > 0,
        )
    k, n = tx.k, sum(math.prod(s) for s in tx.shapes)
    said = f"{k:,} of {n:,} entries sent per device"
    return f"gradients reduced by top-k with error feedback: {said}", k < n
