"""The registry: every technique the library composes, in order
(:class:`~lowmem_jax.technique.Technique`).

The order is meaning: the precision cast comes before loss scaling, loss scaling before the
microbatch loop, sparse training inside the optimizer-state format; a plan's label, the
envelope's limits and the CLI's flag groups read in this order. Generic code (``Plan``'s
validation, the CLI flags, the envelopes, the planner's axes) iterates :data:`TECHNIQUES`;
no other module lists the techniques.
"""

from __future__ import annotations

from lowmem_jax.technique import Technique
from lowmem_jax.techniques import (
    factorize,
    input_dtype,
    loss_scale,
    microbatches,
    optimizer_state,
    precision,
    remat,
    shard,
    sparsity,
)

__all__ = ["TECHNIQUES", "technique"]

TECHNIQUES: tuple[Technique, ...] = (
    precision.TECHNIQUE,
    loss_scale.TECHNIQUE,
    microbatches.TECHNIQUE,
    remat.TECHNIQUE,
    sparsity.TECHNIQUE,
    optimizer_state.TECHNIQUE,
    factorize.TECHNIQUE,
    shard.TECHNIQUE,
    input_dtype.TECHNIQUE,
)


def technique(name: str) -> Technique:
    """The registered technique ``name``.

    Raises:
      ValueError: an unknown name, listing the registered ones.
    """
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise ValueError(f"Unknown technique {name!r}; registered: {[t.name for t in TECHNIQUES]}")
