"""Benchmark models of the technical report, written for the remat and precision transforms.

Models import neither the data pipelines nor the techniques: a plan configures them
(``Plan.configure_model``: ``remat`` and ``dtype``), the registry (:mod:`lowmem_jax.workloads`)
names them.
"""

from lowmem_jax.models.bert import Bert, BertBlock
from lowmem_jax.models.dynamic_conv import (
    DecoderLayer,
    DynamicConv,
    DynamicConvTransformer,
    EncoderLayer,
    LightConv,
    MultiHeadAttention,
    beam_search,
    greedy_decode,
    sequence_log_prob,
    sinusoidal_positions,
)
from lowmem_jax.models.llama import Llama, LlamaBlock, RMSNorm
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
    "greedy_decode",
    "beam_search",
    "sequence_log_prob",
    "Llama",
    "LlamaBlock",
    "RMSNorm",
    "Bert",
    "BertBlock",
]
