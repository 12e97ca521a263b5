"""Exact-count selection on flat per-layer vectors, and budget allocation across layers.

All functions are pure and jit-safe; counts may be traced ``int32`` scalars. Selections are made
by ranking (a stable ``argsort``), so a selection of ``c`` elements has exactly ``c`` elements
whenever at least ``c`` are eligible, ties broken by position: identical inputs give identical
masks. The compressed-storage variants (:func:`smallest_slots`, :func:`top_positions`) select
the same elements with a ``[capacity]`` sort or a radix select instead of a dense sort.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

__all__ = [
    "smallest",
    "largest",
    "grow_score",
    "grow_scale",
    "grow_key",
    "over_chunks",
    "slicer",
    "top_positions",
    "smallest_slots",
    "allocate",
    "greedy_fill",
    "top_k_mask",
    "uniform_part",
    "uniform_scores",
]

# Elements drawn per iteration by :func:`uniform_scores` (64 KiB of float32 per chunk).
SCORE_CHUNK = 1 << 14
# Elements per pass of :func:`top_positions`'s loops (128 KiB of int32 per chunk).
SELECT_CHUNK = 1 << 15


def _ranks(key: jax.Array) -> jax.Array:
    """Rank of each position in a stable ascending sort of ``key``, int32 ``[n]``."""
    order = jnp.argsort(key, stable=True)
    n = order.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))


def smallest(eligible: jax.Array, score: jax.Array, count: jax.Array) -> jax.Array:
    """Bool ``[n]``: the ``count`` eligible positions with the smallest ``score``.

    ``eligible`` bool ``[n]``, ``score`` float ``[n]``, ``count`` int scalar (``<= sum(eligible)``
    for an exact count).
    """
    ranks = _ranks(jnp.where(eligible, score.astype(jnp.float32), jnp.inf))
    return eligible & (ranks < count)


def largest(
    eligible: jax.Array, score: jax.Array, count: jax.Array, prefer: jax.Array | None = None
) -> jax.Array:
    """Bool ``[n]``: the ``count`` eligible positions with the largest ``score`` (``>= 0``).

    Positions where ``prefer`` is True come first whatever their score (used to regrow at
    positions that were zero before, falling back to just-pruned ones only when a layer is too
    dense to have enough of them). Scores are normalised to ``[0, 1]`` and preferred ones
    offset by 2, so one sort does it.
    """
    ranks = _ranks(jnp.where(eligible, -grow_score(eligible, score, prefer), jnp.inf))
    return eligible & (ranks < count)


def grow_score(eligible: jax.Array, score: jax.Array, prefer: jax.Array | None = None) -> jax.Array:
    """The float32 ranking key of :func:`largest`: ``|score|`` normalised by its eligible maximum,
    plus 2 where ``prefer``: ``grow_key(score, grow_scale(eligible, score), prefer)``, the same
    arithmetic the compressed path applies chunk by chunk, so both order positions identically
    (ties by position)."""
    return grow_key(score, grow_scale(eligible, score), prefer)


def grow_scale(eligible: jax.Array, score: jax.Array) -> jax.Array:
    """float32 scalar: the largest eligible ``|score|`` (at least ``1e-30``)."""
    score = jnp.abs(score.astype(jnp.float32))
    return jnp.maximum(jnp.max(jnp.where(eligible, score, 0.0)), 1e-30)


def grow_key(score: jax.Array, scale: jax.Array, prefer: jax.Array | None = None) -> jax.Array:
    """float32: ``|score| / scale``, plus 2 where ``prefer`` (elementwise, any slice of ``[n]``)."""
    key = jnp.abs(score.astype(jnp.float32)) / scale
    return key if prefer is None else key + 2.0 * prefer


def _order_key(key: jax.Array) -> jax.Array:
    """uint32, ordered as the float32 ``key`` is (the radix sort's key: negative floats' bits
    inverted, non-negative ones' sign bit set; ``-0.0`` below ``0.0``, as ``lax.sort``)."""
    bits = jax.lax.bitcast_convert_type(key.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def over_chunks(n: int, body, carry):
    """``carry = body(start, size, carry)`` over ``[0, n)`` in chunks of :data:`SELECT_CHUNK`
    (a ``fori_loop`` over the whole chunks, ``start`` traced, then the remainder), so that the
    work on an ``[n]`` vector holds ``[chunk]`` temporaries, not ``[n]`` ones."""
    whole, tail = divmod(n, SELECT_CHUNK)
    if whole:
        carry = jax.lax.fori_loop(
            0, whole, lambda c, x: body(c * SELECT_CHUNK, SELECT_CHUNK, x), carry
        )
    return body(whole * SELECT_CHUNK, tail, carry) if tail else carry


def top_positions(chunk: Callable, n: int, count: jax.Array, k: int) -> jax.Array:
    """int32 ``[k]``: the positions of the ``min(count, k)`` (``count`` traced) eligible entries
    of ``[0, n)`` with the largest key, ascending, padded with ``n``; ties by position, as
    :func:`largest` and ``lax.top_k`` (the lower index first among equal values).

    ``chunk(start, size)`` gives the bool eligibility and float key of positions ``[start,
    start + size)`` (``start`` traced), so no ``[n]`` key need exist: the caller computes each
    chunk from what it holds (:func:`grow_key` of a slice of the scores).

    A radix select instead of a sort: 32 counting passes fix, one bit at a time from the top,
    the ``count``-th largest key ``t`` (the largest ``t`` with ``#{eligible, key >= t} >=
    count``); one more pass, in position order, takes the entries above ``t`` and the first
    of those equal to it, writing their positions. Every pass runs over
    :data:`SELECT_CHUNK`-sized chunks (:func:`over_chunks`), so the selection's temporaries
    are ``O(chunk + k)`` whatever ``n``. (``lax.top_k`` of ``k`` keeps ``[n]`` key-index pairs
    and a sort's scratch: XLA:GPU sorts, and XLA:CPU's partial sort allocates ``[n]`` indices
    outside the buffers XLA counts.)
    """
    count = jnp.minimum(jnp.asarray(count, jnp.int32), k)

    def ordered(start, size):
        on, key = chunk(start, size)
        return on, _order_key(key)

    def threshold_bit(i, t):
        candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))

        def at_least(start, size, total):
            on, order = ordered(start, size)
            return total + (on & (order >= candidate)).sum(dtype=jnp.int32)

        return jnp.where(over_chunks(n, at_least, jnp.int32(0)) >= count, candidate, t)

    t = jax.lax.fori_loop(0, 32, threshold_bit, jnp.uint32(0))

    def above(start, size, total):
        on, order = ordered(start, size)
        return total + (on & (order > t)).sum(dtype=jnp.int32)

    need = count - over_chunks(n, above, jnp.int32(0))  # taken among the entries equal to t

    def write(start, size, carry):
        out, written, tied_before = carry
        on, order = ordered(start, size)
        tied = on & (order == t)
        tied_rank = jnp.cumsum(tied, dtype=jnp.int32) + tied_before
        take = (on & (order > t)) | (tied & (tied_rank <= need))
        slot = jnp.where(take, jnp.cumsum(take, dtype=jnp.int32) - 1 + written, k)
        position = start + jnp.arange(size, dtype=jnp.int32)
        out = out.at[slot].set(position, mode="drop")
        return out, written + take.sum(dtype=jnp.int32), tied_rank[-1]

    init = (jnp.full((k,), n, jnp.int32), jnp.int32(0), jnp.int32(0))
    return over_chunks(n, write, init)[0]


def slicer(start: jax.Array | int, size: int) -> Callable[[jax.Array], jax.Array]:
    """``x -> x[start:start + size]`` along axis 0, ``start`` traced or not."""
    return functools.partial(jax.lax.dynamic_slice_in_dim, start_index=start, slice_size=size)


def smallest_slots(
    eligible: jax.Array, score: jax.Array, position: jax.Array, count: jax.Array
) -> jax.Array:
    """Bool ``[c]``: the ``count`` eligible slots with the smallest ``score``, ties by
    ``position`` (int32 ``[c]``, distinct among eligible slots): :func:`smallest` on a compressed
    layer (slot ``j`` holds dense position ``position[j]``), with one sort of ``[c]``."""
    c = score.shape[0]
    key = jnp.where(eligible, score.astype(jnp.float32), jnp.inf)
    slot = jnp.arange(c, dtype=jnp.int32)
    _, _, order = jax.lax.sort((key, position.astype(jnp.int32), slot), num_keys=2)
    ranks = jnp.zeros((c,), jnp.int32).at[order].set(slot)
    return eligible & (ranks < count)


def top_k_mask(score: jax.Array, k: int) -> jax.Array:
    """Bool ``[n]`` with True at the static ``k`` largest ``score`` entries."""
    _, idx = jax.lax.top_k(score, k)
    return jnp.zeros(score.shape, bool).at[idx].set(True)


def greedy_fill(alloc: jax.Array, room: jax.Array, remainder: jax.Array) -> jax.Array:
    """Adds ``remainder`` to ``alloc`` (int32 ``[L]``) layer by layer, within ``room - alloc``."""
    free = jnp.maximum(room - alloc, 0)
    before = jnp.cumsum(free) - free
    return alloc + jnp.clip(remainder - before, 0, free)


def allocate(total: jax.Array, weights: jax.Array, room: jax.Array) -> jax.Array:
    """Splits ``total`` (int scalar) across layers in proportion to ``weights`` (float ``[L]``).

    Returns int32 ``[L]`` summing exactly to ``total`` (when ``sum(room) >= total``), with layer
    ``l`` getting at most ``room[l]``: the proportional share is rounded by cumulative flooring,
    capped at ``room``, and what the caps left over is filled greedily in layer order. All-zero
    weights share in proportion to ``room``.
    """
    total = jnp.asarray(total, jnp.int32)
    room = room.astype(jnp.int32)
    weights = jnp.maximum(weights.astype(jnp.float32), 0.0)
    weights = jnp.where(weights.sum() > 0, weights, room.astype(jnp.float32))
    cum = jnp.cumsum(weights) / jnp.maximum(weights.sum(), 1e-30)
    target = jnp.floor(total.astype(jnp.float32) * cum).astype(jnp.int32)
    target = jnp.clip(jax.lax.cummax(target), 0, total).at[-1].set(total)
    share = jnp.diff(target, prepend=jnp.zeros((1,), jnp.int32))
    share = jnp.minimum(share, room)
    return greedy_fill(share, room, total - share.sum())


def uniform_part(key: jax.Array, n: int) -> Callable[[jax.Array | int, int], jax.Array] | None:
    """``part(start, size)``: float32 ``[size]``, bit for bit ``jax.random.uniform(key, (n,))[start:
    start + size]`` (``start`` traced), drawn without the other ``n - size`` elements; ``None``
    where the key's scheme is not JAX's partitionable threefry or ``n >= 2**32`` (then only the
    whole draw, :func:`uniform_scores`, gives the same numbers).

    With partitionable threefry counters (JAX's default), element ``i`` is ``threefry2x32(key,
    (0, i))``, its two words xor-ed, its top 23 bits as the mantissa of a float in ``[1, 2)``,
    minus 1: any slice can be drawn alone, so random regrowth never needs its ``[n]`` scores.
    """
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(key)) if typed else "threefry2x32"
    # Past 2^32 elements the counters' high word is not 0: drawn whole there.
    if not jax.config.jax_threefry_partitionable or "threefry" not in impl or n >= 1 << 32:
        return None
    words = jax.random.key_data(key) if typed else key
    k1, k2 = words[0], words[1]

    def part(start: jax.Array | int, size: int) -> jax.Array:
        counts = jnp.asarray(start).astype(jnp.uint32) + jnp.arange(size, dtype=jnp.uint32)
        bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
        mantissa = ((bits1 ^ bits2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
        return jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)

    return part


def uniform_scores(key: jax.Array, n: int, chunk: int = SCORE_CHUNK) -> jax.Array:
    """float32 ``[n]``, bit for bit ``jax.random.uniform(key, (n,))`` (random regrowth's scores),
    drawn ``chunk`` elements at a time by :func:`uniform_part`.

    Drawn whole, XLA:CPU runs the hash as a loop whose carries are ``[n]`` words (several dense
    copies of the largest layer alive at once); drawn in chunks, only ``[chunk]`` ones. Other
    key implementations or counter schemes use ``jax.random.uniform`` itself (the same numbers,
    whole).
    """
    part = uniform_part(key, n)
    if part is None or n <= chunk:
        return jax.random.uniform(key, (n,))

    def draw(i, out):
        # The last chunk ends at n (overlapping its predecessor: same indices, same numbers).
        start = jnp.minimum(i * chunk, n - chunk)
        return jax.lax.dynamic_update_slice(out, part(start, chunk), (start,))

    # A zero computed from the key (0 x a number in [0, 1)): XLA may not create the [n] buffer
    # before the key exists, so a caller that sequences layers holds one layer's at a time.
    zero = part(0, 1)[0] * jnp.float32(0.0)
    return jax.lax.fori_loop(0, -(-n // chunk), draw, jnp.broadcast_to(zero, (n,)))
