"""The layers of the DynamicConv Transformer: LayerNorm, attention, encoder and decoder layers.

Encoder layer (post-norm, no GLU, fairseq ``LightConvEncoderLayer``)::

    h = Linear(C, C)(x);  h = 0 at padded source positions;  h = conv(h);  h = Linear(C, C)(h)
    x = LayerNorm(x + dropout(h))
    x = LayerNorm(x + dropout(fc2(dropout_relu(relu(fc1(x))))))

Decoder layer: the same conv block with a causal conv, then encoder-decoder attention (padded
source positions masked), then the FFN, each followed by ``LayerNorm(x + dropout(.))``.

Embeddings are scaled by ``sqrt(C)`` and added to fairseq's sinusoidal positions
(:func:`sinusoidal_positions`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.blocks.policy import DOT_OUT
from lowmem_jax.models.dynamic_conv.conv import DynamicConv, LightConv, _deterministic, _linear
from lowmem_jax.techniques.factorize import FactorConfig

__all__ = [
    "LayerNorm",
    "MultiHeadAttention",
    "EncoderLayer",
    "DecoderLayer",
    "sinusoidal_positions",
    "layer_runs",
    "embed_init",
]


@jax.checkpoint
def _layer_moments(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    # Checkpointed so the float32 view of x is recomputed in the backward pass, never stored.
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    # max(., 0): E[x^2] - E[x]^2 can round below zero.
    var = jnp.maximum((x32 * x32).mean(-1, keepdims=True) - mean * mean, 0.0)
    return mean, var


class LayerNorm(nn.Module):
    """LayerNorm over the last axis whose saved activations stay in the computation dtype.

    ``flax.linen.LayerNorm`` normalises in ``promote(x.dtype, float32)``, so under bf16 the
    backward pass keeps float32 ``[B, T, C]`` copies per norm (the same issue
    :class:`lowmem_jax.models.layers.BatchNorm` fixes). Here the statistics are float32 and
    checkpointed, and the normalisation is one affine map per position in ``dtype``::

        mean, var = E_c[x], E_c[x^2] - E_c[x]^2        (float32, [..., 1])
        r         = 1 / sqrt(var + eps)
        y         = (x * r - mean * r) * scale + bias   (in dtype)

    Parameters ``scale`` (ones) and ``bias`` (zeros), ``[C]``, as ``nn.LayerNorm``.
    """

    epsilon: float = 1e-5
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,))
        bias = self.param("bias", nn.initializers.zeros, (c,))
        dtype = self.dtype or jnp.result_type(x, scale)
        mean, var = _layer_moments(x)
        r = jax.lax.rsqrt(var + self.epsilon)
        y = x.astype(dtype) * r.astype(dtype) - (mean * r).astype(dtype)
        return y * scale.astype(dtype) + bias.astype(dtype)


class MultiHeadAttention(nn.Module):
    """Encoder-decoder attention (fairseq ``MultiheadAttention``), ``[B, T, C] -> [B, T, C]``.

    ``softmax((q W_q + b_q)(k W_k + b_k)^T / sqrt(C / H))`` per head, with the key positions where
    ``key_mask`` is False set to a large negative value; softmax in float32; dropout on the
    probabilities; output projection ``W_o`` with bias. Params: 4 x (``C*C + C``).
    """

    num_heads: int
    dropout: float = 0.0
    dtype: Any = None
    factorize: FactorConfig | None = None

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        memory: jax.Array | None,
        key_mask: jax.Array,
        train: bool = False,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """``query [B, T, C]``, ``memory [B, S, C]``, ``key_mask [B, S]`` bool (True = real).

        ``kv``: the projections ``(k_proj(memory), v_proj(memory))``, ``[B, S, C]`` each, computed
        once for incremental decoding (see ``DynamicConvTransformer.init_cache``); ``memory`` is
        then unused.
        """
        b, t, c = query.shape
        h = self.num_heads
        if c % h:
            raise ValueError(f"num_heads must divide the channels ({c}), got {h}")
        # fairseq scales the q/k/v init by 1/sqrt(2) when the three share one dimension.
        qkv_init = nn.initializers.variance_scaling(0.5, "fan_avg", "uniform")
        proj = functools.partial(_linear(self.factorize), c, dtype=self.dtype, kernel_init=qkv_init)
        q = proj(name="q_proj")(query).reshape(b, t, h, c // h)
        if kv is None:
            kv = proj(name="k_proj")(memory), proj(name="v_proj")(memory)
        k = kv[0].reshape(b, -1, h, c // h)
        v = kv[1].reshape(b, -1, h, c // h)
        scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(c // h)
        # A finite fill, not -inf: an all-padding source row gives uniform weights, not NaN.
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        probs = nn.Dropout(self.dropout)(probs, deterministic=_deterministic(self, train))
        out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, c)
        out = checkpoint_name(out, DOT_OUT)
        return _linear(self.factorize)(c, dtype=self.dtype, name="out_proj")(out)


class _LayerMixin(nn.Module):
    """Config shared by :class:`EncoderLayer` and :class:`DecoderLayer`."""

    num_heads: int
    kernel_size: int
    ffn_dim: int
    conv_type: str = "dynamic"
    weight_softmax: bool = True
    dropout: float = 0.0
    relu_dropout: float = 0.0
    weight_dropout: float = 0.0
    dtype: Any = None
    factorize: FactorConfig | None = None

    def _conv_block(
        self, x: jax.Array, padding: str, src_mask, train: bool, prev: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``LayerNorm(x + dropout(Linear(conv(mask(Linear(x))))))``.

        With ``prev [B, K - 1, C]`` (incremental decoding, causal conv): ``x [B, 1, C]`` is one
        new position, ``prev`` the conv inputs (outputs of ``linear1``) of the ``K - 1`` positions
        before it; returns ``(out [B, 1, C], new_prev [B, K - 1, C])`` (``prev`` shifted by one,
        the new input appended; dtype of ``prev``).
        """
        det = _deterministic(self, train)
        h = _linear(self.factorize)(x.shape[-1], dtype=self.dtype, name="linear1")(x)
        new_prev = None
        if prev is not None:
            # The window is all the state a causal conv layer needs (fairseq's incremental_state
            # for LightConv/DynamicConv decoders); its kernel is predicted from h alone.
            # (The cast is a no-op with init_cache's dtypes; it keeps a loop carry's dtype fixed.)
            new_prev = jnp.concatenate([prev, h.astype(prev.dtype)], axis=1)[:, 1:]
        if src_mask is not None:
            # fairseq zeroes padded positions before the conv so they neither feed real positions'
            # windows nor (through the kernel prediction) anything else.
            h = jnp.where(src_mask[..., None], h, jnp.zeros((), h.dtype))
        conv_cls = {"dynamic": DynamicConv, "lightweight": LightConv}[self.conv_type]
        h = conv_cls(
            num_heads=self.num_heads,
            kernel_size=self.kernel_size,
            padding=padding,
            weight_softmax=self.weight_softmax,
            weight_dropout=self.weight_dropout,
            dtype=self.dtype,
            name="conv",
        )(h, train=train, prev=prev)
        # The conv is a K-step scan, not a dot: tag its output so `dots` saves it like a matmul
        # output instead of re-running the scan in the backward pass.
        h = checkpoint_name(h, DOT_OUT)
        h = _linear(self.factorize)(x.shape[-1], dtype=self.dtype, name="linear2")(h)
        h = nn.Dropout(self.dropout)(h, deterministic=det)
        out = self._norm("conv_layer_norm")(x + h.astype(x.dtype))
        return out if prev is None else (out, new_prev)

    def _ffn_block(self, x: jax.Array, train: bool) -> jax.Array:
        """``LayerNorm(x + dropout(fc2(dropout_relu(relu(fc1(x))))))``."""
        det = _deterministic(self, train)
        h = nn.relu(_linear(self.factorize)(self.ffn_dim, dtype=self.dtype, name="fc1")(x))
        h = nn.Dropout(self.relu_dropout)(h, deterministic=det)
        h = _linear(self.factorize)(x.shape[-1], dtype=self.dtype, name="fc2")(h)
        h = nn.Dropout(self.dropout)(h, deterministic=det)
        return self._norm("final_layer_norm")(x + h.astype(x.dtype))

    def _norm(self, name: str) -> nn.Module:
        return LayerNorm(epsilon=1e-5, dtype=self.dtype, name=name)


class EncoderLayer(_LayerMixin):
    """Post-norm encoder layer ``[B, S, C] -> [B, S, C]``: centred conv block, then FFN.

    Called as ``layer(x, src_mask, train=...)`` with ``src_mask [B, S]`` bool (True = real token).
    """

    @nn.compact
    def __call__(self, x: jax.Array, src_mask: jax.Array, train: bool = False) -> jax.Array:
        x = self._conv_block(x, "same", src_mask, train)
        return self._ffn_block(x, train)


class DecoderLayer(_LayerMixin):
    """Post-norm decoder layer ``[B, T, C] -> [B, T, C]``: causal conv, cross-attention, FFN.

    Called as ``layer(x, memory, src_mask, train=...)`` with the encoder output
    ``memory [B, S, C]`` and ``src_mask [B, S]`` bool (True = real source token). Target padding
    needs no mask: the conv is causal, so trailing pads never reach earlier positions.
    """

    attention_dropout: float = 0.0

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array | None,
        src_mask: jax.Array,
        train: bool = False,
        cache: dict[str, jax.Array] | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``x [B, T, C]`` -> ``[B, T, C]``; or one incremental decoding step with ``cache``.

        ``cache`` = ``{"conv": [B, K - 1, C], "k": [B, S, C], "v": [B, S, C]}``: the conv inputs
        of the previous ``K - 1`` positions and the encoder-decoder attention's key / value
        projections of ``memory`` (which is then unused). ``x`` is then ``[B, 1, C]`` (the new
        position) and the result ``(y [B, 1, C], new conv window [B, K - 1, C])``.
        """
        if cache is None:
            x = self._conv_block(x, "causal", None, train)
            memory, kv = memory.astype(x.dtype), None
        else:
            x, new_conv = self._conv_block(x, "causal", None, train, prev=cache["conv"])
            kv = cache["k"], cache["v"]
        h = MultiHeadAttention(
            self.num_heads,
            self.attention_dropout,
            dtype=self.dtype,
            factorize=self.factorize,
            name="encoder_attn",
        )(x, memory, src_mask, train=train, kv=kv)
        h = nn.Dropout(self.dropout)(h, deterministic=_deterministic(self, train))
        x = self._norm("encoder_attn_layer_norm")(x + h.astype(x.dtype))
        x = self._ffn_block(x, train)
        return x if cache is None else (x, new_conv)


def sinusoidal_positions(tokens: jax.Array, dim: int, pad_id: int = 0) -> jax.Array:
    """fairseq's ``SinusoidalPositionalEmbedding`` for ``tokens [B, T]`` -> ``[B, T, dim]`` f32.

    Position of a real token = ``pad_id + (number of real tokens up to and including it)``, so the
    first real token sits at ``pad_id + 1`` and left or right padding never shifts positions;
    padded positions get zeros. ``emb[p] = [sin(p f_0..f_{d/2-1}), cos(p f_0..)]`` with
    ``f_i = 10000^(-i / (d/2 - 1))`` (zero column appended for odd ``dim``).
    """
    if dim < 4:
        raise ValueError(f"dim must be >= 4 for sinusoidal positions, got {dim}")
    real = tokens != pad_id
    positions = (jnp.cumsum(real, axis=1) + pad_id).astype(jnp.float32)
    return jnp.where(real[..., None], _sinusoid(positions, dim), 0.0)


def _sinusoid(positions: jax.Array, dim: int) -> jax.Array:
    """float32 positions ``[...]`` -> ``[..., dim]`` float32 (:func:`sinusoidal_positions`)."""
    half = dim // 2
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000.0) / (half - 1)))
    angles = positions[..., None] * freqs
    emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
    return emb


def layer_runs(kernel_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[3, 7, 31, 31]`` -> ``[(3, 1), (7, 1), (31, 2)]``: runs of equal (same-shape) layers."""
    return [(k, len(list(g))) for k, g in itertools.groupby(kernel_sizes)]


def embed_init(pad_id: int, std: float):
    """Normal(0, std) with a zero row at ``pad_id``, as fairseq's ``Embedding``."""

    def init(key, shape, dtype=jnp.float32):
        w = jax.random.normal(key, shape, dtype) * std
        return w.at[pad_id].set(0) if 0 <= pad_id < shape[0] else w

    return init
