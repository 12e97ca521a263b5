"""Which leaves are sparse, their per-layer densities (uniform / ERK), budgets and capacities.

Everything here is static (Python ints and tuples computed from shapes), so it can be used while
tracing. A *layer* is one parameter leaf: a kernel stacked by :class:`~lowmem_jax.ScannedBlocks`
(``.../stack/conv1/kernel`` of shape ``[n_blocks, 3, 3, C, C]``) is ONE sparse tensor with one
budget shared by its blocks (ERK scores it by the per-block shape ``shape[1:]``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax

from lowmem_jax.codecs.state_format import is_quantized
from lowmem_jax.techniques.sparsity.config import SparseConfig
from lowmem_jax.techniques.sparsity.storage import LeafSpec

PyTree = Any

__all__ = [
    "LeafSpec",
    "Layout",
    "make_layout",
    "layer_densities",
    "path_names",
    "leaves_by_key",
    "replace_leaves",
]


class Layout(NamedTuple):
    """The static description of a parameter tree's sparse leaves (in tree order)."""

    leaves: tuple[LeafSpec, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.leaves)

    def by_key(self) -> dict[str, LeafSpec]:
        return {s.key: s for s in self.leaves}

    @property
    def total_budget(self) -> int:
        return sum(s.budget for s in self.leaves)


def path_names(path) -> tuple[str, ...]:
    """Key path -> names (``DictKey``/``GetAttrKey``/index entries as strings). The ``value``
    of a metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``) is the boxed leaf's own
    path: ``Dense_0/kernel``, not ``Dense_0/kernel/value``."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def leaves_by_key(tree: PyTree, keys) -> dict[str, jax.Array]:
    """``{key: leaf}`` for the leaves of ``tree`` whose ``"a/b/kernel"`` path is in ``keys``
    (a quantized slot counts as one leaf: its path names the parameter it mirrors)."""
    keys = set(keys)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]:
        k = "/".join(path_names(path))
        if k in keys:
            out[k] = leaf
    return out


def replace_leaves(tree: PyTree, new: dict[str, jax.Array]) -> PyTree:
    """``tree`` with the leaves whose path is a key of ``new`` replaced by its values."""

    def fn(path, leaf):
        return new.get("/".join(path_names(path)), leaf)

    return jax.tree_util.tree_map_with_path(fn, tree, is_leaf=is_quantized)


def _erk_shape(names: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:] if "stack" in names and len(shape) >= 3 else shape


def layer_densities(
    shapes: list[tuple[int, ...]],
    density: float,
    distribution: str,
    power: float = 1.0,
    sizes: list[int] | None = None,
) -> list[float]:
    """Per-layer densities whose size-weighted mean is ``density``.

    ``shapes`` give the ERK scores; ``sizes`` the element counts (default ``prod(shape)``; a
    stacked leaf passes its per-block shape and its full size).

    ``uniform``: every layer ``density``. ``erk``: layer ``l`` gets ``eps * s_l`` with
    ``s_l = (sum(dims_l) / prod(dims_l)) ** power``, ``eps`` solving
    ``sum_l eps * s_l * n_l = density * sum_l n_l``; a layer whose density would exceed 1 is made
    dense and ``eps`` re-solved over the rest (RigL's reference algorithm).

    Raises:
      ValueError: for an unknown ``distribution`` or ``density`` outside ``(0, 1]``.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if distribution == "uniform":
        return [float(density)] * len(shapes)
    if distribution != "erk":
        raise ValueError(
            f"Unknown distribution={distribution!r}; allowed values: ['uniform', 'erk']"
        )
    sizes = [math.prod(s) for s in shapes] if sizes is None else list(sizes)
    raw = [(sum(s) / math.prod(s)) ** power for s in shapes]
    dense: set[int] = set()
    while True:
        free = [i for i in range(len(shapes)) if i not in dense]
        if not free:
            return [1.0] * len(shapes)
        budget = density * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in free)
        over = [i for i in free if eps * raw[i] > 1.0]
        if not over:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense.add(max(over, key=lambda i: raw[i]))


def make_layout(params: PyTree, config: SparseConfig) -> Layout:
    """The sparse leaves of ``params`` (arrays or ``ShapeDtypeStruct``) under ``config``."""
    picked = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        shape = tuple(int(d) for d in leaf.shape)
        if config.is_sparse(names, shape):
            picked.append((names, shape))
    dens = layer_densities(
        [_erk_shape(n, s) for n, s in picked],
        config.density,
        config.distribution,
        config.erk_power,
        sizes=[math.prod(s) for _, s in picked],
    )
    leaves = []
    for (names, shape), d in zip(picked, dens, strict=True):
        size = math.prod(shape)
        budget = min(size, max(1, round(d * size)))
        capacity = min(size, math.ceil(config.capacity * budget))
        leaves.append(LeafSpec("/".join(names), shape, size, budget, capacity))
    return Layout(tuple(leaves))
