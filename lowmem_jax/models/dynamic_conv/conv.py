"""The convolutions of the DynamicConv Transformer (Wu et al., 2019; fairseq's lightconv).

A convolution whose kernel is either a learned parameter (:class:`LightConv`, "lightweight") or
predicted per position from the input (:class:`DynamicConv`). With ``C`` channels, ``H`` heads
(each head's kernel is shared by ``R = C / H`` consecutive channels) and kernel size ``K``:

    w[b, t, h, :] = softmax_k(W x[b, t])[h]          DynamicConv: W is Linear(C -> H*K), no bias
    w[h, :]       = softmax_k(w_param[h])            LightConv
    y[b, t, c]    = sum_k w[.., h(c), k] * x[b, t + k - P, c]   (zero outside [0, T))

``P = K - 1`` (causal, decoder) or ``(K - 1) // 2`` (centred, encoder; ``K // 2`` for odd K).
Weight dropout is applied to ``w`` after the softmax, as fairseq does.

The convolution (:func:`apply_conv_weights`) is a ``lax.scan`` over the ``K`` taps of shifted
slices, accumulated in float32: ``O(B T C)`` memory in the forward and backward pass (fairseq's
expanded form builds ``[B*H, T, T]`` band matrices, its unfolded form ``[T, B, C, K]``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowmem_jax.techniques.factorize import FactorConfig, dense_layer

__all__ = [
    "DynamicConv",
    "LightConv",
    "apply_conv_weights",
    "apply_conv_weights_step",
    "CONV_TYPES",
]

CONV_TYPES = ("dynamic", "lightweight")
PADDINGS = ("same", "causal")


def _linear(factorize: FactorConfig | None) -> Callable[..., nn.Module]:
    """fairseq's ``Linear`` (lightconv.py): Xavier-uniform weights, zero bias; low-rank
    (:class:`~lowmem_jax.techniques.factorize.LowRankDense`) under ``factorize``."""
    return functools.partial(
        dense_layer,
        factorize,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.zeros,
    )


_dense = _linear(None)


def _check_dropout(name: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}")


def _padding_left(kernel_size: int, padding: str) -> int:
    """Left padding ``P``: ``K - 1`` for ``causal``; ``(K - 1) // 2`` for ``same``."""
    if padding == "causal":
        return kernel_size - 1
    if padding == "same":
        return (kernel_size - 1) // 2
    raise ValueError(f"Unknown padding={padding!r}; allowed values: {list(PADDINGS)}")


def _deterministic(module: nn.Module, train: bool) -> bool:
    # Dropout runs only in training with a "dropout" rng, the rule ScannedBlocks follows when it
    # hands (or does not hand) each block a key.
    return not (train and module.has_rng("dropout"))


def apply_conv_weights(x: jax.Array, weights: jax.Array, padding_left: int) -> jax.Array:
    """Per-head 1D convolution with per-position (or shared) kernels.

    Args:
      x: ``[B, T, C]``.
      weights: ``[B, T, H, K]`` (dynamic) or ``[1, 1, H, K]`` (shared); ``C % H == 0``; head ``h``
        covers channels ``h * R .. (h + 1) * R - 1`` with ``R = C / H``.
      padding_left: ``P``; zeros are padded so that ``y[t] = sum_k w[t, k] x[t + k - P]``.

    Returns:
      ``[B, T, C]`` in the dtype of ``x * weights``.

    A sum of ``K`` shifted slices, accumulated in a ``lax.scan`` over ``k``: no ``[B, T, K, C]``
    unfolded copy and no ``T x T`` band matrix (fairseq's two forms), so the forward and the
    backward pass hold ``O(B T C)`` whatever ``K``, and the traced program does not grow with
    ``K``. The scan body is checkpointed so its backward pass re-slices the padded input instead
    of saving ``K`` shifted copies of it.
    """
    b, t, c = x.shape
    h, k = weights.shape[-2:]
    dtype = jnp.result_type(x, weights)
    xp = jnp.pad(x.astype(dtype), ((0, 0), (padding_left, k - 1 - padding_left), (0, 0)))
    xp = xp.reshape(b, t + k - 1, h, c // h)
    w_by_k = jnp.moveaxis(weights.astype(dtype), -1, 0)  # [K, B or 1, T or 1, H]

    # Accumulate in (at least) float32, as a matmul would: K bf16 roundings would cost ~log2(K)
    # bits of an 8-bit mantissa. Only this [B, T, C] carry is wide; residuals stay in `dtype`.
    acc_dtype = jnp.promote_types(dtype, jnp.float32)

    @jax.checkpoint
    def body(out, step):
        i, w_i = step
        window = jax.lax.dynamic_slice_in_dim(xp, i, t, axis=1)
        return out + (window * w_i[..., None]).astype(acc_dtype), None

    out = jnp.zeros((b, t, h, c // h), acc_dtype)
    out, _ = jax.lax.scan(body, out, (jnp.arange(k), w_by_k))
    return out.reshape(b, t, c).astype(dtype)


def apply_conv_weights_step(window: jax.Array, weights: jax.Array) -> jax.Array:
    """One output position of a causal :func:`apply_conv_weights`, from its input window.

    Args:
      window: ``[B, K, C]``: the inputs ``x[t - K + 1 .. t]`` (zeros before the sequence start).
      weights: ``[B, H, K]`` (dynamic: position ``t``'s kernel) or ``[1, H, K]`` (shared).

    Returns:
      ``y[t] = sum_k w[k] x[t - K + 1 + k]``, ``[B, C]`` in the dtype of ``window * weights``;
      equal to ``apply_conv_weights(x, w, K - 1)[:, t]``, with the same rounding: products in
      that dtype, sum accumulated in (at least) float32.
    """
    b, k, c = window.shape
    h = weights.shape[-2]
    dtype = jnp.result_type(window, weights)
    acc_dtype = jnp.promote_types(dtype, jnp.float32)
    xw = window.astype(dtype).reshape(b, k, h, c // h)
    w = jnp.swapaxes(weights.astype(dtype), -1, -2)[..., None]  # [B or 1, K, H, 1]
    return (xw * w).astype(acc_dtype).sum(axis=1).reshape(b, c).astype(dtype)


class _ConvBase(nn.Module):
    """Shared fields of :class:`DynamicConv` and :class:`LightConv`."""

    num_heads: int
    kernel_size: int
    padding: str = "same"
    weight_softmax: bool = True
    weight_dropout: float = 0.0
    dtype: Any = None

    def _validate(self, channels: int) -> None:
        if self.kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {self.kernel_size}")
        if self.num_heads < 1 or channels % self.num_heads:
            raise ValueError(
                f"num_heads must be >= 1 and divide the channels ({channels}), got {self.num_heads}"
            )
        _check_dropout("weight_dropout", self.weight_dropout)
        _padding_left(self.kernel_size, self.padding)

    def _normalize(self, logits: jax.Array, dtype: Any, train: bool) -> jax.Array:
        """Softmax over ``K`` in float32 (as fairseq), then weight dropout; cast to ``dtype``."""
        if self.weight_softmax:
            w = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
        else:
            w = logits.astype(dtype)
        return nn.Dropout(self.weight_dropout)(w, deterministic=_deterministic(self, train))

    def _step(self, x: jax.Array, prev: jax.Array, w: jax.Array) -> jax.Array:
        """Incremental decoding: the causal conv at the newest position only.

        ``x [B, 1, C]`` is the newest input, ``prev [B, K - 1, C]`` the ``K - 1`` inputs before it
        (zeros before the sequence start: the causal conv's zero padding), ``w`` its kernel,
        ``[B, H, K]`` or ``[1, H, K]``. Returns ``[B, 1, C]``, what the full-sequence call gives
        at that position.
        """
        if self.padding != "causal":
            raise ValueError(f"incremental steps need padding='causal', got {self.padding!r}")
        window = jnp.concatenate([prev.astype(x.dtype), x], axis=1)  # [B, K, C]
        return apply_conv_weights_step(window, w)[:, None]


class DynamicConv(_ConvBase):
    """Dynamic convolution ``[B, T, C] -> [B, T, C]`` (fairseq ``DynamicConv1dTBC``).

    The kernel for position ``t`` is predicted from ``x[t]`` by ``Linear(C -> H*K)`` without bias
    (param ``weight_linear/kernel [C, H*K]``, head-major: column ``h * K + k``).

    Attributes:
      num_heads: ``H``; must divide ``C``.
      kernel_size: ``K``.
      padding: ``"same"`` (centred, ``P = (K - 1) // 2``) or ``"causal"`` (``P = K - 1``).
      weight_softmax: normalise each kernel with a softmax over ``K``.
      weight_dropout: dropout rate on the normalised kernel (training only).
      dtype: computation dtype (``None``: follow inputs and parameters).
    """

    @nn.compact
    def __call__(
        self, x: jax.Array, train: bool = False, prev: jax.Array | None = None
    ) -> jax.Array:
        """``x [B, T, C]`` -> ``[B, T, C]``; or one causal step (``prev``, see ``_step``)."""
        b, t, c = x.shape
        self._validate(c)
        h, k = self.num_heads, self.kernel_size
        logits = _dense(h * k, use_bias=False, dtype=self.dtype, name="weight_linear")(x)
        w = self._normalize(logits.reshape(b, t, h, k), logits.dtype, train)
        if prev is not None:
            return self._step(x.astype(w.dtype), prev, w[:, 0])
        return apply_conv_weights(x.astype(w.dtype), w, _padding_left(k, self.padding))


class LightConv(_ConvBase):
    """Lightweight convolution ``[B, T, C] -> [B, T, C]``: one learned ``[H, K]`` kernel.

    Same attributes as :class:`DynamicConv`; the parameter is ``weight [H, K]``, initialised
    ``uniform(-l, l)`` with ``l = sqrt(6 / (K + H K))``: the Xavier-uniform range of fairseq's
    ``[H, 1, K]`` ``LightweightConv1dTBC`` weight.
    """

    @nn.compact
    def __call__(
        self, x: jax.Array, train: bool = False, prev: jax.Array | None = None
    ) -> jax.Array:
        """``x [B, T, C]`` -> ``[B, T, C]``; or one causal step (``prev``, see ``_step``)."""
        self._validate(x.shape[-1])
        h, k = self.num_heads, self.kernel_size
        # fairseq's weight is [H, 1, K]: torch's Xavier fans are K (in) and H * K (out).
        limit = math.sqrt(6.0 / (k + h * k))

        def init(key, shape, dtype=jnp.float32):
            return jax.random.uniform(key, shape, dtype, -limit, limit)

        weight = self.param("weight", init, (h, k))
        dtype = self.dtype or jnp.result_type(x, weight)
        w = self._normalize(weight[None, None], dtype, train)
        if prev is not None:
            return self._step(x.astype(dtype), prev, w[:, 0])
        return apply_conv_weights(x.astype(dtype), w, _padding_left(k, self.padding))
