"""DynamicConv Transformer (Wu et al., 2019), fairseq's ``lightconv_iwslt_de_en`` layout.

An encoder-decoder for translation in which self-attention is replaced by a convolution whose
kernel is either a learned parameter (:class:`LightConv`, "lightweight") or predicted per
position from the input (:class:`DynamicConv`). With ``C`` channels, ``H`` heads (each head's
kernel is shared by ``R = C / H`` consecutive channels) and kernel size ``K``:

    w[b, t, h, :] = softmax_k(W x[b, t])[h]          DynamicConv: W is Linear(C -> H*K), no bias
    w[h, :]       = softmax_k(w_param[h])            LightConv
    y[b, t, c]    = sum_k w[.., h(c), k] * x[b, t + k - P, c]   (zero outside [0, T))

``P = K - 1`` (causal, decoder) or ``(K - 1) // 2`` (centred, encoder; ``K // 2`` for odd K).
Weight dropout is applied to ``w`` after the softmax, as fairseq does.

Encoder layer (post-norm, no GLU, fairseq ``LightConvEncoderLayer``)::

    h = Linear(C, C)(x);  h = 0 at padded source positions;  h = conv(h);  h = Linear(C, C)(h)
    x = LayerNorm(x + dropout(h))
    x = LayerNorm(x + dropout(fc2(dropout_relu(relu(fc1(x))))))

Decoder layer: the same conv block with a causal conv, then encoder-decoder attention (padded
source positions masked), then the FFN, each followed by ``LayerNorm(x + dropout(.))``.

Embeddings are scaled by ``sqrt(C)`` and added to fairseq's sinusoidal positions (sin half, cos
half; positions count non-pad tokens from ``pad_id + 1`` so padding never shifts them, and pad
positions get a zero vector). There is no final LayerNorm (post-norm). Logits are
``x @ embed_out.T`` with a separate ``[V_tgt, C]`` output matrix and no bias (untied), or the
decoder input embedding when ``share_decoder_embeddings``.

Consecutive layers with the same kernel size have identical shapes; they run as one
:class:`~lowmem_jax.remat.ScannedBlocks` stack (``lax.scan``) under the ``remat`` policy; the
other layers are stacks of length 1 so every layer goes through the same remat mechanism. The
IWSLT preset (vocabularies 8,848 / 6,632) has 38,685,184 parameters.

The convolution (:func:`apply_conv_weights`) is a ``lax.scan`` over the ``K`` taps of shifted
slices, accumulated in float32: ``O(B T C)`` memory in the forward and backward pass (fairseq's
expanded form builds ``[B*H, T, T]`` band matrices, its unfolded form ``[T, B, C, K]``).

:func:`translation_loss_fn` is the label-smoothed token cross-entropy for
:func:`lowmem_jax.make_train_step`; :func:`greedy_decode` decodes with ``encode`` and the
incremental ``init_cache`` / ``decode_step`` (each decoder layer's state is the window of its
causal conv's last ``K - 1`` inputs: there is no self-attention to cache).

Shapes: ``src_tokens [B, S]``, ``tgt_in_tokens [B, T]`` int; logits ``[B, T, V_tgt]`` in
``dtype`` (the computation dtype; ``None`` follows the parameters).
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

from lowmem_jax.data.tokenizer import BOS_ID, EOS_ID
from lowmem_jax.remat import DOT_OUT, ScannedBlocks, parse_policy
from lowmem_jax.sparsity.config import default_is_sparse

__all__ = [
    "DynamicConv",
    "LightConv",
    "MultiHeadAttention",
    "LayerNorm",
    "EncoderLayer",
    "DecoderLayer",
    "DynamicConvTransformer",
    "sinusoidal_positions",
    "translation_loss_fn",
    "greedy_decode",
    "apply_conv_weights",
    "apply_conv_weights_step",
    "CONV_TYPES",
]

CONV_TYPES = ("dynamic", "lightweight")
PADDINGS = ("same", "causal")

# fairseq's `Linear` (lightconv.py): Xavier-uniform weights, zero bias.
_dense = functools.partial(
    nn.Dense, kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.zeros
)


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
        proj = functools.partial(_dense, c, dtype=self.dtype, kernel_init=qkv_init)
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
        return _dense(c, dtype=self.dtype, name="out_proj")(out)


class _LayerMixin:
    """Config shared by :class:`EncoderLayer` and :class:`DecoderLayer`."""

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
        h = _dense(x.shape[-1], dtype=self.dtype, name="linear1")(x)
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
        h = _dense(x.shape[-1], dtype=self.dtype, name="linear2")(h)
        h = nn.Dropout(self.dropout)(h, deterministic=det)
        out = self._norm("conv_layer_norm")(x + h.astype(x.dtype))
        return out if prev is None else (out, new_prev)

    def _ffn_block(self, x: jax.Array, train: bool) -> jax.Array:
        """``LayerNorm(x + dropout(fc2(dropout_relu(relu(fc1(x))))))``."""
        det = _deterministic(self, train)
        h = nn.relu(_dense(self.ffn_dim, dtype=self.dtype, name="fc1")(x))
        h = nn.Dropout(self.relu_dropout)(h, deterministic=det)
        h = _dense(x.shape[-1], dtype=self.dtype, name="fc2")(h)
        h = nn.Dropout(self.dropout)(h, deterministic=det)
        return self._norm("final_layer_norm")(x + h.astype(x.dtype))

    def _norm(self, name: str) -> nn.Module:
        return LayerNorm(epsilon=1e-5, dtype=self.dtype, name=name)


class EncoderLayer(_LayerMixin, nn.Module):
    """Post-norm encoder layer ``[B, S, C] -> [B, S, C]``: centred conv block, then FFN.

    Called as ``layer(x, src_mask, train=...)`` with ``src_mask [B, S]`` bool (True = real token).
    """

    num_heads: int
    kernel_size: int
    ffn_dim: int
    conv_type: str = "dynamic"
    weight_softmax: bool = True
    dropout: float = 0.0
    relu_dropout: float = 0.0
    weight_dropout: float = 0.0
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, src_mask: jax.Array, train: bool = False) -> jax.Array:
        x = self._conv_block(x, "same", src_mask, train)
        return self._ffn_block(x, train)


class DecoderLayer(_LayerMixin, nn.Module):
    """Post-norm decoder layer ``[B, T, C] -> [B, T, C]``: causal conv, cross-attention, FFN.

    Called as ``layer(x, memory, src_mask, train=...)`` with the encoder output
    ``memory [B, S, C]`` and ``src_mask [B, S]`` bool (True = real source token). Target padding
    needs no mask: the conv is causal, so trailing pads never reach earlier positions.
    """

    num_heads: int
    kernel_size: int
    ffn_dim: int
    conv_type: str = "dynamic"
    weight_softmax: bool = True
    dropout: float = 0.0
    relu_dropout: float = 0.0
    weight_dropout: float = 0.0
    attention_dropout: float = 0.0
    dtype: Any = None

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
            self.num_heads, self.attention_dropout, dtype=self.dtype, name="encoder_attn"
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


def _runs(kernel_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[3, 7, 31, 31]`` -> ``[(3, 1), (7, 1), (31, 2)]``: runs of equal (same-shape) layers."""
    return [(k, len(list(g))) for k, g in itertools.groupby(kernel_sizes)]


def _embed_init(pad_id: int, std: float):
    """Normal(0, std) with a zero row at ``pad_id``, as fairseq's ``Embedding``."""

    def init(key, shape, dtype=jnp.float32):
        w = jax.random.normal(key, shape, dtype) * std
        return w.at[pad_id].set(0) if 0 <= pad_id < shape[0] else w

    return init


class DynamicConvTransformer(nn.Module):
    """The encoder-decoder; defaults are fairseq's ``lightconv_iwslt_de_en`` (module docstring).

    Attributes:
      src_vocab_size, tgt_vocab_size: vocabulary sizes (pad id included).
      embed_dim: ``C`` (encoder and decoder), divisible by ``num_heads``.
      ffn_dim: hidden width of the FFNs.
      num_heads: heads of the convolutions and of the encoder-decoder attention.
      encoder_kernel_sizes, decoder_kernel_sizes: one kernel size per layer (so their lengths are
        the layer counts).
      conv_type: ``"dynamic"`` or ``"lightweight"``.
      weight_softmax: softmax-normalise the conv kernels.
      dropout: on embeddings and every residual branch (fairseq ``--dropout``; 0.3 for IWSLT).
      attention_dropout: on encoder-decoder attention probabilities.
      weight_dropout: on normalised conv kernels.
      relu_dropout: after the FFN ReLU (fairseq default 0).
      share_decoder_embeddings: tie the output projection to the decoder input embedding.
      pad_id: the padding token id (both vocabularies).
      dtype: computation dtype (``None``: follow the parameters).
      remat: a :mod:`lowmem_jax.remat` policy name, applied per layer.
      unroll: unroll the scans over identical layers (same parameters and results).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    embed_dim: int = 512
    ffn_dim: int = 1024
    num_heads: int = 4
    encoder_kernel_sizes: tuple[int, ...] = (3, 7, 15, 31, 31, 31, 31)
    decoder_kernel_sizes: tuple[int, ...] = (3, 7, 15, 31, 31, 31)
    conv_type: str = "dynamic"
    weight_softmax: bool = True
    dropout: float = 0.3
    attention_dropout: float = 0.1
    weight_dropout: float = 0.1
    relu_dropout: float = 0.0
    share_decoder_embeddings: bool = False
    pad_id: int = 0
    dtype: Any = None
    remat: str = "none"
    unroll: bool = False

    def __post_init__(self):
        for name in ("src_vocab_size", "tgt_vocab_size", "embed_dim", "ffn_dim", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"num_heads must divide embed_dim={self.embed_dim}, got {self.num_heads}"
            )
        for name in ("encoder_kernel_sizes", "decoder_kernel_sizes"):
            sizes = tuple(getattr(self, name))
            if not sizes or any(int(k) < 1 for k in sizes):
                raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {sizes}")
        if self.conv_type not in CONV_TYPES:
            raise ValueError(
                f"Unknown conv_type={self.conv_type!r}; allowed values: {list(CONV_TYPES)}"
            )
        for name in ("dropout", "attention_dropout", "weight_dropout", "relu_dropout"):
            _check_dropout(name, getattr(self, name))
        parse_policy(self.remat)
        super().__post_init__()

    @classmethod
    def iwslt_de_en(cls, **overrides: Any) -> DynamicConvTransformer:
        """fairseq ``lightconv_iwslt_de_en`` with its IWSLT'14 vocabularies (8,848 de / 6,632 en).

        38,685,184 parameters (see ``tests/test_dynamic_conv.py`` for the breakdown).
        """
        return cls(**{"src_vocab_size": 8848, "tgt_vocab_size": 6632, **overrides})

    @classmethod
    def small(
        cls, src_vocab_size: int = 32, tgt_vocab_size: int = 32, **overrides: Any
    ) -> DynamicConvTransformer:
        """A CPU/test-sized model: C = 64, FFN 128, 4 heads, kernels (3, 5, 5) / (3, 5, 5)."""
        config = {
            "embed_dim": 64,
            "ffn_dim": 128,
            "num_heads": 4,
            "encoder_kernel_sizes": (3, 5, 5),
            "decoder_kernel_sizes": (3, 5, 5),
            "dropout": 0.1,
            "attention_dropout": 0.0,
            "weight_dropout": 0.0,
        }
        return cls(src_vocab_size, tgt_vocab_size, **{**config, **overrides})

    def setup(self):
        std = self.embed_dim**-0.5
        self.src_embed = nn.Embed(
            self.src_vocab_size,
            self.embed_dim,
            dtype=self.dtype,
            embedding_init=_embed_init(self.pad_id, std),
        )
        self.tgt_embed = nn.Embed(
            self.tgt_vocab_size,
            self.embed_dim,
            dtype=self.dtype,
            embedding_init=_embed_init(self.pad_id, std),
        )
        if not self.share_decoder_embeddings:
            self.embed_out = self.param(
                "embed_out",
                nn.initializers.normal(std),
                (self.tgt_vocab_size, self.embed_dim),
            )
        common = {
            "num_heads": self.num_heads,
            "ffn_dim": self.ffn_dim,
            "conv_type": self.conv_type,
            "weight_softmax": self.weight_softmax,
            "dropout": self.dropout,
            "relu_dropout": self.relu_dropout,
            "weight_dropout": self.weight_dropout,
            "dtype": self.dtype,
        }
        self.encoder_stacks = [
            ScannedBlocks(
                functools.partial(EncoderLayer, kernel_size=k, **common),
                n,
                self.remat,
                self.unroll,
                name=f"encoder_k{k}_{i}",
            )
            for i, (k, n) in enumerate(_runs(self.encoder_kernel_sizes))
        ]
        self.decoder_stacks = [
            ScannedBlocks(
                functools.partial(
                    DecoderLayer,
                    kernel_size=k,
                    attention_dropout=self.attention_dropout,
                    **common,
                ),
                n,
                self.remat,
                self.unroll,
                name=f"decoder_k{k}_{i}",
            )
            for i, (k, n) in enumerate(_runs(self.decoder_kernel_sizes))
        ]
        self.embed_dropout = nn.Dropout(self.dropout)

    def _embed(self, embed: nn.Embed, tokens: jax.Array, train: bool) -> jax.Array:
        x = embed(tokens) * math.sqrt(self.embed_dim)
        x = x + sinusoidal_positions(tokens, self.embed_dim, self.pad_id).astype(x.dtype)
        return self.embed_dropout(x, deterministic=_deterministic(self, train))

    def encode(self, src_tokens: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
        """``src_tokens [B, S]`` -> (``memory [B, S, C]``, ``src_mask [B, S]`` bool, True = real).

        ``memory`` at padded positions is not meaningful; ``src_mask`` masks it in attention.
        """
        src_mask = src_tokens != self.pad_id
        x = self._embed(self.src_embed, src_tokens, train)
        for stack in self.encoder_stacks:
            x = stack(x, src_mask, train=train)
        return x, src_mask

    def decode(
        self,
        tgt_in_tokens: jax.Array,
        memory: jax.Array,
        src_mask: jax.Array,
        train: bool = False,
    ) -> jax.Array:
        """``tgt_in_tokens [B, T]`` (BOS-shifted targets) -> logits ``[B, T, V_tgt]``.

        Causal: logits at ``t`` depend on ``tgt_in_tokens[:, :t + 1]`` only.
        """
        x = self._embed(self.tgt_embed, tgt_in_tokens, train)
        for stack in self.decoder_stacks:
            x = stack(x, memory.astype(x.dtype), src_mask, train=train)
        return self._output_logits(x)

    def _output_logits(self, x: jax.Array) -> jax.Array:
        """Decoder output ``[B, T, C]`` -> logits ``[B, T, V_tgt]``."""
        if self.share_decoder_embeddings:
            return self.tgt_embed.attend(x)
        w = self.embed_out
        dtype = self.dtype or jnp.result_type(x, w)
        return jnp.einsum("btc,vc->btv", x.astype(dtype), w.astype(dtype))

    # Incremental decoding (inference only: no dropout). A decoder layer has no self-attention,
    # so its state after t target tokens is the window of its causal conv's last K - 1 inputs;
    # the encoder-decoder attention's key / value projections of `memory` are fixed, so they are
    # computed once. Each run of equal kernel sizes (`_runs`) is one `ScannedBlocks` stack with
    # params stacked on a leading [n] axis; its cache entries are stacked the same way, so a step
    # scans over a run's layers as the full decoder does.

    def _decoder_layer(self, kernel_size: int) -> DecoderLayer:
        # parent=None: an unbound copy of a stack's block, applied to one layer's slice of the
        # stacked params (as ScannedBlocks does), not a new submodule with params of its own.
        return DecoderLayer(
            num_heads=self.num_heads,
            kernel_size=kernel_size,
            ffn_dim=self.ffn_dim,
            conv_type=self.conv_type,
            weight_softmax=self.weight_softmax,
            attention_dropout=self.attention_dropout,
            dropout=self.dropout,
            relu_dropout=self.relu_dropout,
            weight_dropout=self.weight_dropout,
            dtype=self.dtype,
            parent=None,
        )

    def _decoder_stack_params(self) -> list[tuple[int, Any]]:
        """``[(K, stacked DecoderLayer params)]`` per run, each leaf ``[n, ...]``."""
        params = self.variables["params"]
        return [
            (k, params[f"decoder_k{k}_{i}"]["stack"])
            for i, (k, _) in enumerate(_runs(self.decoder_kernel_sizes))
        ]

    def init_cache(self, memory: jax.Array, src_mask: jax.Array) -> dict[str, Any]:
        """The incremental decoding state before the first target token.

        Args:
          memory: ``[B, S, C]`` from :meth:`encode` (any float dtype; cast to the compute dtype).
          src_mask: ``[B, S]`` bool from :meth:`encode`.

        Returns:
          A dict (a pytree, e.g. a ``lax.while_loop`` carry):

          - ``positions``: ``[B]`` int32, the target tokens read so far, pads excluded (the
            sinusoidal position counter of :func:`sinusoidal_positions`); starts at 0.
          - ``src_mask``: ``[B, S]`` bool, as given.
          - ``layers``: a tuple with one dict per run of ``n`` decoder layers of kernel size
            ``K`` (``_runs(decoder_kernel_sizes)``): ``conv [n, B, K - 1, C]``, the last
            ``K - 1`` conv inputs, zeros at the start (the causal conv's left padding, so ``K``
            larger than the target length needs nothing special); ``k`` and ``v``
            ``[n, B, S, C]``, each layer's encoder-decoder attention projections of ``memory``.

          Float entries are in the decoder's compute dtype (``dtype``, or the parameters' when
          ``None``): the dtype the full :meth:`decode` computes them in.
        """
        b = memory.shape[0]
        c = self.embed_dim
        params = self.variables["params"]
        # decode's activations: the embedding output's dtype, as `_embed` computes it.
        x_dtype = self.dtype or jnp.result_type(params["tgt_embed"]["embedding"])
        memory = memory.astype(x_dtype)
        proj = _dense(c, dtype=self.dtype, parent=None)
        layers = []
        for k, p in self._decoder_stack_params():
            # vmap over the run's stacked layers: [n, B, S, C] each.
            def kv(p_layer):
                attn = p_layer["encoder_attn"]
                return (
                    proj.apply({"params": attn["k_proj"]}, memory),
                    proj.apply({"params": attn["v_proj"]}, memory),
                )

            keys, values = jax.vmap(kv)(p)
            lin = p["linear1"]
            # linear1's output dtype (nn.Dense promotes its input and params when dtype is None).
            conv_dtype = self.dtype or jnp.result_type(x_dtype, lin["kernel"], lin["bias"])
            n = lin["kernel"].shape[0]
            conv = jnp.zeros((n, b, k - 1, c), conv_dtype)
            layers.append({"conv": conv, "k": keys, "v": values})
        return {
            "positions": jnp.zeros((b,), jnp.int32),
            "src_mask": src_mask,
            "layers": tuple(layers),
        }

    def decode_step(
        self, tokens: jax.Array, cache: dict[str, Any]
    ) -> tuple[jax.Array, dict[str, Any]]:
        """One incremental decoder step: ``tokens [B]`` int (the next decoder input) -> logits.

        Feeding ``BOS y_1 .. y_t`` one token per call, starting from :meth:`init_cache`, gives at
        call ``t`` the logits :meth:`decode` gives at position ``t`` (inference: no dropout), in
        ``O(1)`` decoder work per token instead of ``O(t)``.

        Args:
          tokens: ``[B]`` int.
          cache: from :meth:`init_cache` or the previous call.

        Returns:
          ``(logits [B, V_tgt]`` in the compute dtype, the updated cache``)``.
        """
        real = tokens != self.pad_id
        positions = cache["positions"] + real.astype(jnp.int32)
        x = self.tgt_embed(tokens[:, None]) * math.sqrt(self.embed_dim)  # [B, 1, C]
        # sinusoidal_positions on the whole prefix: pad_id + (real tokens up to here), 0 on pads.
        pos = _sinusoid((positions + self.pad_id).astype(jnp.float32), self.embed_dim)
        x = x + jnp.where(real[:, None], pos, 0.0)[:, None].astype(x.dtype)
        src_mask = cache["src_mask"]
        new_layers = []
        for (k, p), layer_cache in zip(self._decoder_stack_params(), cache["layers"], strict=True):
            layer = self._decoder_layer(k)

            def body(h, xs, layer=layer):
                p_layer, c_layer = xs
                return layer.apply({"params": p_layer}, h, None, src_mask, cache=c_layer)

            x, conv = jax.lax.scan(body, x, (p, layer_cache))
            new_layers.append({**layer_cache, "conv": conv})
        logits = self._output_logits(x)[:, 0]
        return logits, {**cache, "positions": positions, "layers": tuple(new_layers)}

    @staticmethod
    def reorder_cache(cache: dict[str, Any], indices: jax.Array) -> dict[str, Any]:
        """Row ``i`` of the result is row ``indices[i]`` of ``cache`` (beam search's reordering).

        Only the per-hypothesis state (``positions``, the conv windows) is gathered; the source
        side (``src_mask``, attention ``k`` / ``v``) is left as is, so ``indices[i]`` must be a
        row of the same source sentence as row ``i`` (beam search picks parents among a
        sentence's own beams), which spares a ``[B, S, C]`` gather per layer and step.
        ``indices``: ``[B]`` int.
        """
        layers = tuple(
            {**layer, "conv": jnp.take(layer["conv"], indices, axis=1)} for layer in cache["layers"]
        )
        positions = jnp.take(cache["positions"], indices, axis=0)
        return {**cache, "positions": positions, "layers": layers}

    def __call__(
        self, src_tokens: jax.Array, tgt_in_tokens: jax.Array, train: bool = False
    ) -> jax.Array:
        """``src_tokens [B, S]``, ``tgt_in_tokens [B, T]`` int -> logits ``[B, T, V_tgt]``."""
        memory, src_mask = self.encode(src_tokens, train)
        return self.decode(tgt_in_tokens, memory, src_mask, train)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _token_losses(
    logits: jax.Array, labels: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array]:
    """Per-token (smoothed loss, nll), float32 ``[B, T]``, from ``logits [B, T, V]`` (any dtype).

    ``(1 - eps) * nll + eps * mean_v(-log p_v)`` equals the cross-entropy against the smoothed
    one-hot without materialising a ``[B, T, V]`` target. Checkpointed: the backward pass keeps
    the logits in their compute dtype and recomputes the float32 log-probabilities, instead of
    saving a float32 ``[B, T, V]`` array (the largest residual of the model under bf16).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll_tok = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    smooth_tok = -logp.mean(axis=-1)
    return (1.0 - label_smoothing) * nll_tok + label_smoothing * smooth_tok, nll_tok


def translation_is_sparse(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """The DynamicConv Transformer's sparse leaves: its dense (``Linear``) kernels.

    :func:`~lowmem_jax.sparsity.default_is_sparse` (kernels with ndim >= 2: the input/output
    projections around each convolution, the attention projections, the FFN layers), minus the
    DynamicConv's weight-predicting ``weight_linear`` (``C -> H * K``; 2% of the IWSLT model's
    parameters), which stays dense: each of its outputs is a kernel tap fed to a softmax, so
    zeroing its inputs changes every position's convolution kernel, for little memory. The
    embeddings (``embedding``) and the output projection (``embed_out``) are not kernels and
    stay dense, as the classifier's last layer does.
    """
    return default_is_sparse(path, shape) and "weight_linear" not in path


def translation_loss_fn(model: nn.Module, *, label_smoothing: float = 0.1, pad_id: int = 0) -> Any:
    """Label-smoothed token cross-entropy for ``model(src, tgt_in, train) -> logits``.

    ``batch = {"src": [B, S], "tgt_in": [B, T], "tgt_out": [B, T]}`` int32. Per target token,
    ``loss = CE(logits, (1 - eps) * onehot(y) + eps / V)`` (fairseq's
    ``label_smoothed_cross_entropy`` with ``eps = label_smoothing``), in float32, averaged over
    tokens with ``tgt_out != pad_id``. Metrics: ``loss``, ``nll_loss`` (unsmoothed),
    ``accuracy`` (argmax == target over non-pad tokens) and ``tokens`` (non-pad count, float32).
    ``rng`` (if not None) is the dropout key.

    Microbatching (:func:`lowmem_jax.accumulate_gradients`) weights microbatches equally, so
    with ``k > 1`` the loss, gradients and metrics are the mean of per-microbatch token means
    (equal to the full-batch token mean only when microbatches hold equal token counts), and
    ``tokens`` is the mean count per microbatch.

    Raises:
      ValueError: for ``label_smoothing`` outside ``[0, 1)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply(
            {"params": params, **model_state},
            batch["src"],
            batch["tgt_in"],
            train=True,
            rngs={"dropout": rng} if rng is not None else {},
        )
        labels = batch["tgt_out"]
        weights = (labels != pad_id).astype(jnp.float32)
        tokens = weights.sum()
        denom = jnp.maximum(tokens, 1.0)  # an all-padding microbatch contributes 0, not NaN
        loss_tok, nll_tok = _token_losses(logits, labels, label_smoothing)
        loss = (loss_tok * weights).sum() / denom
        nll = (nll_tok * weights).sum() / denom
        accuracy = ((logits.argmax(-1) == labels) * weights).sum() / denom
        metrics = {"loss": loss, "nll_loss": nll, "accuracy": accuracy, "tokens": tokens}
        return loss, (dict(model_state), metrics)

    return loss_fn


def greedy_decode(
    model: DynamicConvTransformer,
    params: Any,
    src_tokens: jax.Array,
    max_len: int,
    *,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> jax.Array:
    """Greedy decoding: ``src_tokens [B, S]`` -> ``[B, max_len]`` int32 target tokens.

    Encodes once, then feeds ``BOS y_1 .. y_{max_len - 1}`` one token per step through
    :meth:`DynamicConvTransformer.decode_step` (incremental state: ``O(max_len)`` decoder work,
    not a re-run of the decoder over the prefix) and takes the argmax. The pad token is never
    emitted; after a row's EOS the row is filled with ``model.pad_id``. Jittable with ``max_len``
    static. The decoder state follows the compute dtype (``model.dtype`` or the params').
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    variables = {"params": params}
    memory, src_mask = model.apply(variables, src_tokens, method=model.encode)
    cache = model.apply(variables, memory, src_mask, method=model.init_cache)
    pad = model.pad_id
    b = src_tokens.shape[0]
    out = jnp.full((b, max_len), pad, jnp.int32)

    def body(t, carry):
        out, last, done, cache = carry
        logits, cache = model.apply(variables, last, cache, method=model.decode_step)
        # An emitted pad would be read as padding on the next step (and shift positions).
        logits = logits.at[:, pad].set(-jnp.inf)
        nxt = jnp.where(done, pad, logits.argmax(-1).astype(jnp.int32))
        out = jax.lax.dynamic_update_index_in_dim(out, nxt, t, axis=1)
        return out, nxt, done | (nxt == eos_id), cache

    carry = (out, jnp.full((b,), bos_id, jnp.int32), jnp.zeros((b,), bool), cache)
    return jax.lax.fori_loop(0, max_len, body, carry)[0]
