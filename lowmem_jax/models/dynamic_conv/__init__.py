"""The DynamicConv Transformer (Wu et al., 2019), fairseq's ``lightconv_iwslt_de_en`` layout.

``conv``: the dynamic / lightweight convolutions; ``layers``: LayerNorm, attention, encoder and
decoder layers; ``model``: the encoder-decoder with its incremental decoding cache;
``decoding``: greedy and beam search. The loss is
:func:`lowmem_jax.workloads.losses.translation_loss_fn`.
"""

from lowmem_jax.models.dynamic_conv.conv import (
    CONV_TYPES,
    DynamicConv,
    LightConv,
    apply_conv_weights,
    apply_conv_weights_step,
)
from lowmem_jax.models.dynamic_conv.decoding import beam_search, greedy_decode, sequence_log_prob
from lowmem_jax.models.dynamic_conv.layers import (
    DecoderLayer,
    EncoderLayer,
    LayerNorm,
    MultiHeadAttention,
    sinusoidal_positions,
)
from lowmem_jax.models.dynamic_conv.model import DynamicConvTransformer

__all__ = [
    "DynamicConvTransformer",
    "DynamicConv",
    "LightConv",
    "MultiHeadAttention",
    "LayerNorm",
    "EncoderLayer",
    "DecoderLayer",
    "sinusoidal_positions",
    "apply_conv_weights",
    "apply_conv_weights_step",
    "greedy_decode",
    "beam_search",
    "sequence_log_prob",
    "CONV_TYPES",
]
