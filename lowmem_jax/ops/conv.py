"""2D convolution whose backward pass stays fast inside loop bodies on XLA:CPU.

Shapes and dtypes
-----------------
``x`` is NHWC ``[B, H, W, C_in]``, ``kernel`` is HWIO ``[KH, KW, C_in, C_out]``,
the output is NHWC ``[B, H_out, W_out, C_out]`` in the promoted dtype of ``x``
and ``kernel`` (float32, bfloat16, float16). Gradients come back in the dtype of
the corresponding primal input.

Why
---
Inside a ``lax.scan`` body (also flax ``nn.scan``) XLA:CPU gives the convs that
JAX emits for a conv's transpose (non-canonical ``dimension_numbers``, e.g. the
weight gradient as ``f01b_i01o->01bf``; jax issue #12868) a slow layout: 30-100x
slower than the same op outside the loop, where layout assignment rewrites them
into canonical convs plus transposes. A non-canonical spec on even the tiny
kernel alone triggers it. ``impl="loop_friendly"`` is a ``jax.custom_vjp`` whose
backward is only canonical NHWC/HWIO forward convs, explicit transposes, and
matmuls, so it compiles to the same fast code inside and outside loops.

Math (per spatial axis: size ``H``, stride ``s``, kernel ``K``, padding ``(lo, hi)``)
-----------------------------------------------------------------------------------
Forward: ``y[o] = sum_k x[o*s + k - lo] . w[k]``, ``H_out = (H + lo + hi - K) // s + 1``.

Input gradient: a conv of ``dy`` dilated by ``s`` with the spatially flipped
kernel, in/out channels swapped::

    dx = conv(dy, flip(w).swap(I, O), lhs_dilation=s,
              padding=(K - 1 - lo, H + lo - (H_out - 1) * s - 1))

The padding makes ``dx`` exactly ``H`` long; either side may be negative (a crop),
e.g. the high side when the forward conv never read trailing input rows. For
``s > 1`` the same sum is evaluated without the inserted zeros, phase by phase:
``dx[t*s + r - lo] = sum_j dy[t - j] . w[r + j*s]^T``, i.e. for each phase
``r < s`` a stride-1 conv with the sub-kernel ``w[r::s]``; the ``s*s`` phase
results are interleaved (plain conv with ``lhs_dilation`` wastes ``1 - 1/s^2``
of its multiplies on zeros, and XLA:CPU runs it on a slower path).

Weight gradient: a conv that contracts over the batch. ``x`` transposed to
``[C_in, H, W, B]`` is the lhs (N=C_in, C=B), ``dy`` transposed to
``[H_out, W_out, B, C_out]`` the HWIO rhs (I=B, O=C_out)::

    dw = conv(x^T, dy^T, rhs_dilation=s,
              padding=(lo, K + (H_out - 1) * s - H - lo))   # [C_in, KH, KW, C_out]

then transposed to ``[KH, KW, C_in, C_out]``. The high padding makes the output
exactly ``K`` long; it is negative (a crop) when trailing input rows were unread.

For 1x1 kernels both gradients are matmuls: ``dw = x_s^T dy`` over the strided
subsample ``x_s`` of (padded) ``x``, and ``dx`` is ``dy w^T`` scattered back onto
the strided grid with ``lax.pad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

__all__ = ["IMPLS", "Conv", "conv2d", "explicit_padding"]

IMPLS = ("auto", "xla", "loop_friendly")
_PADDING_STRINGS = ("SAME", "VALID")
_NHWC = ("NHWC", "HWIO", "NHWC")

Padding = str | Sequence[tuple[int, int]]
Pads = tuple[tuple[int, int], tuple[int, int]]


def _resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "loop_friendly" if jax.default_backend() == "cpu" else "xla"
    return impl


def explicit_padding(
    padding: Padding, in_hw: Sequence[int], k_hw: Sequence[int], strides: Sequence[int]
) -> Pads:
    """Padding "SAME" / "VALID" / pairs -> hashable ((lo_h, hi_h), (lo_w, hi_w))."""
    error = ValueError(
        f"padding must be one of {_PADDING_STRINGS} or 2 (low, high) int pairs, got {padding!r}"
    )
    if isinstance(padding, str):
        if padding not in _PADDING_STRINGS:
            raise error
        return tuple(lax.padtype_to_pads(in_hw, k_hw, strides, padding))  # type: ignore[return-value]
    try:
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    except (TypeError, ValueError):
        raise error from None
    if len(pads) != 2:
        raise error
    return pads  # type: ignore[return-value]


def _conv(lhs, rhs, strides=(1, 1), padding=((0, 0), (0, 0)), lhs_dilation=None, rhs_dilation=None):
    """Forward conv in the canonical NHWC/HWIO layout that XLA:CPU handles well."""
    return lax.conv_general_dilated(
        lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, dimension_numbers=_NHWC
    )


def _flip_swap(w: jax.Array) -> jax.Array:
    # Explicit flip + transpose: a "HWOI" dimension spec instead is slow in loops.
    return jnp.swapaxes(jnp.flip(w, (0, 1)), 2, 3)


def _grad_input(dy: jax.Array, w: jax.Array, in_hw, strides, pads) -> jax.Array:
    b, out_hw = dy.shape[0], dy.shape[1:3]
    (kh, kw), c_in = w.shape[:2], w.shape[2]
    axes = list(zip(in_hw, out_hw, w.shape[:2], strides, (lo for lo, _ in pads), strict=True))
    zero = jnp.zeros((), dy.dtype)
    if (kh, kw) == (1, 1):
        # dy @ w^T scattered onto the strided grid; lax.pad adds the interior and
        # edge zeros (negative edge padding crops rows that only saw padding).
        g = jnp.einsum("bhwo,io->bhwi", dy, w[0, 0])
        cfg = [(-lo, n + lo - (m - 1) * s - 1, s - 1) for n, m, _, s, lo in axes]
        return lax.pad(g, zero, [(0, 0, 0), *cfg, (0, 0, 0)])
    if strides == (1, 1):
        conv_pads = [(k - 1 - lo, n + lo - m) for n, m, k, _, lo in axes]
        return _conv(dy, _flip_swap(w), padding=conv_pads)
    # Phase decomposition on the grid t = i + lo in [0, q*s), cropped/padded back
    # to [0, H) at the end.
    qs = [-(-(n + lo) // s) for n, _, _, s, lo in axes]  # ceil((H + lo) / s)
    if min(qs) <= 0:  # the padding cropped away every input pixel
        return jnp.zeros((b, *in_hw, c_in), dy.dtype)
    rows = []
    for rh in range(strides[0]):
        cols = []
        for rw in range(strides[1]):
            w_r = _flip_swap(w[rh :: strides[0], rw :: strides[1]])
            if w_r.size == 0:  # kernel smaller than the stride: no tap hits this phase
                cols.append(jnp.zeros((b, *qs, c_in), dy.dtype))
                continue
            # Only the grid rows t that land inside the input (0 <= t*s + r - lo < H) are
            # computed; the rest of the phase's q rows are the crop's zeros.
            spans = [
                (max(0, -((r - lo) // s)), min(q, (n - 1 + lo - r) // s + 1))
                for (n, _, _, s, lo), q, r in zip(axes, qs, (rh, rw), strict=True)
            ]
            if any(t1 <= t0 for t0, t1 in spans):
                cols.append(jnp.zeros((b, *qs, c_in), dy.dtype))
                continue
            conv_pads = [
                (k - 1 - t0, t1 - m)
                for k, m, (t0, t1) in zip(w_r.shape[:2], out_hw, spans, strict=True)
            ]
            edges = [(t0, q - t1, 0) for (t0, t1), q in zip(spans, qs, strict=True)]
            g = _conv(dy, w_r, padding=conv_pads)
            cols.append(lax.pad(g, zero, [(0, 0, 0), *edges, (0, 0, 0)]))
        rows.append(jnp.stack(cols, 3))  # [B, q_h, q_w, s_w, C_in]
    z = jnp.stack(rows, 2).reshape(b, qs[0] * strides[0], qs[1] * strides[1], c_in)
    cfg = [(-lo, n + lo - q * s, 0) for (n, _, _, s, lo), q in zip(axes, qs, strict=True)]
    return lax.pad(z, zero, [(0, 0, 0), *cfg, (0, 0, 0)])


def _grad_kernel(x: jax.Array, dy: jax.Array, k_hw, strides, pads) -> jax.Array:
    out_hw = dy.shape[1:3]
    if tuple(k_hw) == (1, 1):
        # x_s^T dy with x_s the strided subsample of the padded x.
        xs = lax.pad(
            x, jnp.zeros((), x.dtype), [(0, 0, 0), (*pads[0], 0), (*pads[1], 0), (0, 0, 0)]
        )
        (sh, sw), (mh, mw) = strides, out_hw
        xs = xs[:, : (mh - 1) * sh + 1 : sh, : (mw - 1) * sw + 1 : sw]
        return jnp.einsum("bhwi,bhwo->io", xs, dy)[None, None]
    axes = zip(x.shape[1:3], out_hw, k_hw, strides, pads, strict=True)
    conv_pads = [(lo, k + (m - 1) * s - n - lo) for n, m, k, s, (lo, _) in axes]
    # Explicit transposes: the same contraction via dimension_numbers
    # ("CHWN", "IHWO", "HWNC") is exactly JAX's own rule, the slow one in loops.
    x_t, dy_t = jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(dy, (1, 2, 0, 3))
    g = _conv(x_t, dy_t, padding=conv_pads, rhs_dilation=strides)  # [C_in, KH, KW, C_out]
    return jnp.transpose(g, (1, 2, 0, 3))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv_loop_friendly(x: jax.Array, w: jax.Array, strides: tuple[int, int], pads: Pads):
    return _conv(x, w, strides, pads)


def _fwd(x, w, strides, pads):
    return _conv(x, w, strides, pads), (x, w)


def _bwd(strides, pads, res, dy):
    x, w = res
    if dy.size == 0:  # empty output or batch: XLA rejects the zero-sized backward convs
        return jnp.zeros_like(x), jnp.zeros_like(w)
    dx = _grad_input(dy, w, x.shape[1:3], strides, pads)
    dw = _grad_kernel(x, dy, w.shape[:2], strides, pads)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv_loop_friendly.defvjp(_fwd, _bwd)


def conv2d(
    x: jax.Array,
    kernel: jax.Array,
    strides: Sequence[int] = (1, 1),
    padding: Padding = "SAME",
    impl: str = "auto",
) -> jax.Array:
    """2D conv: ``x`` NHWC ``[B, H, W, C_in]``, ``kernel`` HWIO ``[KH, KW, C_in, C_out]``.

    Returns NHWC ``[B, H_out, W_out, C_out]`` in the promoted dtype of ``x`` and
    ``kernel``; gradients come back in each input's own dtype.

    Args:
      strides: 2 positive ints.
      padding: "SAME", "VALID" or ``[(lo_h, hi_h), (lo_w, hi_w)]`` (may be negative).
      impl: "xla" = ``lax.conv_general_dilated`` with JAX's autodiff; "loop_friendly"
        = custom VJP built from forward convs (fast inside ``lax.scan`` on XLA:CPU);
        "auto" = "loop_friendly" on the CPU backend, else "xla".
    """
    impl = _resolve_impl(impl)
    if x.ndim != 4 or kernel.ndim != 4:
        raise ValueError(
            f"conv2d wants 4D x (NHWC) and kernel (HWIO), got {x.shape}, {kernel.shape}"
        )
    strides = tuple(int(s) for s in strides)
    if len(strides) != 2 or min(strides) < 1:
        raise ValueError(f"strides must be 2 positive ints, got {strides}")
    pads = explicit_padding(padding, x.shape[1:3], kernel.shape[:2], strides)
    dtype = jnp.promote_types(x.dtype, kernel.dtype)
    # Cast outside the custom VJP: autodiff of astype returns each grad in its primal dtype.
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    if impl == "xla":
        return _conv(x, kernel, strides, pads)
    return _conv_loop_friendly(x, kernel, strides, pads)


class Conv(nn.Module):
    """Drop-in for ``flax.linen.Conv`` (2D, no groups/dilation) built on :func:`conv2d`.

    Params: ``kernel`` HWIO ``[KH, KW, C_in, features]`` and, if ``use_bias``,
    ``bias`` ``[features]``: the names and shapes of ``nn.Conv``. Inputs are
    ``[..., H, W, C_in]`` (leading dims are flattened into the batch); inputs and
    params are cast to ``dtype`` (None: their promoted dtype) as in flax.
    """

    features: int
    kernel_size: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: Padding = "SAME"
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
    bias_init: Any = nn.initializers.zeros
    impl: str = "auto"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        shape = (*self.kernel_size, inputs.shape[-1], self.features)
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        x = inputs.reshape(-1, *inputs.shape[-3:])
        y = conv2d(x, kernel, self.strides, self.padding, self.impl)
        y = y.reshape(*inputs.shape[:-3], *y.shape[1:])
        return y if bias is None else y + bias
