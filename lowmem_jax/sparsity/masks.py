"""Exact-count selection on flat per-layer vectors, and budget allocation across layers.

All functions are pure and jit-safe; counts may be traced ``int32`` scalars. Selections are made
by ranking (a stable ``argsort``), so a selection of ``c`` elements has exactly ``c`` elements
whenever at least ``c`` are eligible, ties broken by position: identical inputs give identical
masks. The compressed-storage variants (:func:`smallest_slots`, :func:`top_positions`) select
the same elements with a ``[capacity]`` sort or a ``lax.top_k`` instead of a dense sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

__all__ = [
    "smallest",
    "largest",
    "grow_score",
    "top_positions",
    "smallest_slots",
    "allocate",
    "greedy_fill",
    "top_k_mask",
    "uniform_scores",
]

# Elements drawn per iteration by :func:`uniform_scores` (64 KiB of float32 per chunk).
SCORE_CHUNK = 1 << 14


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
    plus 2 where ``prefer``. Shared by the dense ranking and the compressed ``lax.top_k`` path,
    so both order positions identically (ties by position)."""
    score = jnp.abs(score.astype(jnp.float32))
    score = score / jnp.maximum(jnp.max(jnp.where(eligible, score, 0.0)), 1e-30)
    if prefer is not None:
        score = score + 2.0 * prefer
    return score


def top_positions(eligible: jax.Array, key: jax.Array, count: jax.Array, k: int) -> jax.Array:
    """int32 ``[k]``: the positions of the ``count`` (``<= k``, traced) eligible entries with the
    largest ``key``, ascending, padded with ``n = key.shape[0]``; ties by position, as
    :func:`largest` (``lax.top_k`` returns the lower index first among equal values).

    ``lax.top_k`` with a static ``k`` avoids a full sort of the ``[n]`` keys (on XLA:CPU it is a
    partial sort); only ``[k]`` arrays are produced.
    """
    n = key.shape[0]
    vals, pos = jax.lax.top_k(jnp.where(eligible, key, -jnp.inf), k)
    take = (jnp.arange(k, dtype=jnp.int32) < count) & (vals > -jnp.inf)
    return jnp.sort(jnp.where(take, pos.astype(jnp.int32), jnp.int32(n)))


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


def uniform_scores(key: jax.Array, n: int, chunk: int = SCORE_CHUNK) -> jax.Array:
    """float32 ``[n]``, bit for bit ``jax.random.uniform(key, (n,))`` (random regrowth's scores),
    drawn ``chunk`` elements at a time.

    With JAX's partitionable threefry counters (the default), element ``i`` is
    ``threefry2x32(key, (0, i))``, its two words xor-ed, its top 23 bits as the mantissa of a
    float in ``[1, 2)``, minus 1. Drawn whole, XLA:CPU runs the hash as a loop whose carries are
    ``[n]`` words (several dense copies of the largest layer alive at once); drawn in chunks,
    only ``[chunk]`` ones. Other key implementations or counter schemes use
    ``jax.random.uniform`` itself (the same numbers, whole).
    """
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(key)) if typed else "threefry2x32"
    if not jax.config.jax_threefry_partitionable or "threefry" not in impl or n <= chunk:
        return jax.random.uniform(key, (n,))
    words = jax.random.key_data(key) if typed else key
    k1, k2 = words[0], words[1]

    def draw(i, out):
        # The last chunk ends at n (overlapping its predecessor: same indices, same numbers).
        start = jnp.minimum(i * chunk, n - chunk).astype(jnp.uint32)
        counts = start + jnp.arange(chunk, dtype=jnp.uint32)
        bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
        mantissa = ((bits1 ^ bits2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
        floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
        return jax.lax.dynamic_update_slice(out, floats, (start.astype(jnp.int32),))

    # A zero computed from the key: XLA may not create the [n] buffer before the key exists,
    # so a caller that sequences layers (rewire_compressed) holds one layer's buffer at a time.
    zero = k1.astype(jnp.float32) * jnp.float32(0.0)
    return jax.lax.fori_loop(0, -(-n // chunk), draw, jnp.broadcast_to(zero, (n,)))
