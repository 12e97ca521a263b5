"""Low-bit storage of float arrays: quantization maps, block-wise and rank-1 normalization.

A quantized array ``x`` (any shape, ``n`` elements) is a pair ``(codes, scales)``:

    x ~= q[codes] * s        q: a sorted code book in [-1, 1] or [0, 1], 2**bits entries
                             s: each element's scale, from the scales

* **block-wise** (Dettmers et al., ICLR 2022): ``x`` flattened and zero-padded to ``nb`` blocks
  of ``block_size``; ``scales: float32[nb]``, the absmax of each block; element ``i`` of block
  ``b`` has ``s = scales[b]``. An all-zero block has scale 0 and decodes to zeros.
* **rank-1** (Li, Chen, Zhu, NeurIPS 2023), for a tensor of rank ``r >= 2``: ``scales`` is one
  float32 vector per axis, ``m_a[j] = max |x|`` over the elements whose axis-``a`` index is
  ``j``; element ``(i_1..i_r)`` has ``s = min_a m_a[i_a]`` (so ``|x| / s <= 1``). ``sum(shape)``
  floats instead of ``n / block_size``.

``codes``: ``uint8[nb * block_size]`` for 8 bits; for 4 bits two codes per byte,
``uint8[ceil(n_padded / 2)]`` (low nibble first). Encoding picks the nearest code
(``argmin_k |q_k - x/s|``), or with a PRNG key rounds stochastically between the two codes
around ``x/s`` (unbiased: ``E[q[code]] = x/s``).

Code books (:func:`dynamic_map`, :func:`linear_map`): the dynamic-exponent map of Dettmers
(``bitsandbytes.functional.create_dynamic_map``: signed for first moments, unsigned for second),
and the 4-bit paper's zero-free linear map ``q_k = (k + 1) / 2**bits`` for second moments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "dynamic_map",
    "linear_map",
    "code_book",
    "CODE_BOOKS",
    "Quantized",
    "quantize",
    "dequantize",
    "zero_where",
    "quantized_nbytes",
]


def dynamic_map(signed: bool = True, total_bits: int = 8, max_exponent_bits: int | None = None):
    """The dynamic (tree) quantization map of Dettmers et al.: ``float32[2**total_bits]``, sorted.

    For exponent ``e = 0 .. E-1`` (``E = max_exponent_bits``, default ``total_bits - 1``), the
    midpoints of ``linspace(0.1, 1, 2**(e + u) + 1)`` (``u = 1`` unsigned, 0 signed: signed maps
    spend that bit on the sign) scaled by ``10**(e - E + 1)``, mirrored to negative values when
    ``signed``; plus 0 and 1. As ``bitsandbytes``' ``create_dynamic_map(signed, E, total_bits)``.
    """
    exponents = total_bits - 1 if max_exponent_bits is None else max_exponent_bits
    non_sign_bits = total_bits - 1  # bitsandbytes: the same for signed and unsigned maps
    values = []
    for e in range(exponents):
        items = 2 ** (e + non_sign_bits - exponents + (0 if signed else 1)) + 1
        bounds = np.linspace(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        magnitude = 10.0 ** (-(exponents - 1) + e)
        values += list(magnitude * means)
        if signed:
            values += list(-magnitude * means)
    extra = 2 ** (non_sign_bits - exponents) - 1
    if extra > 0:  # all exponent bits zero, no indicator bit: bitsandbytes' magnitude 1
        bounds = np.linspace(0.1, 1.0, extra + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += list(means) + (list(-means) if signed else [])
    values += [0.0, 1.0]
    if len(values) != 2**total_bits:
        raise ValueError(
            f"dynamic_map(signed={signed}, total_bits={total_bits}, max_exponent_bits="
            f"{exponents}) has {len(values)} values, not {2**total_bits}"
        )
    return np.sort(np.asarray(values, np.float32))


def linear_map(total_bits: int = 4) -> np.ndarray:
    """The zero-free linear map ``(k + 1) / 2**total_bits``, ``k = 0 .. 2**total_bits - 1``."""
    n = 2**total_bits
    return (np.arange(1, n + 1, dtype=np.float32) / n).astype(np.float32)


#: Code-book names: ``dynamic`` (signed), ``dynamic_unsigned``, ``linear`` (zero-free, unsigned).
CODE_BOOKS = ("dynamic", "dynamic_unsigned", "linear")


@functools.cache
def _code_book(name: str, bits: int) -> tuple[float, ...]:
    if name == "linear":
        book = linear_map(bits)
    elif name in ("dynamic", "dynamic_unsigned"):
        book = dynamic_map(signed=name == "dynamic", total_bits=bits)
    else:
        raise ValueError(f"Unknown code book {name!r}; allowed values: {list(CODE_BOOKS)}")
    return tuple(float(v) for v in book)


def code_book(name: str, bits: int) -> np.ndarray:
    """The code book ``name`` (one of :data:`CODE_BOOKS`) with ``2**bits`` entries, sorted."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return np.asarray(_code_book(name, bits), np.float32)


class Quantized(NamedTuple):
    """A quantized array (see the module docstring); a pytree whose leaves are the stored bytes.

    ``codes``: uint8; ``scales``: float32 array (block-wise) or tuple of vectors (rank-1);
    ``meta``: static (no leaves, so it survives ``jit`` and ``tree.map`` over the leaves).
    """

    codes: jax.Array
    scales: Any
    meta: QuantizedMeta

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class QuantizedMeta:
    """Static facts of a :class:`Quantized`: the array's shape, bits per code, the block size
    (0: rank-1 normalization) and the code book's name."""

    shape: tuple[int, ...]
    bits: int
    block_size: int
    code_book: str


def _nearest_code(q: jax.Array, v: jax.Array, key: jax.Array | None) -> jax.Array:
    """Index into sorted ``q`` of the code for each normalized ``v`` (nearest or stochastic).

    ``lo``: the last code below ``v`` (0 if none), by a binary search unrolled into
    ``log2(len(q))`` gathers from the code book, so that it fuses into one elementwise loop with
    what produces ``v`` (``jnp.searchsorted`` carries index arrays of ``v``'s size through a
    ``while`` loop instead); ``hi = lo + 1``, both clipped to the book.
    """
    size = q.shape[0]
    lo = jnp.zeros(v.shape, jnp.int32)
    step = size // 2
    while step >= 1:
        probe = lo + step
        lo = jnp.where(q[jnp.minimum(probe, size - 1)] < v, probe, lo)
        step //= 2
    hi = jnp.clip(lo + 1, 1, size - 1)
    lo = hi - 1
    q_lo, q_hi = q[lo], q[hi]
    if key is None:
        take_hi = (q_hi - v) < (v - q_lo)
    else:  # P(hi) = (v - q_lo) / (q_hi - q_lo), clipped: values outside [q_0, q_-1] saturate
        p_hi = jnp.clip((v - q_lo) / (q_hi - q_lo), 0.0, 1.0)
        take_hi = jax.random.uniform(key, v.shape) < p_hi
    return jnp.where(take_hi, hi, lo).astype(jnp.uint8)


def _pack4(codes: jax.Array) -> jax.Array:
    codes = codes.reshape(-1, 2)
    return (codes[:, 0] | (codes[:, 1] << 4)).astype(jnp.uint8)


def _rank1_scale(scales: tuple[jax.Array, ...], shape: tuple[int, ...]) -> jax.Array:
    """``s[i_1..i_r] = min_a m_a[i_a]`` broadcast to ``shape``."""
    rank = len(shape)
    out = None
    for axis, m in enumerate(scales):
        view = m.reshape([shape[axis] if a == axis else 1 for a in range(rank)])
        out = view if out is None else jnp.minimum(out, view)
    return jnp.broadcast_to(out, shape)


def _rank1_scale_at(scales: tuple[jax.Array, ...], shape: tuple[int, ...], flat: jax.Array):
    """``min_a m_a[i_a]`` at row-major flat indices ``flat`` (int32; indices past the end are
    clamped: they only ever address padding, whose values are 0)."""
    flat = jnp.minimum(flat, math.prod(shape) - 1)
    out, stride = None, 1
    for axis in reversed(range(len(shape))):
        m = scales[axis][(flat // stride) % shape[axis]]
        out = m if out is None else jnp.minimum(out, m)
        stride *= shape[axis]
    return out


def _scale_of(scales, shape: tuple[int, ...], block_size: int):
    """``scale_of(start, size)``: the scales of flat elements ``[start, start + size)``
    (block-wise: ``start`` and ``size`` whole blocks; rank-1 when ``block_size == 0``)."""
    if block_size == 0:

        def rank1(start, size):
            return _rank1_scale_at(scales, shape, start + jnp.arange(size, dtype=jnp.int32))

        return rank1

    def blockwise(start, size):
        block = jax.lax.dynamic_slice(scales, (start // block_size,), (size // block_size,))
        return jnp.repeat(block, block_size, total_repeat_length=size)

    return blockwise


def _buffer_after(anchor: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """A buffer for a chunked loop to fill, computed from ``anchor`` (its values are all
    overwritten): a plain ``zeros`` depends on nothing, so XLA may make it at the start of the
    program and hold it through the backward pass."""
    seed = (anchor.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(dtype)
    return jnp.broadcast_to(seed, shape)


def _chunk(unit: int) -> int:
    return max(unit, ENCODE_CHUNK // unit * unit)


#: Elements encoded per loop iteration (rounded to whole blocks): the encoder's float32 and
#: int32 transients are a few of these, whatever the array's size.
ENCODE_CHUNK = 2**15


def _encode(flat, q, bits, unit, scale_of, key):
    """Codes (uint8, two per byte for 4 bits) of ``flat`` (float32[n]) zero-padded to a
    multiple of ``unit``: ``code(flat[i] / scale_of(start, size)[i - start])``.

    A ``fori_loop`` over chunks of :data:`ENCODE_CHUNK` elements writes each chunk's codes in
    place, so no array of ``flat``'s size but the codes is made: XLA materializes each step of
    the code search (a gather from the code book) over its whole operand, and a loop bounds
    that operand. The tail after the last whole chunk is padded and encoded after the loop.
    Stochastic rounding draws chunk ``i``'s uniforms from ``fold_in(key, i)``.
    """
    n = flat.shape[0]
    padded = -(-n // unit) * unit
    chunk = _chunk(unit)
    per_byte = 8 // bits

    def encode_chunk(x, start, i):
        scale = scale_of(start, x.shape[0])
        v = jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0)
        sub = None if key is None else jax.random.fold_in(key, i)
        codes = _nearest_code(q, v, sub)
        return _pack4(codes) if bits == 4 else codes

    codes = _buffer_after(flat, (padded // per_byte,), jnp.uint8)
    whole = n // chunk

    def body(i, codes):
        start = i * chunk
        piece = encode_chunk(jax.lax.dynamic_slice(flat, (start,), (chunk,)), start, i)
        return jax.lax.dynamic_update_slice(codes, piece, (start // per_byte,))

    if whole:
        codes = jax.lax.fori_loop(0, whole, body, codes)
    start = whole * chunk
    if start < n:
        tail = jnp.pad(flat[start:], (0, padded - n))
        piece = encode_chunk(tail, start, whole)
        codes = jax.lax.dynamic_update_slice(codes, piece, (start // per_byte,))
    return codes


def quantize(
    x: jax.Array,
    book: str = "dynamic",
    bits: int = 8,
    *,
    block_size: int = 2048,
    rank1: bool = False,
    key: jax.Array | None = None,
) -> Quantized:
    """``x`` (any float array) -> :class:`Quantized`: ``bits`` per code from code book ``book``.

    ``block_size``: elements per absmax block; ``rank1=True`` normalizes a rank >= 2 tensor by
    per-axis maxima instead (rank 0 or 1 falls back to blocks). ``key``: stochastic rounding.
    The codes are made chunk by chunk (:func:`_encode`): besides the result, the transients
    are bounded by :data:`ENCODE_CHUNK` elements.
    """
    q = jnp.asarray(code_book(book, bits))
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even integer >= 2, got {block_size}")
    x32 = jnp.asarray(x, jnp.float32)
    shape = tuple(x.shape)
    flat = x32.reshape(-1)
    rank1 = rank1 and x32.ndim >= 2
    if rank1:
        axes = range(x32.ndim)
        others = [tuple(b for b in axes if b != a) for a in axes]
        # max |x| as max(max x, -min x): reductions of x itself, so no |x| array is made
        scales = tuple(jnp.maximum(x32.max(axis=o), -x32.min(axis=o)) for o in others)
    else:
        pad = (-flat.shape[0]) % block_size
        scales = jnp.abs(jnp.pad(flat, (0, pad)).reshape(-1, block_size)).max(axis=1)
    block = 0 if rank1 else block_size
    codes = _encode(flat, q, bits, block or 2, _scale_of(scales, shape, block), key)
    meta = QuantizedMeta(shape, bits, 0 if rank1 else block_size, book)
    return Quantized(codes, scales, meta)


def _lookup(book: np.ndarray, codes: jax.Array) -> jax.Array:
    """``book[codes]`` (float32). A 16-entry book is a tree of selects on the code's bits,
    which XLA fuses into the consumer; a gather (256 entries) is materialized on XLA:CPU."""
    if book.shape[0] > 16:
        return jnp.asarray(book)[codes.astype(jnp.int32)]
    level = [jnp.float32(v) for v in book]
    bit = 0
    while len(level) > 1:
        on = (codes >> bit) & 1 == 1
        level = [jnp.where(on, hi, lo) for lo, hi in zip(level[::2], level[1::2], strict=True)]
        bit += 1
    return level[0]


def dequantize(qx: Quantized, dtype: Any = jnp.float32) -> jax.Array:
    """:class:`Quantized` -> the array ``q[codes] * s`` of ``qx.shape``, in ``dtype``."""
    meta = qx.meta
    book = code_book(meta.code_book, meta.bits)
    if meta.bits == 4:  # look up both nibbles, then interleave: no unpacked copy of the codes
        low, high = _lookup(book, qx.codes & 0xF), _lookup(book, qx.codes >> 4)
        values = jnp.stack([low, high], axis=-1).reshape(-1)
    else:
        values = _lookup(book, qx.codes)
    n = math.prod(meta.shape)
    if meta.block_size == 0:
        s = _rank1_scale(qx.scales, meta.shape).reshape(-1)
        out = values[:n] * s
    else:
        out = (values.reshape(-1, meta.block_size) * qx.scales[:, None]).reshape(-1)[:n]
    return out.reshape(meta.shape).astype(dtype)


def zero_where(qx: Quantized, keep: jax.Array) -> Quantized:
    """``qx`` with the elements where ``keep`` (bool, ``qx.shape``) is false set to the code of
    the book's least magnitude (0 in the dynamic maps; the zero-free linear map's smallest,
    which decodes to ``s / 2**bits``). The scales stay: no float array is made, and an element
    kept decodes as before."""
    meta = qx.meta
    zero = np.uint8(np.argmin(np.abs(code_book(meta.code_book, meta.bits))))
    per_byte = 8 // meta.bits
    keep = keep.reshape(-1)
    keep = jnp.pad(keep, (0, qx.codes.shape[0] * per_byte - keep.shape[0]), constant_values=True)
    if meta.bits == 8:
        return qx._replace(codes=jnp.where(keep, qx.codes, zero))
    pairs = keep.reshape(-1, 2)
    low = jnp.where(pairs[:, 0], qx.codes & 0xF, zero)
    high = jnp.where(pairs[:, 1], qx.codes >> 4, zero)
    return qx._replace(codes=(low | (high << 4)).astype(jnp.uint8))


def quantized_nbytes(qx: Quantized) -> int:
    """Stored bytes: the codes plus the float32 scales."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(qx))
