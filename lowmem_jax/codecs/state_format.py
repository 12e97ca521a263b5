"""How :func:`lowmem_jax.techniques.optimizer_state.quantized.quantized_state` stores each leaf of
an optimizer's state, and reads it back (the formats' table:
:mod:`lowmem_jax.techniques.optimizer_state.quantized`).

:func:`encode_new` gives a fresh leaf its stored form in a format, :func:`encode_like` stores an
updated float32 leaf as its old one was (same dtype, or same code book and blocks), and
:func:`decode` turns a stored state back into float32 leaves. Non-floating leaves (step counts,
masks, indices) pass through each of them as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.codecs import quantization
from lowmem_jax.core.base import PyTree, cast_floating

__all__ = [
    "FORMATS",
    "QUANTIZED_FORMATS",
    "DEFAULT_BLOCK",
    "SECOND_MOMENTS",
    "names_second_moment",
    "check_format",
    "is_quantized",
    "encode_new",
    "encode_like",
    "decode",
]

FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
#: The formats whose leaves are codes + scales rather than float arrays of the slots' shapes.
QUANTIZED_FORMATS = ("int8", "int4")
_FLOAT_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
#: Elements per absmax block of the quantized formats, unless given.
DEFAULT_BLOCK = {"int8": 2048, "int4": 128}


def check_format(format: str) -> None:
    """Raises ``ValueError`` unless ``format`` is one of :data:`FORMATS`."""
    if format not in FORMATS:
        raise ValueError(f"Unknown optimizer_state={format!r}; allowed values: {list(FORMATS)}")


def is_quantized(x: Any) -> bool:
    return isinstance(x, quantization.Quantized)


#: State field names whose leaves are non-negative second moments (optax's ``nu``: Adam, AdamW,
#: RMSProp, Yogi...; Adagrad's ``sum_of_squares``).
SECOND_MOMENTS = ("nu", "sum_of_squares")


def names_second_moment(path, second_moments: tuple[str, ...] = SECOND_MOMENTS) -> bool:
    """Whether a leaf's key ``path`` in an optimizer state names one of ``second_moments``."""
    names = {str(getattr(k, "name", None) or getattr(k, "key", "")) for k in path}
    return bool(names & set(second_moments))


def encode_new(
    path,
    x: Any,
    format: str,
    *,
    min_size: int,
    block_size: int,
    second_moments: tuple[str, ...],
) -> Any:
    """The stored form in ``format`` of a fresh (``init``) leaf ``x`` at ``path`` in the state:
    a second moment when ``path`` names one of ``second_moments``; float32 under ``min_size``
    elements (all formats but ``auto``)."""
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    if format == "auto":  # half slots in bfloat16: float16 squares underflow
        return x.astype(jnp.bfloat16) if jnp.dtype(x.dtype).itemsize < 4 else x
    if x.size < min_size or format in _FLOAT_DTYPES:
        dtype = jnp.float32 if x.size < min_size else _FLOAT_DTYPES[format]
        return x.astype(dtype)
    second = names_second_moment(path, second_moments)
    if format == "int8":
        book, rank1 = ("dynamic_unsigned" if second else "dynamic"), False
    else:  # int4: first moments block-wise DE, second moments rank-1 + zero-free linear
        book, rank1 = ("linear" if second else "dynamic"), second
    bits = 8 if format == "int8" else 4
    return quantization.quantize(x, book, bits, block_size=block_size, rank1=rank1)


def encode_like(old: Any, new: jax.Array, key: jax.Array | None, block_size: int) -> Any:
    """``new`` (float32) stored as ``old`` was: same code book and blocks (``block_size`` where
    ``old`` records none; ``key``: stochastic rounding's, or ``None``), or same dtype."""
    if is_quantized(old):
        meta = old.meta
        return quantization.quantize(
            new,
            meta.code_book,
            meta.bits,
            block_size=meta.block_size or block_size,
            rank1=meta.block_size == 0,
            key=key,
        )
    if hasattr(old, "dtype") and jnp.issubdtype(old.dtype, jnp.floating):
        return new.astype(old.dtype)
    return new


def decode(stored: PyTree) -> PyTree:
    """A stored state -> the same state with float32 floating leaves."""

    def leaf(x):
        if is_quantized(x):
            return quantization.dequantize(x)
        return cast_floating(x, jnp.float32)

    return jax.tree.map(leaf, stored, is_leaf=is_quantized)
