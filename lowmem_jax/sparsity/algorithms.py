"""One mask update (prune + regrow) of SET, RigL, SNFS and DSR on flat per-layer vectors.

Inputs per sparse layer ``l`` (flat, dense length ``n_l``): the weights after this step's update
``w_l``, the current mask ``m_l`` (bool), the dense gradient ``g_l`` (RigL) and the momentum
``v_l`` (SNFS). ``caps[l]`` bounds the non-zeros layer ``l`` may hold (``n_l`` for masked dense
storage, the capacity in compressed storage).

* **SET**: drop ``d_l = floor(f * |m_l|)`` active weights with the smallest ``|w|``, regrow
  ``d_l`` at uniformly random positions. Per-layer counts fixed.
* **RigL**: the same drop; regrow where ``|g|`` is largest. Per-layer counts fixed.
* **SNFS** (sparse momentum): the same drop (``f`` is the prune rate); the ``K = sum_l d_l``
  regrown weights are shared across layers in proportion to the mean ``|v|`` over each layer's
  active weights; regrow where ``|v|`` is largest. Only the total is fixed.
* **DSR**: drop every active weight with ``|w| < H`` (one global ``H``), ``K`` in all; regrow
  ``K`` across layers in proportion to each layer's surviving non-zeros, at uniformly random
  positions; then ``H <- H / 2`` if ``K > 1.1 N_p``, ``H <- 2 H`` if ``K < 0.9 N_p``.

Shares are capped by ``caps[l] - survivors_l`` and the excess goes to layers with room
(:func:`~lowmem_jax.sparsity.masks.allocate`), so the total is exact. Regrowth prefers positions
that were zero before this update; it falls back to just-pruned positions only in a layer with
too few zeros (density above ~1/2). New weights are 0 (the caller zeroes them and their slots).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowmem_jax.sparsity import masks as masks_lib

__all__ = ["Rewired", "rewire", "drop_fraction"]


class Rewired(NamedTuple):
    """The result of one update: per-layer flat bool ``masks`` and ``survivors`` (weights kept
    with their values and optimizer slots; ``masks & ~survivors`` are the regrown ones), and the
    DSR threshold (unchanged for the other algorithms) and ``num_pruned`` (int32)."""

    masks: list[jax.Array]
    survivors: list[jax.Array]
    threshold: jax.Array
    num_pruned: jax.Array


def drop_fraction(
    initial: float, step: jax.Array, end_step: int | None, anneal: str = "cosine"
) -> jax.Array:
    """``initial * (1 + cos(pi * min(t, T) / T)) / 2`` (cosine, ``T = end_step``) or constant."""
    if anneal == "constant" or end_step is None or end_step <= 0:
        return jnp.asarray(initial, jnp.float32)
    t = jnp.minimum(step, end_step).astype(jnp.float32)
    return jnp.float32(initial) * 0.5 * (1.0 + jnp.cos(jnp.pi * t / end_step))


def rewire(
    algorithm: str,
    *,
    weights: list[jax.Array],
    masks: list[jax.Array],
    caps: tuple[int, ...],
    rng: jax.Array,
    fraction: jax.Array,
    grads: list[jax.Array] | None = None,
    momentum: list[jax.Array] | None = None,
    threshold: jax.Array | None = None,
    target_pruned: int = 20_000,
) -> Rewired:
    """One prune-and-regrow update (module docstring). Pure and jit-safe.

    Raises:
      ValueError: unknown ``algorithm``, or a needed input (``grads`` for RigL, ``momentum``
        for SNFS, ``threshold`` for DSR) missing.
    """
    if algorithm not in ("set", "rigl", "snfs", "dsr"):
        raise ValueError(
            f"Unknown algorithm={algorithm!r} for rewire; allowed values: "
            "['set', 'rigl', 'snfs', 'dsr']"
        )
    if algorithm == "rigl" and grads is None:
        raise ValueError("algorithm='rigl' needs grads")
    if algorithm == "snfs" and momentum is None:
        raise ValueError("algorithm='snfs' needs momentum (an optimizer slot mirroring params)")
    if algorithm == "dsr" and threshold is None:
        raise ValueError("algorithm='dsr' needs threshold")
    mags = [jnp.abs(w).astype(jnp.float32) for w in weights]
    active = jnp.stack([m.sum(dtype=jnp.int32) for m in masks])
    if algorithm == "dsr":
        threshold = jnp.asarray(threshold, jnp.float32)
        dropped = [m & (a < threshold) for m, a in zip(masks, mags, strict=True)]
    else:
        counts = jnp.floor(fraction * active.astype(jnp.float32)).astype(jnp.int32)
        dropped = [
            masks_lib.smallest(m, a, counts[i])
            for i, (m, a) in enumerate(zip(masks, mags, strict=True))
        ]
    survivors = [m & ~d for m, d in zip(masks, dropped, strict=True)]
    num_dropped = jnp.stack([d.sum(dtype=jnp.int32) for d in dropped])
    kept = active - num_dropped
    total = num_dropped.sum()
    room = jnp.asarray(caps, jnp.int32) - kept
    if algorithm in ("set", "rigl"):
        grow = num_dropped
    elif algorithm == "snfs":
        mean_mom = jnp.stack(
            [
                jnp.where(m, jnp.abs(v), 0).sum() / jnp.maximum(m.sum(), 1)
                for m, v in zip(masks, momentum, strict=True)
            ]
        )
        grow = masks_lib.allocate(total, mean_mom, room)
    else:
        grow = masks_lib.allocate(total, kept.astype(jnp.float32), room)
    new_masks = []
    for i, (m, s) in enumerate(zip(masks, survivors, strict=True)):
        if algorithm == "rigl":
            score = jnp.abs(grads[i]).astype(jnp.float32)
        elif algorithm == "snfs":
            score = jnp.abs(momentum[i]).astype(jnp.float32)
        else:
            score = jax.random.uniform(jax.random.fold_in(rng, i), s.shape)
        grown = masks_lib.largest(~s, score, grow[i], prefer=~m)
        new_masks.append(s | grown)
    if algorithm == "dsr":
        k = total.astype(jnp.float32)
        threshold = jnp.where(
            k > 1.1 * target_pruned,
            threshold / 2,
            jnp.where(k < 0.9 * target_pruned, threshold * 2, threshold),
        )
    else:
        threshold = jnp.zeros((), jnp.float32) if threshold is None else threshold
    return Rewired(new_masks, survivors, jnp.asarray(threshold, jnp.float32), total)
