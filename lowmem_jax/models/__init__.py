"""Benchmark models of the technical report, written for the remat and precision transforms."""

from lowmem_jax.models.dynamic_conv import (
    DecoderLayer,
    DynamicConv,
    DynamicConvTransformer,
    EncoderLayer,
    LightConv,
    MultiHeadAttention,
    greedy_decode,
    sinusoidal_positions,
    translation_is_sparse,
    translation_loss_fn,
)
from lowmem_jax.models.wide_resnet import PreActBlock, WideResNet

__all__ = [
    "WideResNet",
    "PreActBlock",
    "DynamicConvTransformer",
    "DynamicConv",
    "LightConv",
    "MultiHeadAttention",
    "EncoderLayer",
    "DecoderLayer",
    "sinusoidal_positions",
    "translation_loss_fn",
    "translation_is_sparse",
    "greedy_decode",
]
