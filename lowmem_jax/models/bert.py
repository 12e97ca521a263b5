"""BERT's masked language model (Devlin et al. 2019): the encoder the seed documents' story is
about ("BERT-base trains on a 12 GB GPU, BERT-large needs a 64 GB TPU"), its layers one
:class:`~lowmem_jax.ScannedBlocks` stack.

Each layer (:class:`BertBlock`) is post-norm::

    h = LN(x + attention_out(softmax(q k^T / sqrt(D)) v))     q, k, v = query(x), key(x), value(x)
    y = LN(h + output(gelu(intermediate(h))))

bidirectional attention over ``H`` heads (``D = C / H``; every position real: packed sequences,
no padding mask), exact (erf) GELU, LayerNorm epsilon 1e-12, dropout ``dropout`` on the
embeddings, the attention probabilities and each residual branch (BERT's 0.1). The input is the
sum of word, learned position and token-type (all type 0) embeddings, LayerNorm'd; the MLM head is
``LN(gelu(transform(y)))`` projected by the word embedding matrix (tied) plus a bias. The
parameters and arithmetic follow transformers' ``FlaxBertForMaskedLM`` (``tests/test_bert.py``
copies its weights and gets its logits); ``bert-large``'s 335,174,458 parameters are its.

Shapes: ``tokens [B, T]`` int (``T <= max_positions``) -> logits ``[B, T, V]`` in ``dtype``
(``None``: the parameters'). Parameters: ``word [V, C]``, ``position [P, C]``, ``token_type
[2, C]``, ``embeddings_norm``, ``stack/stack/{query, key, value, attention_out, attention_norm,
intermediate, output, output_norm}`` (each leaf ``[L, ...]``), ``mlm/{transform, norm}``,
``mlm/bias [V]``.
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
from lowmem_jax.blocks.scanned import ScannedBlocks, at_use
from lowmem_jax.techniques.factorize import FactorConfig, dense_layer

__all__ = ["Bert", "BertBlock", "BertShape", "BERT_PRESETS", "bert_parameter_count"]

_EPSILON = 1e-12


@dataclasses.dataclass(frozen=True)
class BertShape:
    """``layers`` L, ``width`` C, ``heads`` H, ``ffn`` F, ``vocab`` V, ``max_positions`` P."""

    layers: int
    width: int
    heads: int
    ffn: int
    vocab: int = 30522
    max_positions: int = 512


#: ``bert-<size>``: Google's BERT-base and BERT-large (uncased vocabulary), ``tiny`` for tests.
BERT_PRESETS: dict[str, BertShape] = {
    "tiny": BertShape(2, 64, 4, 128, 256, 128),
    "base": BertShape(12, 768, 12, 3072),
    "large": BertShape(24, 1024, 16, 4096),
}


def bert_parameter_count(s: BertShape) -> int:
    """The masked LM's parameters: embeddings, layers, MLM head (the decoder tied)."""
    c = s.width
    embeddings = (s.vocab + s.max_positions + 2) * c + 2 * c
    layer = 4 * (c * c + c) + 2 * c * s.ffn + s.ffn + c + 4 * c
    head = c * c + c + 2 * c + s.vocab
    return embeddings + s.layers * layer + head


def _dense(config: FactorConfig | None, features: int, dtype: Any, name: str):
    """A projection with bias, BERT's normal(0.02) init; low-rank under ``config``."""
    return dense_layer(config, features, dtype=dtype,
                       kernel_init=nn.initializers.normal(0.02), name=name)  # fmt: skip


def _layer_norm(dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=_EPSILON, dtype=dtype, name=name)


class BertBlock(nn.Module):
    """One encoder layer (module docstring): ``x [B, T, C] -> [B, T, C]``."""

    heads: int
    ffn: int
    dropout: float = 0.1
    dtype: Any = None
    factorize: FactorConfig | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        b, t, c = x.shape
        d = c // self.heads
        proj = functools.partial(_dense, self.factorize, dtype=self.dtype)
        drop = functools.partial(
            nn.Dropout(self.dropout), deterministic=_deterministic(self, train)
        )
        q, k, v = (proj(c, name=n)(x).reshape(b, t, self.heads, d)
                   for n in ("query", "key", "value"))  # fmt: skip
        scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
        probs = jax.nn.softmax(scores / jnp.sqrt(jnp.float32(d)), axis=-1).astype(v.dtype)
        out = jnp.einsum("bhts,bshd->bthd", drop(probs), v).reshape(b, t, c)
        h = x + drop(proj(c, name="attention_out")(out)).astype(x.dtype)
        h = _layer_norm(self.dtype, "attention_norm")(h)
        inner = nn.gelu(proj(self.ffn, name="intermediate")(h), approximate=False)
        y = h + drop(proj(c, name="output")(inner)).astype(h.dtype)
        return _layer_norm(self.dtype, "output_norm")(y)


class Bert(nn.Module):
    """BERT's masked LM (module docstring): ``tokens [B, T] -> logits [B, T, V]``.

    Attributes:
      vocab_size, width, layers, heads, ffn, max_positions: ``V, C, L, H, F, P``.
      dropout: BERT's hidden and attention dropout (0.1); 0 in evaluation (``train=False``).
      dtype, remat, unroll, factorize, param_layout, outer_param_layout: as
        :class:`~lowmem_jax.models.Llama`'s (the embeddings and the MLM head stay dense).
    """

    vocab_size: int
    width: int
    layers: int
    heads: int
    ffn: int
    max_positions: int = 512
    dropout: float = 0.1
    dtype: Any = None
    remat: str = "none"
    unroll: bool = False
    factorize: FactorConfig | None = None
    param_layout: Callable[[Any], Any] | None = None
    outer_param_layout: Callable[[Any], Any] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "width", "layers", "heads", "ffn", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"heads must divide width={self.width}, got {self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        parse_policy(self.remat)
        super().__post_init__()

    @classmethod
    def preset(cls, size: str, **overrides: Any) -> Bert:
        """The model of :data:`BERT_PRESETS` ``[size]`` with ``overrides`` of its fields.

        Raises:
          ValueError: for an unknown ``size``, naming the allowed values.
        """
        if size not in BERT_PRESETS:
            raise ValueError(f"Unknown bert size={size!r}; allowed values: {list(BERT_PRESETS)}")
        s = BERT_PRESETS[size]
        fields = {"vocab_size": s.vocab, "width": s.width, "layers": s.layers, "heads": s.heads,
                  "ffn": s.ffn, "max_positions": s.max_positions}  # fmt: skip
        return cls(**{**fields, **overrides})

    def block_stacks(self) -> list[int]:
        """The layers of each scanned stack (one stack)."""
        return [self.layers]

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """``tokens [B, T]`` int -> logits ``[B, T, V]``."""
        t = tokens.shape[1]
        if t > self.max_positions:
            raise ValueError(f"sequence length {t} exceeds max_positions={self.max_positions}")
        layout = None if self.is_initializing() else self.outer_param_layout
        init = nn.initializers.normal(0.02)
        word = self.param("word", init, (self.vocab_size, self.width), jnp.float32)
        position = self.param("position", init, (self.max_positions, self.width), jnp.float32)
        token_type = self.param("token_type", init, (2, self.width), jnp.float32)
        laid = (lambda p: p) if layout is None else layout
        dtype = self.dtype or word.dtype
        # The lookup's backward pass needs only the indices: the laid-out table dies here.
        x = jnp.take(laid(word), tokens, axis=0) + laid(position)[:t][None] + laid(token_type)[0]
        x = _layer_norm(self.dtype, "embeddings_norm")(x.astype(dtype))
        x = nn.Dropout(self.dropout)(x, deterministic=_deterministic(self, train))
        (policy,) = stack_policies(self.remat, self.block_stacks(), "Bert")
        block = functools.partial(BertBlock, heads=self.heads, ffn=self.ffn, dropout=self.dropout,
                                  dtype=self.dtype, factorize=self.factorize)  # fmt: skip
        x = ScannedBlocks(block, self.layers, policy, self.unroll, self.param_layout,
                          name="stack")(x, train=train)  # fmt: skip
        return _MLMHead(self.vocab_size, self.dtype, layout, name="mlm")(x, word)


def _deterministic(module: nn.Module, train: bool) -> bool:
    # Dropout only in training with a "dropout" rng: the rule ScannedBlocks follows when it hands
    # (or does not hand) each block a key.
    return not (train and module.has_rng("dropout"))


class _MLMHead(nn.Module):
    """``LN(gelu(transform(y))) @ word^T + bias``: ``[B, T, C] -> [B, T, V]``, the tied table
    through ``layout`` once ``y`` exists (:func:`~lowmem_jax.blocks.scanned.at_use`)."""

    vocab_size: int
    dtype: Any
    layout: Callable[[Any], Any] | None

    @nn.compact
    def __call__(self, x: jax.Array, word: jax.Array) -> jax.Array:
        dense = nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=nn.initializers.normal(0.02),
                         name="transform")  # fmt: skip
        h = nn.gelu(dense(x), approximate=False)
        h = nn.LayerNorm(epsilon=_EPSILON, dtype=self.dtype, name="norm")(h)
        bias = self.param("bias", nn.initializers.zeros, (self.vocab_size,), jnp.float32)
        if self.layout is not None:
            word, h = at_use(self.layout, word, h)
            bias = self.layout(bias)
        dtype = self.dtype or jnp.result_type(h, word)
        logits = jnp.einsum("btc,vc->btv", h.astype(dtype), word.astype(dtype))
        return logits + bias.astype(dtype)
