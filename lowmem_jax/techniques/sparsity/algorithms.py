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
(:func:`~lowmem_jax.techniques.sparsity.masks.allocate`), so the total is exact. Regrowth ranks
every position not kept (``regrow_pool="not_kept"``, RigL's Algorithm 1: a just-pruned position may
come back), or prefers positions that were zero before this update and falls back to
just-pruned ones only in a layer with too few zeros (``"zeros_first"``). New weights are 0 (the
caller zeroes them and their slots).

:func:`rewire` takes dense flat layers (masked storage); :func:`rewire_compressed` takes the
compressed ``[capacity]`` values and indices and selects the same weights with per-layer,
mostly ``[capacity]``-sized temporaries (compressed storage).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowmem_jax.techniques.sparsity import masks as masks_lib

__all__ = ["Rewiring", "Rewired", "RewiredSlots", "rewire", "rewire_compressed", "drop_fraction"]


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


class Rewiring(NamedTuple):
    """One update's algorithm and inputs, whatever the layers' storage (:func:`rewire`,
    :func:`rewire_compressed`).

    Attributes:
      algorithm: ``set``, ``rigl``, ``snfs`` or ``dsr``.
      rng: the random positions' key (SET, DSR).
      fraction: the drop fraction ``f`` (SET, RigL, SNFS).
      grads: RigL's dense flat gradients per layer.
      momentum: SNFS's momentum per layer, laid out as the layers are.
      threshold: DSR's ``H``.
      target_pruned: DSR's ``N_p``.
      regrow_pool: ``not_kept`` or ``zeros_first`` (module docstring).
    """

    algorithm: str
    rng: jax.Array | None
    fraction: jax.Array | float
    grads: list[jax.Array] | None = None
    momentum: list[jax.Array] | None = None
    threshold: jax.Array | None = None
    target_pruned: int = 20_000
    regrow_pool: str = "not_kept"

    def check(self) -> None:
        """Raises ``ValueError``: unknown ``algorithm`` or ``regrow_pool``, or a needed input
        (``grads`` for RigL, ``momentum`` for SNFS, ``threshold`` for DSR) missing."""
        if self.regrow_pool not in ("not_kept", "zeros_first"):
            raise ValueError(
                f"Unknown regrow_pool={self.regrow_pool!r} for rewire; allowed values: "
                "['not_kept', 'zeros_first']"
            )
        if self.algorithm not in ("set", "rigl", "snfs", "dsr"):
            raise ValueError(
                f"Unknown algorithm={self.algorithm!r} for rewire; allowed values: "
                "['set', 'rigl', 'snfs', 'dsr']"
            )
        for algorithm, field, what in (
            ("rigl", "grads", ""),
            ("snfs", "momentum", " (an optimizer slot mirroring params)"),
            ("dsr", "threshold", ""),
        ):
            if self.algorithm == algorithm and getattr(self, field) is None:
                raise ValueError(f"algorithm={algorithm!r} needs {field}{what}")


def rewire(
    how: Rewiring,
    *,
    weights: list[jax.Array],
    masks: list[jax.Array],
    caps: tuple[int, ...],
) -> Rewired:
    """One prune-and-regrow update (module docstring) of dense flat layers. Pure and jit-safe.

    Raises:
      ValueError: see :meth:`Rewiring.check`.
    """
    how.check()
    algorithm, rng, fraction, grads, momentum, threshold, target_pruned, regrow_pool = how
    zeros_first = regrow_pool == "zeros_first"
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
    mean_mom = None
    if algorithm == "snfs":
        mean_mom = jnp.stack([_mean_abs(m, v) for m, v in zip(masks, momentum, strict=True)])
    grow = _grow_counts(algorithm, num_dropped, kept, caps, mean_mom)
    new_masks = []
    for i, (m, s) in enumerate(zip(masks, survivors, strict=True)):
        if algorithm == "rigl":
            score = jnp.abs(grads[i]).astype(jnp.float32)
        elif algorithm == "snfs":
            score = jnp.abs(momentum[i]).astype(jnp.float32)
        else:
            score = masks_lib.uniform_scores(jax.random.fold_in(rng, i), s.shape[0])
        grown = masks_lib.largest(~s, score, grow[i], prefer=~m if zeros_first else None)
        new_masks.append(s | grown)
    threshold = _next_threshold(algorithm, threshold, total, target_pruned)
    return Rewired(new_masks, survivors, threshold, total)


def _mean_abs(mask: jax.Array, v: jax.Array) -> jax.Array:
    """SNFS's layer weight: mean ``|v|`` over the (dense, flat) ``mask``."""
    return jnp.where(mask, jnp.abs(v), 0).sum() / jnp.maximum(mask.sum(), 1)


def _grow_counts(algorithm, num_dropped, kept, caps, mean_mom) -> jax.Array:
    """int32 ``[L]`` regrowth per layer (module docstring)."""
    if algorithm in ("set", "rigl"):
        return num_dropped
    room = jnp.asarray(caps, jnp.int32) - kept
    weights = mean_mom if algorithm == "snfs" else kept.astype(jnp.float32)
    return masks_lib.allocate(num_dropped.sum(), weights, room)


def _next_threshold(algorithm, threshold, total, target_pruned) -> jax.Array:
    """DSR's threshold after pruning ``total`` (unchanged, or 0 when absent, otherwise)."""
    if algorithm != "dsr":
        threshold = jnp.zeros(()) if threshold is None else threshold
        return jnp.asarray(threshold, jnp.float32)
    threshold = jnp.asarray(threshold, jnp.float32)
    k = total.astype(jnp.float32)
    return jnp.where(
        k > 1.1 * target_pruned,
        threshold / 2,
        jnp.where(k < 0.9 * target_pruned, threshold * 2, threshold),
    )


class RewiredSlots(NamedTuple):
    """The result of :func:`rewire_compressed`, per compressed layer: ``survivors`` bool
    ``[capacity]`` (live slots kept with their values and optimizer slots), ``grown`` int32
    ``[capacity]``, the flat dense positions of the regrown weights, ascending, padded with the
    layer size, and ``indices`` int32 ``[capacity]``, the new slots (a survivor keeps its slot,
    the regrown weights fill the freed ones in order, the layer size marks an unused one); the
    DSR ``threshold`` and ``num_pruned`` as in :class:`Rewired`."""

    survivors: list[jax.Array]
    grown: list[jax.Array]
    indices: list[jax.Array]
    threshold: jax.Array
    num_pruned: jax.Array


def rewire_compressed(
    how: Rewiring,
    *,
    values: list[jax.Array],
    indices: list[jax.Array],
    sizes: tuple[int, ...],
) -> RewiredSlots:
    """:func:`rewire` on compressed layers, selecting the same weights, in small memory.

    Layer ``j`` holds ``values[j]`` (the weights after this step's update) at the flat dense
    positions ``indices[j]`` (int32 ``[capacity_j]``; ``sizes[j]`` marks an unused slot); its
    capacity is its cap. ``grads`` are dense and flat (RigL), ``momentum`` compressed like
    ``values`` (SNFS).

    Two passes. The first counts each layer's pruned weights (scalars only: DSR's threshold
    compare summed; the others' ``floor(f * active)``), which fixes the regrowth counts. The
    second runs each layer whole: pruning on the ``[capacity]`` slots (DSR: the compare again;
    the others: one ``[capacity]`` sort keyed by ``(|w|, position)``, :func:`~.masks.smallest`'s
    order), regrowth on the dense positions (an int8 ``[n]`` map of the survivors and old
    non-zeros, and the scores: RigL's dense gradient, SNFS's momentum densified; DSR's and
    SET's random ones, the numbers :func:`rewire` draws, drawn per chunk where the chunk is
    ranked, :func:`~.masks.uniform_part`, so no ``[n]`` of them exists; ranked by
    :func:`~.masks.grow_score` chunk by chunk in :func:`~.masks.top_positions`), and the new
    slots (survivors keep theirs, regrown weights
    fill the freed ones in order). Each layer's pass is one ``lax.cond`` whose predicate reads
    the previous layer's new slots: a conditional runs as one unit once its predicate is known,
    so one layer's temporaries are alive at a time (an ``optimization_barrier`` chain does not
    order them: XLA:CPU drops barriers before it schedules).

    Raises:
      ValueError: as :func:`rewire`.
    """
    how.check()
    algorithm, rng, fraction, grads, momentum, threshold, target_pruned, regrow_pool = how
    zeros_first = regrow_pool == "zeros_first"
    caps = tuple(int(v.shape[0]) for v in values)
    active = jnp.stack([(i < n).sum(dtype=jnp.int32) for i, n in zip(indices, sizes, strict=True)])
    if algorithm == "dsr":
        threshold = jnp.asarray(threshold, jnp.float32)
        num_dropped = jnp.stack(
            [
                ((i < n) & (jnp.abs(v).astype(jnp.float32) < threshold)).sum(dtype=jnp.int32)
                for v, i, n in zip(values, indices, sizes, strict=True)
            ]
        )
    else:  # smallest_slots drops exactly this many (count <= active)
        num_dropped = jnp.floor(fraction * active.astype(jnp.float32)).astype(jnp.int32)
    kept = active - num_dropped
    total = num_dropped.sum()

    def dense(j, vec, idx):
        return jnp.zeros((sizes[j],), vec.dtype).at[idx].set(vec, mode="drop")

    mean_mom = None
    if algorithm == "snfs":
        # :func:`rewire`'s dense sum of ``where(m, |v|, 0)`` (the same [n] array, so the same
        # float sum and allocation in both storages); the count is exact from the slots.
        means = []
        for j in range(len(values)):
            mom, idx = momentum[j], indices[j]
            if means:  # layer j starts once layer j - 1 is done
                means[-1], (mom, idx) = jax.lax.optimization_barrier((means[-1], (mom, idx)))
            on = idx < sizes[j]
            total_abs = dense(j, jnp.where(on, jnp.abs(mom), 0), idx).sum()
            means.append(total_abs / jnp.maximum(on.sum(), 1))
        mean_mom = jnp.stack(means)
    grow = _grow_counts(algorithm, num_dropped, kept, caps, mean_mom)

    def layer(j, operands):
        """Layer ``j``'s survivors (bool ``[capacity]``), regrown positions and new slots."""
        v, idx, source, count, grow_j = operands
        n = sizes[j]
        live = idx < n
        if algorithm == "dsr":
            dropped = live & (jnp.abs(v).astype(jnp.float32) < threshold)
        else:
            dropped = masks_lib.smallest_slots(live, jnp.abs(v).astype(jnp.float32), idx, count)
        surv = live & ~dropped
        # 0: zero before this update (preferred), 1: just pruned, 2: survivor.
        code = (
            jnp.zeros((n,), jnp.int8)
            .at[idx]
            .set(jnp.where(surv, 2, 1).astype(jnp.int8), mode="drop")
        )
        # Random regrowth draws each chunk's scores where the chunk is ranked (no [n] scores).
        score_part = masks_lib.uniform_part(source, n) if algorithm in ("dsr", "set") else None
        if score_part is None:
            if algorithm == "rigl":
                score = source
            elif algorithm == "snfs":
                score = dense(j, source, idx)
            else:
                score = masks_lib.uniform_scores(source, n)

            def score_part(start, size, score=score):
                return masks_lib.slicer(start, size)(score)

        # Regrowth's key (grow_score: eligible where code < 2, preferred where 0) is made chunk
        # by chunk inside the selection's loops: no [n] key or mask beside the scores and `code`.
        def scale_part(start, size, largest):
            on = masks_lib.slicer(start, size)(code) < 2
            return jnp.maximum(largest, masks_lib.grow_scale(on, score_part(start, size)))

        scale = masks_lib.over_chunks(n, scale_part, jnp.float32(1e-30))

        def chunk(start, size):
            c = masks_lib.slicer(start, size)(code)
            prefer = (c == 0) if zeros_first else None
            return c < 2, masks_lib.grow_key(score_part(start, size), scale, prefer)

        grown = masks_lib.top_positions(chunk, n, grow_j, caps[j])
        # Freed slot number r (in slot order) takes the r-th regrown position (or n: unused).
        # A cumulative sum and a gather, computed from the data: no [capacity] constant that
        # XLA would build first and hold while the [n] arrays are alive (jnp.nonzero's).
        rank = jnp.cumsum(~surv, dtype=jnp.int32) - 1
        slots = jnp.where(surv, idx, grown.at[rank].get(mode="fill", fill_value=n))
        return surv, grown, slots

    survivors, grown, slots = [], [], []
    for j in range(len(values)):
        if algorithm == "rigl":
            source = grads[j]
        elif algorithm == "snfs":
            source = momentum[j]
        else:
            source = jax.random.fold_in(rng, j)
        operands = (values[j], indices[j], source, num_dropped[j], grow[j])
        if not slots:
            out = layer(j, operands)
        else:  # the predicate (always true) reads layer j - 1's slots: layer j runs after it
            ready = slots[-1][0] >= 0

            def skip(operands, j=j):
                idx = operands[1]
                return idx < sizes[j], jnp.full((caps[j],), sizes[j], jnp.int32), idx

            out = jax.lax.cond(ready, functools.partial(layer, j), skip, operands)
        survivors.append(out[0])
        grown.append(out[1])
        slots.append(out[2])
    threshold = _next_threshold(algorithm, threshold, total, target_pruned)
    return RewiredSlots(survivors, grown, slots, threshold, total)
