"""A LLaMA-style decoder-only language model: RMSNorm, rotary positions, SwiGLU, grouped-query
attention, an untied output head; its layers one :class:`~lowmem_jax.ScannedBlocks` stack.

Each layer (:class:`LlamaBlock`) is pre-norm::

    h = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = norm(x)
    y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                        n2 = norm(h)

with ``norm(x) = w * x / sqrt(mean(x^2) + eps)`` (computed in float32), causal softmax
attention over ``H`` query heads sharing ``G`` key/value heads (``H / G`` queries per key; ``G =
H``: multi-head attention), scaled by ``1 / sqrt(D)`` (``D = C / H``), and rotary positions
in the "rotate half" layout of Meta's and Hugging Face's LLaMA: dimensions ``i`` and ``i + D/2``
of each head rotate by ``p * theta^(-2i/D)`` at position ``p``. No biases, no dropout (as
LLaMA's pre-training). Parameters and computation follow the conventions of transformers'
``FlaxLlamaForCausalLM`` (``tests/test_llama.py`` copies its weights and gets its logits), with
its layers stacked on a leading ``[L]`` axis under ``stack/stack``.

Shapes: ``tokens [B, T]`` int -> logits ``[B, T, V]`` in ``dtype`` (the computation dtype;
``None`` follows the parameters). Parameters (float32 unless a plan stores them otherwise)::

    embed/embedding                [V, C]
    stack/stack/q_proj/kernel      [L, C, H*D]     k_proj, v_proj: [L, C, G*D]
    stack/stack/o_proj/kernel      [L, H*D, C]
    stack/stack/gate_proj/kernel   [L, C, F]       up_proj: [L, C, F]; down_proj: [L, F, C]
    stack/stack/input_norm/scale   [L, C]          post_attention_norm/scale: [L, C]
    norm/scale                     [C]
    lm_head/kernel                 [C, V]

``P = 2VC + C + L(2C + 2C(H + G)D + 3CF)``; :data:`PRESETS` gives each named shape's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowmem_jax.blocks.policy import parse_policy, stack_policies
from lowmem_jax.blocks.scanned import ScannedBlocks, at_use, with_layout
from lowmem_jax.techniques.factorize import FactorConfig, dense_layer
from lowmem_jax.techniques.loss_chunk import chunked_token_losses

__all__ = [
    "Llama",
    "LlamaBlock",
    "LlamaShape",
    "PRESETS",
    "RMSNorm",
    "rotary",
    "causal_attention",
    "parameter_count",
]


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The architecture of one named size: ``layers`` L, ``width`` C, ``heads`` H,
    ``kv_heads`` G, ``ffn`` F, ``vocab`` V, and where the shape is published."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    source: str


#: The named sizes (``llama-<size>`` in :func:`lowmem_jax.workloads.workload`): the GaLore
#: paper's LLaMA pre-training configurations for 130M and 350M (Zhao et al. 2024,
#: ``configs/llama_130m.json`` / ``llama_350m.json``), TinyLlama-1.1B for 1B (grouped-query
#: attention: 4 key/value heads), LLaMA-2-7B for 7B; ``tiny`` and ``18m`` (a byte vocabulary)
#: are this project's test and CPU-training sizes.
PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(2, 64, 4, 2, 128, 256, "tests (this project)"),
    "18m": LlamaShape(6, 512, 8, 4, 1408, 256, "CPU training on bytes of text (this project)"),
    "130m": LlamaShape(12, 768, 12, 12, 2048, 32000, "GaLore llama_130m.json"),
    "350m": LlamaShape(24, 1024, 16, 16, 2736, 32000, "GaLore llama_350m.json"),
    "1b": LlamaShape(22, 2048, 32, 4, 5632, 32000, "TinyLlama-1.1B"),
    "7b": LlamaShape(32, 4096, 32, 32, 11008, 32000, "LLaMA-2-7B"),
}


def parameter_count(shape: LlamaShape) -> int:
    """``P`` of the module docstring for ``shape``."""
    c, d = shape.width, shape.width // shape.heads
    attention = 2 * c * (shape.heads + shape.kv_heads) * d
    per_layer = 2 * c + attention + 3 * c * shape.ffn
    return 2 * shape.vocab * c + c + shape.layers * per_layer


class RMSNorm(nn.Module):
    """``[..., C] -> [..., C]``: ``scale * x / sqrt(mean(x^2) + epsilon)``, the statistic in
    float32, the result in ``dtype`` (``None``: the input's)."""

    epsilon: float = 1e-6
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        dtype = self.dtype or x.dtype
        return scale.astype(dtype) * y.astype(dtype)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """``x [B, T, N, D]`` with rotary positions ``0 .. T - 1`` ("rotate half": dimensions ``i``
    and ``i + D/2`` turn by ``p * theta^(-2i/D)``), the angles in float32, the result in
    ``x``'s dtype."""
    t, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # [1, T, 1, D]
    x32 = x.astype(jnp.float32)
    half = d // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention, ``q [B, T, H, D]``, ``k, v [B, T, G, D]`` -> ``[B, T, H, D]``
    in ``v``'s dtype; query head ``h`` reads key/value head ``h // (H / G)`` (shared, not
    repeated).

    ``softmax(q k^T / sqrt(D) + causal mask) v``: the scores ``[B, H, T, T]`` and the softmax
    in float32 (``q`` and ``k`` cast first, as Flax's attention with ``dtype=float32`` and
    transformers' LLaMA do), the probabilities cast to ``v``'s dtype for the weighted sum.
    """
    b, t, h, d = q.shape
    g = k.shape[2]
    q32 = q.astype(jnp.float32).reshape(b, t, g, h // g, d) / jnp.sqrt(jnp.float32(d))
    scores = jnp.einsum("btgqd,bsgd->bgqts", q32, k.astype(jnp.float32))
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgqts,bsgd->btgqd", probs, v).reshape(b, t, h, d)


def _dense(config: FactorConfig | None, features: int, dtype: Any, std: float, name: str):
    """A bias-free projection, normal(``std``) init; low-rank under ``config``."""
    init = nn.initializers.normal(std)
    return dense_layer(config, features, use_bias=False, dtype=dtype, kernel_init=init, name=name)


class LlamaBlock(nn.Module):
    """One decoder layer (module docstring): ``x [B, T, C] -> [B, T, C]``.

    Attributes:
      heads, kv_heads: ``H`` query heads and ``G`` key/value heads (``G`` divides ``H``).
      ffn: ``F``, the SwiGLU's hidden width.
      rope_theta: the rotary base.
      norm_epsilon: RMSNorm's epsilon.
      dtype: the computation dtype (``None``: the parameters').
      factorize: the projections low-rank (:class:`~lowmem_jax.techniques.factorize.FactorConfig`).
      init_std: the projections' normal initialisation (LLaMA's 0.02).
    """

    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    dtype: Any = None
    factorize: FactorConfig | None = None
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        del train  # no dropout: the same function in training and evaluation
        b, t, c = x.shape
        d = c // self.heads
        proj = functools.partial(_dense, self.factorize, dtype=self.dtype, std=self.init_std)
        n1 = RMSNorm(self.norm_epsilon, self.dtype, name="input_norm")(x)
        q = proj(self.heads * d, name="q_proj")(n1).reshape(b, t, self.heads, d)
        k = proj(self.kv_heads * d, name="k_proj")(n1).reshape(b, t, self.kv_heads, d)
        v = proj(self.kv_heads * d, name="v_proj")(n1).reshape(b, t, self.kv_heads, d)
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        out = causal_attention(q, k, v).reshape(b, t, c)
        h = x + proj(c, name="o_proj")(out).astype(x.dtype)
        n2 = RMSNorm(self.norm_epsilon, self.dtype, name="post_attention_norm")(h)
        gate = proj(self.ffn, name="gate_proj")(n2)
        up = proj(self.ffn, name="up_proj")(n2)
        return h + proj(c, name="down_proj")(nn.silu(gate) * up).astype(x.dtype)


class Llama(nn.Module):
    """The decoder language model (module docstring): ``tokens [B, T] -> logits [B, T, V]``.

    Attributes:
      vocab_size, width, layers, heads, kv_heads, ffn: ``V, C, L, H, G, F``; ``H`` divides
        ``C``, ``G`` divides ``H``, ``D = C / H`` even.
      rope_theta, norm_epsilon, init_std: as :class:`LlamaBlock`'s.
      dtype: computation dtype (``None``: follow the parameters).
      remat: a :mod:`lowmem_jax.blocks.policy` policy name for the stack, or a ``blocks:``
        schedule of one policy per layer.
      unroll: unroll the scan over the layers (same parameters and results).
      factorize: the layers' projections low-rank; the embedding and the head stay dense.
      param_layout: applied to each layer's parameters inside the stack's loop (ZeRO-3 gathers
        them there).
      outer_param_layout: applied to the embedding, the final norm and the head where each is
        used (:func:`~lowmem_jax.blocks.scanned.at_use`; weight streaming moves them there).
      loss_chunk: with ``targets``, the head's logits are computed ``loss_chunk`` tokens at a
        time and recomputed in the backward pass (``Plan.loss_chunk``,
        :func:`~lowmem_jax.techniques.loss_chunk.chunked_token_losses`); ``0``: whole.
    """

    vocab_size: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6
    init_std: float = 0.02
    dtype: Any = None
    remat: str = "none"
    unroll: bool = False
    factorize: FactorConfig | None = None
    param_layout: Callable[[Any], Any] | None = None
    outer_param_layout: Callable[[Any], Any] | None = None
    loss_chunk: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "width", "layers", "heads", "kv_heads", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(
                f"heads must divide width={self.width} into an even head size, got {self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads={self.heads}, got {self.kv_heads}")
        parse_policy(self.remat)
        super().__post_init__()

    @classmethod
    def preset(cls, size: str, **overrides: Any) -> Llama:
        """The model of :data:`PRESETS` ``[size]``, with ``overrides`` of its fields.

        Raises:
          ValueError: for an unknown ``size``, naming the allowed values.
        """
        if size not in PRESETS:
            raise ValueError(f"Unknown llama size={size!r}; allowed values: {list(PRESETS)}")
        s = PRESETS[size]
        fields = {"vocab_size": s.vocab, "width": s.width, "layers": s.layers, "heads": s.heads,
                  "kv_heads": s.kv_heads, "ffn": s.ffn}  # fmt: skip
        return cls(**{**fields, **overrides})

    def block_stacks(self) -> list[int]:
        """The layers of each scanned stack (one stack): a ``blocks:`` remat schedule gives one
        policy per layer."""
        return [self.layers]

    @nn.compact
    def __call__(
        self, tokens: jax.Array, train: bool = False, targets: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``tokens [B, T]`` int -> logits ``[B, T, V]`` (causal: position ``t`` sees
        ``tokens[:, :t + 1]``); with ``targets [B, T]`` int, the per-token ``(nll, correct)``
        (float32, bool ``[B, T]``) instead, over chunks of :attr:`loss_chunk` tokens (whole
        logits where it is 0)."""
        initializing = self.is_initializing()
        layout = self.outer_param_layout
        embed = nn.Embed(
            self.vocab_size,
            self.width,
            dtype=self.dtype,
            embedding_init=nn.initializers.normal(self.init_std),
            name="embed",
        )
        if layout is None or initializing:
            x = embed(tokens)
        else:  # nn.Embed's lookup on the table as laid out
            table = layout(embed.embedding)
            x = jnp.take(table.astype(self.dtype or table.dtype), tokens, axis=0)
        (policy,) = stack_policies(self.remat, self.block_stacks(), "Llama")
        block = functools.partial(
            LlamaBlock,
            heads=self.heads,
            kv_heads=self.kv_heads,
            ffn=self.ffn,
            rope_theta=self.rope_theta,
            norm_epsilon=self.norm_epsilon,
            dtype=self.dtype,
            factorize=self.factorize,
            init_std=self.init_std,
        )
        x = ScannedBlocks(block, self.layers, policy, self.unroll, self.param_layout,
                          name="stack")(x, train=train)  # fmt: skip
        norm = with_layout(RMSNorm, layout, initializing)
        x = norm(self.norm_epsilon, self.dtype, name="norm")(x)
        head = _Head(self.vocab_size, self.width, self.dtype, self.init_std, layout,
                     name="lm_head")  # fmt: skip
        if targets is None:
            return head(x)
        return head.token_losses(x, targets, self.loss_chunk)


class _Head(nn.Module):
    """The untied output projection ``[B, T, C] -> [B, T, V]`` (``kernel [C, V]``: the path
    and layout of ``nn.Dense(use_bias=False)``), its kernel through ``layout`` where used."""

    vocab_size: int
    width: int
    dtype: Any
    init_std: float
    layout: Callable[[Any], Any] | None

    def setup(self):
        init = nn.initializers.normal(self.init_std)
        self.kernel = self.param("kernel", init, (self.width, self.vocab_size), jnp.float32)

    def _used(self, x: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        kernel = self.kernel
        if self.layout is not None and not self.is_initializing():
            kernel, x = at_use(self.layout, kernel, x)
        return kernel, x, self.dtype or jnp.result_type(x, kernel)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel, x, dtype = self._used(x)
        return jnp.einsum("btc,cv->btv", x.astype(dtype), kernel.astype(dtype))

    def token_losses(
        self, x: jax.Array, targets: jax.Array, chunk: int
    ) -> tuple[jax.Array, jax.Array]:
        """Per-token ``(nll, correct)`` of the logits against ``targets``, ``chunk`` tokens at
        a time (``0``: one chunk of all of them)."""
        kernel, x, dtype = self._used(x)
        return chunked_token_losses(x, kernel, targets, chunk or targets.size, dtype=dtype)
