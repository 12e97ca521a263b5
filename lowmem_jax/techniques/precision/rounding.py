"""Stochastic rounding of bfloat16 parameters (``param_rounding="stochastic"``): a named
departure from the report's float32 master weights.

With parameters stored in bfloat16 (``precision="bf16"``: no master copy), the update
``p + u`` is computed in float32 and rounded back to bfloat16. Rounded to the nearest, an update
smaller than half the spacing of bfloat16 values at ``p`` (``2^-9 |p|``) is lost every step,
however often it comes: training stalls once updates are small against the weights. Rounded
stochastically, ``p + u`` becomes one of its two bfloat16 neighbours with probabilities that
make the expectation exact,

    E[round(x)] = x,    P(round up) = (x - lo) / (hi - lo),

so small updates accumulate in expectation (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting
BFloat16 Training"). Here ``x``'s float32 bit pattern gets 16 uniform random bits added below
bfloat16's last mantissa bit before those 16 bits are dropped: the magnitude is rounded up
with that probability (the sign is kept), a carry into the exponent is the next binade.
Non-finite values are kept as they are.

The 16 bits of an element are a hash of its position and a 32-bit seed per leaf and step
(murmur3's finalizer over ``position * golden + seed``; the seed drawn from a key the step
derives from its own, so a run is reproducible), not a random-number generator's output: the
hash is elementwise, so XLA fuses the update, the noise and the rounding into one pass over
the leaf with no parameter-sized buffer of random bits or float32 sums (``jax.random.bits``
there cost 7.6 bytes per parameter of temp on llama-1b, XLA:CPU). Positions ``2^32`` apart in
one leaf share their bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.core.base import PyTree

__all__ = ["stochastic_round_bf16", "apply_updates_stochastically"]

#: Folded into the step's key for the rounding's stream (apart from dropout's).
_STREAM = 0x5352


def stochastic_round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """``x`` (any float dtype) rounded stochastically to bfloat16 (module docstring), same
    shape."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    seed = jax.random.bits(key, (), jnp.uint32)
    noise = _hash(_positions(x.shape) * jnp.uint32(0x9E3779B1) + seed) >> 16
    kept = (bits + noise) & jnp.uint32(0xFFFF0000)
    rounded = jax.lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)  # exact
    return jnp.where(jnp.isfinite(x), rounded, x.astype(jnp.bfloat16))


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position, ``uint32`` (modulo ``2^32``), as iotas XLA fuses."""
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return position


def _hash(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def apply_updates_stochastically(params: PyTree, updates: PyTree, rng: jax.Array) -> PyTree:
    """``optax.apply_updates(params, updates)`` with each bfloat16 leaf's ``p + u`` computed in
    float32 and rounded stochastically (a key per leaf from ``rng``); other leaves as optax
    adds them."""
    leaves, treedef = jax.tree.flatten(params)
    ups = treedef.flatten_up_to(updates)
    key = jax.random.fold_in(rng, _STREAM)
    out = []
    for i, (p, u) in enumerate(zip(leaves, ups, strict=True)):
        if p is None or u is None or jnp.dtype(p.dtype) != jnp.bfloat16:
            out.append(optax.apply_updates(p, u) if p is not None and u is not None else p)
            continue
        total = p.astype(jnp.float32) + u.astype(jnp.float32)
        out.append(stochastic_round_bf16(total, jax.random.fold_in(key, i)))
    return jax.tree.unflatten(treedef, out)
