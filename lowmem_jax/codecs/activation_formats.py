"""Stored formats of activation residuals: one array in bf16, int8, int4 or int2, or a mask in
bits (:mod:`lowmem_jax.techniques.activations.residuals` stores a function's residuals in them).

The formats (:func:`parse_spec`, ``Plan(activations=...)``):

=========  ===============================================================================
``none``   residuals as the forward pass made them
``bf16``   float32 residuals rounded to bfloat16 (nearest even); 16-bit ones kept
``int8``   ``b = 8``, ``4``, ``2`` bits per element: each group of ``G = 256`` consecutive
``int4``   elements (of the flattened residual) keeps its minimum ``z`` and range ``r`` (float32)
``int2``   and codes ``q = SR((x - z) / r * (2^b - 1))`` in ``[0, 2^b - 1]``; decompressed as
           ``z + q * r / (2^b - 1)``. ``SR`` is ActNN's stochastic rounding (``floor(v + u)``,
           ``u ~ U[0, 1)``: unbiased, ``E[x_hat] = x``; error below one step ``r / (2^b - 1)``)
=========  ===============================================================================

A suffix ``:nearest`` (e.g. ``int8:nearest``) rounds to nearest instead (error below half a
step, biased): a named departure from ActNN. The noise ``u`` is a counter-based hash of each
element's bits and position (``lowbias32``), not a PRNG stream: no key is threaded through the
model, the step stays deterministic, and the noise differs between elements and between steps
whenever the values do.

A compressed residual is one ``uint8`` (``int*``) or ``uint16`` (``bf16``) array: ``int*``
rows of ``[z, r as 8 bytes | G * b / 8 bytes of packed codes]``, one row per group. Being
unsigned integers, compressed residuals are never compressed again by an enclosing
:func:`compress_residuals` (nesting is safe: the inner one's residuals pass through).

Boolean residuals (a ReLU's mask) are stored one bit per element (:data:`MASK`), exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "FORMATS",
    "ActivationSpec",
    "MASK",
    "parse_spec",
    "compress",
    "decompress",
    "compress_activation",
]

FORMATS = ("none", "bf16", "int8", "int4", "int2")

_BITS = {"int8": 8, "int4": 4, "int2": 2}
_HEADER = 8  # bytes per group: the minimum and the range, float32 each


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """A parsed activation format.

    Attributes:
      name: the format string it was parsed from.
      kind: ``"none"``, ``"bf16"`` or ``"int"``.
      bits: bits per code (``int``: 8, 4 or 2; ``bf16``: 16; ``none``: 0).
      stochastic: stochastic rounding (ActNN's rule) rather than to nearest.
      group_size: elements per group sharing a minimum and range.
      min_size: residuals with fewer elements are kept as they are.
    """

    name: str
    kind: str
    bits: int = 0
    stochastic: bool = True
    group_size: int = 256
    min_size: int = 1024

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def stored_bytes(self, size: int, itemsize: int) -> int:
        """Bytes of one compressed residual of ``size`` elements of ``itemsize`` bytes."""
        if self.kind == "bf16":
            return size * min(itemsize, 2)
        if self.kind == "bits":
            return -(-size // 8)
        groups = -(-size // self.group_size)
        return groups * (_HEADER + self.group_size * self.bits // 8)


#: Boolean residuals (masks), one bit per element: exact.
MASK = ActivationSpec("bits", "bits", bits=1, stochastic=False)


def parse_spec(name: str | ActivationSpec) -> ActivationSpec:
    """Parses an activation format (see the module docstring).

    Raises:
      ValueError: naming ``activations`` and the allowed values.
    """
    if isinstance(name, ActivationSpec):
        return name
    base, _, option = name.partition(":") if isinstance(name, str) else (None, "", "")
    if base == "none" and not option:
        return ActivationSpec(name, "none")
    if base == "bf16" and not option:
        return ActivationSpec(name, "bf16", bits=16, stochastic=False)
    if base in _BITS and option in ("", "nearest"):
        return ActivationSpec(name, "int", bits=_BITS[base], stochastic=option != "nearest")
    raise ValueError(
        f"Unknown activations={name!r}; allowed values: {list(FORMATS)} "
        "(an int format also as NAME:nearest, e.g. int8:nearest)"
    )


# --- one array --------------------------------------------------------------------------------


def _uniform_noise(x: jax.Array) -> jax.Array:
    """``u`` in ``[0, 1)`` per element of flat float ``x``: the ``lowbias32`` hash of the
    element's float32 bits xor its position times the golden ratio."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    h = bits ^ (lax.iota(jnp.uint32, x.size) * jnp.uint32(0x9E3779B9))
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def compress(x: jax.Array, spec: ActivationSpec | str) -> jax.Array:
    """``x`` (any shape, floating) in ``spec``'s format: ``uint16[x.shape]`` for ``bf16``;
    ``uint8[groups, 8 + G * b / 8]`` for ``int*`` (``groups = ceil(x.size / G)``; the last
    group is padded by repeating ``x``'s last element, which leaves its range as it is).
    :func:`decompress` inverts it."""
    spec = parse_spec(spec)
    if spec.kind == "bf16":
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if spec.kind == "bits":
        flat = x.reshape(-1).astype(jnp.uint8)
        flat = jnp.pad(flat, (0, -flat.size % 8))
        return _pack(flat.reshape(-1, 1, 8), 1).reshape(-1)
    if spec.kind != "int":
        raise ValueError(f"activations={spec.name!r} stores nothing compressed")
    g, levels = spec.group_size, (1 << spec.bits) - 1
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % g
    if pad:
        flat = jnp.concatenate([flat, jnp.broadcast_to(flat[-1], (pad,))])
    groups = flat.reshape(-1, g)
    noise = _uniform_noise(flat).reshape(groups.shape) if spec.stochastic else jnp.float32(0.5)
    lo = groups.min(axis=1, keepdims=True)
    span = groups.max(axis=1, keepdims=True) - lo
    scale = jnp.where(span > 0, levels / jnp.where(span > 0, span, 1.0), 0.0)
    codes = jnp.clip(jnp.floor((groups - lo) * scale + noise), 0, levels).astype(jnp.uint8)
    if spec.bits < 8:
        codes = _pack(codes.reshape(codes.shape[0], -1, 8 // spec.bits), spec.bits)
    header = lax.bitcast_convert_type(jnp.concatenate([lo, span], axis=1), jnp.uint8)
    return jnp.concatenate([header.reshape(header.shape[0], _HEADER), codes], axis=1)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """``uint8[rows, n, 8 / bits]`` codes of ``bits`` bits each -> ``uint8[rows, n]`` (code
    ``i`` of a byte in bits ``[bits * i, bits * (i + 1))``)."""
    out = codes[..., 0]
    for i in range(1, codes.shape[-1]):
        out = out | (codes[..., i] << jnp.uint8(bits * i))
    return out


def decompress(
    stored: jax.Array, shape: Sequence[int], dtype: Any, spec: ActivationSpec | str
) -> jax.Array:
    """The ``dtype[shape]`` array :func:`compress` stored in ``stored``."""
    spec = parse_spec(spec)
    if spec.kind == "bf16":
        return lax.bitcast_convert_type(stored, jnp.bfloat16).astype(dtype)
    if spec.kind == "bits":
        bits = [(stored >> jnp.uint8(i)) & jnp.uint8(1) for i in range(8)]
        size = int(np.prod(shape))
        return jnp.stack(bits, axis=1).reshape(-1)[:size].reshape(shape).astype(dtype)
    levels = (1 << spec.bits) - 1
    header = lax.bitcast_convert_type(stored[:, :_HEADER].reshape(-1, 2, 4), jnp.float32)
    lo, span = header[:, :1], header[:, 1:]
    packed = stored[:, _HEADER:]
    per_byte = 8 // spec.bits
    if per_byte > 1:
        mask = jnp.uint8(levels)
        parts = [(packed >> jnp.uint8(spec.bits * i)) & mask for i in range(per_byte)]
        packed = jnp.stack(parts, axis=2).reshape(packed.shape[0], -1)
    flat = lo + packed.astype(jnp.float32) * (span / levels)
    size = int(np.prod(shape))
    return flat.reshape(-1)[:size].reshape(shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def compress_activation(x: jax.Array, spec: ActivationSpec) -> jax.Array:
    """:func:`compress` as :func:`compress_residuals` calls it: a named call, so that a traced
    step shows each compressed residual (an equation named ``compress_activation``)."""
    return compress(x, spec)
