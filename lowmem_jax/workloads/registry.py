"""The registry of named models: a name to a :class:`~lowmem_jax.workloads.definition.Workload`
(:func:`workload`), which :func:`lowmem_jax.workloads.build.build` turns into a step.

Names (:data:`MODEL_NAMES`):

* ``wrn-D-K``: WideResNet-D-K, 10 classes; batch ``{"image": [B, S, S, 3] float32, "label":
  [B] int32}`` (``S = image_size``, 32; the image uint8 raw pixels under
  ``Plan(input_dtype="uint8")``, normalised by the model with CIFAR-10's statistics unless
  ``pixel_mean`` / ``pixel_std`` are given); default batch 128; the SGD Nesterov recipe.
* ``dynamicconv-iwslt``: fairseq's ``lightconv_iwslt_de_en`` (vocabularies 8,848 / 6,632);
  ``dynamicconv-small``: the CPU-sized preset (C = 64; vocabularies 32). Batch ``{"src",
  "tgt_in", "tgt_out": [B, T] int32}``; default 100 sentences x 40 tokens (the recipe's 4,000
  tokens per batch); fairseq's Adam / inverse-sqrt recipe (warmup 4,000 for the IWSLT preset,
  50 for the small one), label smoothing 0.1.
* ``llama-<size>``: a LLaMA-style decoder (:class:`~lowmem_jax.models.Llama`) of one of
  :data:`~lowmem_jax.models.llama.PRESETS`' sizes (``tiny``, ``18m``, ``130m``, ``350m``, ``1b``,
  ``7b``); causal language modelling on packed sequences, batch ``{"inputs", "targets": [B, T]
  int32}`` (``targets`` the inputs shifted by one); default 4 sequences x 1024 tokens; AdamW
  (0.9, 0.98 as the registry's AdamW), cosine decay from 3e-4, weight decay 0.1.

* ``bert-<size>``: BERT's masked language model (:class:`~lowmem_jax.models.Bert`, ``tiny``,
  ``base``, ``large``; dropout 0.1), batch ``{"inputs", "targets": [B, T] int32, "weights":
  [B, T] float32}`` (``weights`` 1 on the masked positions the loss reads); default 8
  sequences x 512 tokens; AdamW (0.9, 0.98), cosine decay from 1e-4 (BERT's linear warmup and
  decay are not among the schedules), weight decay 0.01.

``seq_len`` (tokens per sequence) applies to the sequence models (:func:`takes_seq_len`); its
default is the model's (40 for ``dynamicconv-*``, 1024 for ``llama-*``, 512 for ``bert-*``).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax import models
from lowmem_jax.data import cifar10
from lowmem_jax.models.bert import BERT_PRESETS
from lowmem_jax.models.llama import PRESETS
from lowmem_jax.techniques import sparsity
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.recipes import Recipe

__all__ = [
    "workload",
    "translation_is_sparse",
    "lm_is_sparse",
    "takes_seq_len",
    "default_seq_len",
    "MODEL_NAMES",
    "WRN_RECIPE",
    "DYNAMICCONV_RECIPES",
    "LLAMA_RECIPE",
]

MODEL_NAMES = (
    "wrn-D-K (e.g. wrn-28-2), dynamicconv-small, dynamicconv-iwslt, llama-SIZE (SIZE one of "
    f"{', '.join(PRESETS)}), bert-SIZE (one of {', '.join(BERT_PRESETS)}), or module:function "
    "(your model: a function returning lowmem_jax.custom_workload(...))"
)
TASKS = ("classification", "translation", "lm", "mlm")
#: Tokens per sequence of each sequence model family when ``seq_len`` is not given.
SEQ_LEN_DEFAULTS = {"dynamicconv-": 40, "llama-": 1024, "bert-": 512}

CIFAR10_PIXEL_STATS = {"pixel_mean": cifar10.PIXEL_MEAN, "pixel_std": cifar10.PIXEL_STD}
WRN_RECIPE = Recipe("sgd_nesterov", 0.1, "cosine", weight_decay=5e-4, momentum=0.9)
DYNAMICCONV_RECIPES = {
    "dynamicconv-iwslt": Recipe(
        "adamw", 5e-4, "inverse_sqrt", warmup=4000, weight_decay=1e-4, label_smoothing=0.1
    ),
    "dynamicconv-small": Recipe(
        "adamw", 2e-3, "inverse_sqrt", warmup=50, weight_decay=1e-4, label_smoothing=0.1
    ),
}
LLAMA_RECIPE = Recipe("adamw", 3e-4, "cosine", weight_decay=0.1)
BERT_RECIPE = Recipe("adamw", 1e-4, "cosine", weight_decay=0.01)


def takes_seq_len(name: str) -> bool:
    """Whether model ``name`` is a sequence model, whose batch ``seq_len`` shapes."""
    return default_seq_len(name) is not None


def default_seq_len(name: str) -> int | None:
    """The tokens per sequence of model ``name``'s batch when ``seq_len`` is not given (None:
    not a sequence model)."""
    return next((n for p, n in SEQ_LEN_DEFAULTS.items() if (name or "").startswith(p)), None)


def lm_is_sparse(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """The decoder's sparse leaves: its layers' projections (kernels with ndim >= 2, as
    :func:`~lowmem_jax.techniques.sparsity.default_is_sparse`); the embeddings and the output
    head (``lm_head``, BERT's ``mlm``: the classifier's last layer) stay dense."""
    return sparsity.default_is_sparse(path, shape) and not {"lm_head", "mlm"} & set(path)


def translation_is_sparse(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """The DynamicConv Transformer's sparse leaves: its dense (``Linear``) kernels.

    :func:`~lowmem_jax.techniques.sparsity.default_is_sparse` (kernels with ndim >= 2: the
    input/output projections around each convolution, the attention projections, the FFN layers),
    minus the DynamicConv's weight-predicting ``weight_linear`` (``C -> H * K``; 2% of the IWSLT
    model's parameters), which stays dense: each of its outputs is a kernel tap fed to a softmax, so
    zeroing its inputs changes every position's convolution kernel, for little memory. The
    embeddings (``embedding``) and the output projection (``embed_out``) are not kernels and
    stay dense, as the classifier's last layer does.
    """
    return sparsity.default_is_sparse(path, shape) and "weight_linear" not in path


def workload(
    name: str,
    batch_size: int | None = None,
    *,
    seq_len: int | None = None,
    image_size: int = 32,
    **model_overrides: Any,
) -> Workload:
    """The named workload (module docstring) at ``batch_size`` (None: the model's default).

    ``model_overrides``: fields of the model (e.g. ``src_vocab_size``, ``dropout``).
    ``seq_len``: tokens per sequence of a sequence model (None: its default).
    ``name`` ``"package.module:function"``: a user's model, ``function()`` returning its
    :func:`lowmem_jax.custom_workload` (``batch_size`` then resizes its batch).

    Raises:
      ValueError: for an unknown name or a batch size / sequence length / image size below 1.
    """
    if ":" in (name or ""):
        return _imported_workload(name, batch_size)
    for label, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    seq_len = default_seq_len(name) if seq_len is None else seq_len
    if (name or "").startswith("llama-"):
        if name[len("llama-") :] not in PRESETS:
            raise ValueError(f"Unknown model={name!r}; allowed values: {MODEL_NAMES}")
        model = models.Llama.preset(name[len("llama-") :], **model_overrides)
        tokens = jax.ShapeDtypeStruct((batch_size or 4, seq_len), jnp.int32)
        batch = {"inputs": tokens, "targets": tokens}
        return Workload(name, "lm", model, batch, ("inputs",), LLAMA_RECIPE, lm_is_sparse)
    if (name or "").startswith("bert-"):
        if name[len("bert-") :] not in BERT_PRESETS:
            raise ValueError(f"Unknown model={name!r}; allowed values: {MODEL_NAMES}")
        model = models.Bert.preset(name[len("bert-") :], **model_overrides)
        tokens = jax.ShapeDtypeStruct((batch_size or 8, seq_len), jnp.int32)
        weights = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
        batch = {"inputs": tokens, "targets": tokens, "weights": weights}
        return Workload(name, "mlm", model, batch, ("inputs",), BERT_RECIPE, lm_is_sparse)
    if name in DYNAMICCONV_RECIPES:
        if name == "dynamicconv-iwslt":
            model = models.DynamicConvTransformer.iwslt_de_en(**model_overrides)
        else:
            model = models.DynamicConvTransformer.small(**model_overrides)
        tokens = jax.ShapeDtypeStruct((batch_size or 100, seq_len), jnp.int32)
        batch = {"src": tokens, "tgt_in": tokens, "tgt_out": tokens}
        return Workload(
            name,
            "translation",
            model,
            batch,
            ("src", "tgt_in"),
            DYNAMICCONV_RECIPES[name],
            translation_is_sparse,
        )
    match = re.fullmatch(r"wrn-(\d+)-(\d+)", name or "")
    if not match:
        raise ValueError(f"Unknown model={name!r}; allowed values: {MODEL_NAMES}")
    depth, width = map(int, match.groups())
    # CIFAR-10's statistics in pixel units, for uint8 batches (Plan.input_dtype).
    overrides = {"num_classes": 10, **CIFAR10_PIXEL_STATS, **model_overrides}
    model = models.WideResNet(depth=depth, width=width, **overrides)
    b = batch_size or 128
    batch = {
        "image": jax.ShapeDtypeStruct((b, image_size, image_size, 3), jnp.float32),
        "label": jax.ShapeDtypeStruct((b,), jnp.int32),
    }
    return Workload(name, "classification", model, batch, ("image",), WRN_RECIPE)


def _imported_workload(name: str, batch_size: int | None) -> Workload:
    """``module:function``'s workload (``function()``), its batch resized to ``batch_size``."""
    module_name, _, function = name.partition(":")
    try:
        made = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"model {name!r}: cannot call {function}() of {module_name}: {err}"
        ) from None
    if not isinstance(made, Workload):
        raise ValueError(
            f"model {name!r}: {function}() returned {type(made).__name__}, not a Workload "
            "(lowmem_jax.custom_workload(...))"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return made if batch_size is None else made.with_batch(made.batch, batch_size)
