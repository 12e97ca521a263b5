"""Datasets. Nothing here downloads: digits ships with scikit-learn, Fashion-MNIST with Debian's
``dataset-fashion-mnist`` (IDX files), the Python source corpus is the interpreter's own
standard library, the synthetic translation task is generated, and CIFAR-10
/ IWSLT'14 are read from TFDS directories prepared once (docs/datasets.md).

The IWSLT'14 names load on first use: they need ``tensorflow_datasets``, which a process that
only builds and measures a step (``benchmarks/gpu_validate.py`` on a GPU machine) may not have.
"""

import importlib
from typing import Any

from lowmem_jax.data.digits import iterate_batches, load_digits
from lowmem_jax.data.fashion_mnist import load_fashion_mnist
from lowmem_jax.data.python_source import load_python_source
from lowmem_jax.data.synthetic import make_translation_task
from lowmem_jax.data.token_batching import TokenBatcher, TokenBudget, batch_by_tokens, pad_batch
from lowmem_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    train_tokenizer,
)

__all__ = [
    "load_digits",
    "load_fashion_mnist",
    "load_python_source",
    "iterate_batches",
    "make_translation_task",
    "Iwslt14DeEn",
    "prepare_iwslt14",
    "load_iwslt14",
    "load_ted_multi_de_en",
    "Tokenizer",
    "train_tokenizer",
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "UNK_ID",
    "TokenBatcher",
    "TokenBudget",
    "batch_by_tokens",
    "pad_batch",
]

_IWSLT14 = ("Iwslt14DeEn", "prepare_iwslt14", "load_iwslt14", "load_ted_multi_de_en")


def __getattr__(name: str) -> Any:
    if name in _IWSLT14:
        return getattr(importlib.import_module("lowmem_jax.data.iwslt14"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
