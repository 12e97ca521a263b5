"""A batch split into ``k`` microbatches, laid out so that each data-parallel device keeps its
own examples (what gradient accumulation and a pipeline's microbatches both read)."""

from __future__ import annotations

import jax

from lowmem_jax.core.base import PyTree

__all__ = ["split_batch", "check_num_microbatches"]


def check_num_microbatches(num_microbatches: int) -> int:
    """Validates ``num_microbatches`` (an int >= 1) and returns it."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    return num_microbatches


def split_batch(batch: PyTree, num_microbatches: int, shards: int = 1) -> PyTree:
    """Reshapes every leaf ``[B, ...]`` to ``[k, B/k, ...]``.

    ``shards = 1``: contiguous slices. ``shards = N``: the batch is read as ``N`` contiguous
    shards (one per data-parallel device) and microbatch ``i`` is the ``i``-th slice of each
    (``[B] -> [N, k, B/(Nk)] -> [k, N, B/(Nk)] -> [k, B/k]``), so a device accumulates over
    its own examples and no example moves between devices.

    Raises:
      ValueError: if a leaf has no batch axis or ``B`` is not divisible by ``k``; raised while
        tracing, before any computation is built.
    """
    k = check_num_microbatches(num_microbatches)
    parts = k * shards
    leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
    sizes = {jax.tree_util.keystr(p): (x.shape[0] if x.ndim else None) for p, x in leaves}
    for path, size in sizes.items():
        if size is None:
            raise ValueError(f"batch leaf {path or '<root>'} is a scalar; it has no batch axis")
        if size % parts:
            by = f"num_microbatches={k}" + (f" x shards={shards}" if shards > 1 else "")
            raise ValueError(
                f"batch size {size} (leaf {path or '<root>'}) is not divisible by {by}; "
                "choose a divisor of the batch size"
            )

    def split(x):
        b = x.shape[0] // parts
        x = x.reshape((shards, k, b) + x.shape[1:]).swapaxes(0, 1)
        return x.reshape((k, shards * b) + x.shape[3:])

    return jax.tree.map(split, batch)
