"""The DynamicConv Transformer: fairseq's ``lightconv_iwslt_de_en`` encoder-decoder.

Embeddings are scaled by ``sqrt(C)`` and added to fairseq's sinusoidal positions (sin half, cos
half; positions count non-pad tokens from ``pad_id + 1`` so padding never shifts them, and pad
positions get a zero vector). There is no final LayerNorm (post-norm). Logits are
``x @ embed_out.T`` with a separate ``[V_tgt, C]`` output matrix and no bias (untied), or the
decoder input embedding when ``share_decoder_embeddings``.

Consecutive layers with the same kernel size have identical shapes; they run as one
:class:`~lowmem_jax.ScannedBlocks` stack (``lax.scan``) under the ``remat`` policy; the
other layers are stacks of length 1 so every layer goes through the same remat mechanism. The
IWSLT preset (vocabularies 8,848 / 6,632) has 38,685,184 parameters.

Incremental decoding (:meth:`DynamicConvTransformer.init_cache` / ``decode_step`` /
``reorder_cache``, used by :mod:`.decoding`): each decoder layer's state is the window of its
causal conv's last ``K - 1`` inputs (there is no self-attention to cache).

Shapes: ``src_tokens [B, S]``, ``tgt_in_tokens [B, T]`` int; logits ``[B, T, V_tgt]`` in
``dtype`` (the computation dtype; ``None`` follows the parameters).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowmem_jax.blocks.policy import parse_policy, stack_policies
from lowmem_jax.blocks.scanned import ScannedBlocks, at_use
from lowmem_jax.models.dynamic_conv.conv import CONV_TYPES, _check_dropout, _deterministic
from lowmem_jax.models.dynamic_conv.layers import (
    DecoderLayer,
    EncoderLayer,
    _sinusoid,
    embed_init,
    layer_runs,
    sinusoidal_positions,
)
from lowmem_jax.techniques.factorize import FactorConfig, apply_dense

__all__ = ["DynamicConvTransformer"]


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
      remat: a :mod:`lowmem_jax.blocks.policy` policy name, applied per layer, or a ``blocks:``
        schedule of one policy per layer, the encoder's then the decoder's.
      unroll: unroll the scans over identical layers (same parameters and results).
      factorize: a :class:`~lowmem_jax.techniques.factorize.FactorConfig`: the layers' Linear
        projections (attention, conv block, FFN) are low-rank; the embeddings, the output
        projection and DynamicConv's ``weight_linear`` stay dense.
      param_layout: applied to each layer's parameters inside its stack's loop
        (:class:`~lowmem_jax.ScannedBlocks`; ZeRO-3 gathers them there).
      outer_param_layout: applied to the embedding tables and output projection where each is
        used (:func:`~lowmem_jax.blocks.scanned.at_use`; weight streaming moves them there).
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
    factorize: FactorConfig | None = None
    param_layout: Callable[[Any], Any] | None = None
    outer_param_layout: Callable[[Any], Any] | None = None

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
            embedding_init=embed_init(self.pad_id, std),
        )
        self.tgt_embed = nn.Embed(
            self.tgt_vocab_size,
            self.embed_dim,
            dtype=self.dtype,
            embedding_init=embed_init(self.pad_id, std),
        )
        if not self.share_decoder_embeddings:
            self.embed_out = self.param(
                "embed_out",
                nn.initializers.normal(std),
                (self.tgt_vocab_size, self.embed_dim),
            )
        common = self._layer_fields()
        encoder_runs = layer_runs(self.encoder_kernel_sizes)
        decoder_runs = layer_runs(self.decoder_kernel_sizes)
        policies = iter(
            stack_policies(
                self.remat, self.block_stacks(), "DynamicConvTransformer (encoder, then decoder)"
            )
        )
        self.encoder_stacks = [
            ScannedBlocks(
                functools.partial(EncoderLayer, kernel_size=k, **common),
                n,
                next(policies),
                self.unroll,
                self.param_layout,
                name=f"encoder_k{k}_{i}",
            )
            for i, (k, n) in enumerate(encoder_runs)
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
                next(policies),
                self.unroll,
                self.param_layout,
                name=f"decoder_k{k}_{i}",
            )
            for i, (k, n) in enumerate(decoder_runs)
        ]
        self.embed_dropout = nn.Dropout(self.dropout)

    def block_stacks(self) -> list[int]:
        """The layers of each scanned stack, in the order they run (the encoder's runs of equal
        kernel sizes, then the decoder's): a ``blocks:`` remat schedule gives one policy per
        layer."""
        runs = layer_runs(self.encoder_kernel_sizes) + layer_runs(self.decoder_kernel_sizes)
        return [n for _, n in runs]

    def _embed(self, embed: nn.Embed, tokens: jax.Array, train: bool, after: Any = None):
        """(embedded ``tokens``, ``after``): with ``outer_param_layout``, the table laid out
        once ``after`` exists and ``after`` as :func:`at_use` returns it (use that one)."""
        if self.outer_param_layout is None:
            x = embed(tokens)
        else:  # nn.Embed's lookup on the table as laid out
            table, after = at_use(self.outer_param_layout, embed.embedding, after)
            x = jnp.take(table.astype(self.dtype or table.dtype), tokens, axis=0)
        x = x * math.sqrt(self.embed_dim)
        x = x + sinusoidal_positions(tokens, self.embed_dim, self.pad_id).astype(x.dtype)
        return self.embed_dropout(x, deterministic=_deterministic(self, train)), after

    def encode(self, src_tokens: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
        """``src_tokens [B, S]`` -> (``memory [B, S, C]``, ``src_mask [B, S]`` bool, True = real).

        ``memory`` at padded positions is not meaningful; ``src_mask`` masks it in attention.
        """
        src_mask = src_tokens != self.pad_id
        x, _ = self._embed(self.src_embed, src_tokens, train)
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
        x, memory = self._embed(self.tgt_embed, tgt_in_tokens, train, after=memory)
        for stack in self.decoder_stacks:
            x = stack(x, memory.astype(x.dtype), src_mask, train=train)
        return self._output_logits(x)

    def _output_logits(self, x: jax.Array) -> jax.Array:
        """Decoder output ``[B, T, C]`` -> logits ``[B, T, V_tgt]``."""
        if self.share_decoder_embeddings and self.outer_param_layout is None:
            return self.tgt_embed.attend(x)
        w = self.tgt_embed.embedding if self.share_decoder_embeddings else self.embed_out
        if self.outer_param_layout is not None:
            w, x = at_use(self.outer_param_layout, w, x)
        dtype = self.dtype or jnp.result_type(x, w)
        return jnp.einsum("btc,vc->btv", x.astype(dtype), w.astype(dtype))

    # Incremental decoding (inference only: no dropout). A decoder layer has no self-attention,
    # so its state after t target tokens is the window of its causal conv's last K - 1 inputs;
    # the encoder-decoder attention's key / value projections of `memory` are fixed, so they are
    # computed once. Each run of equal kernel sizes (`layer_runs`) is one `ScannedBlocks` stack with
    # params stacked on a leading [n] axis; its cache entries are stacked the same way, so a step
    # scans over a run's layers as the full decoder does.

    def _decoder_layer(self, kernel_size: int) -> DecoderLayer:
        # parent=None: an unbound copy of a stack's block, applied to one layer's slice of the
        # stacked params (as ScannedBlocks does), not a new submodule with params of its own.
        return DecoderLayer(
            kernel_size=kernel_size,
            attention_dropout=self.attention_dropout,
            parent=None,
            **self._layer_fields(),
        )

    def _layer_fields(self) -> dict[str, Any]:
        """The fields every encoder and decoder layer takes from the model."""
        names = ("num_heads", "ffn_dim", "conv_type", "weight_softmax", "dropout",
                 "relu_dropout", "weight_dropout", "dtype", "factorize")  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def _decoder_stack_params(self) -> list[tuple[int, Any]]:
        """``[(K, stacked DecoderLayer params)]`` per run, each leaf ``[n, ...]``."""
        params = self.variables["params"]
        return [
            (k, params[f"decoder_k{k}_{i}"]["stack"])
            for i, (k, _) in enumerate(layer_runs(self.decoder_kernel_sizes))
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
            ``K`` (``layer_runs(decoder_kernel_sizes)``): ``conv [n, B, K - 1, C]``, the last
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
        layers = []
        for k, p in self._decoder_stack_params():
            # vmap over the run's stacked layers: [n, B, S, C] each.
            def kv(p_layer):
                attn = p_layer["encoder_attn"]
                return (
                    apply_dense(attn["k_proj"], memory, self.dtype),
                    apply_dense(attn["v_proj"], memory, self.dtype),
                )

            keys, values = jax.vmap(kv)(p)
            lin = p["linear1"]
            # linear1's output dtype (nn.Dense promotes its input and params when dtype is None).
            conv_dtype = self.dtype or jnp.result_type(x_dtype, *jax.tree.leaves(lin))
            n = lin["bias"].shape[0]
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
