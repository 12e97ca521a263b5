"""Datasets. Nothing here downloads: digits ships with scikit-learn, the synthetic translation
task is generated, and CIFAR-10 / IWSLT'14 are read from TFDS directories prepared once
(docs/datasets.md).
"""

from lowmem_jax.data.digits import iterate_batches, load_digits
from lowmem_jax.data.iwslt14 import (
    Iwslt14DeEn,
    load_iwslt14,
    load_ted_multi_de_en,
    prepare_iwslt14,
)
from lowmem_jax.data.synthetic import make_translation_task
from lowmem_jax.data.token_batching import TokenBatcher, batch_by_tokens, pad_batch
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
    "batch_by_tokens",
    "pad_batch",
]
