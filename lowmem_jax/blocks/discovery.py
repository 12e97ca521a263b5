"""Which submodule classes are a model's blocks: the units remat checkpoints one by one when the
user names none (``Plan(remat=...)`` with ``remat_blocks=()``; :mod:`lowmem_jax.blocks.policy`).

A block class runs more than once and calls other modules (a layer such as ``Dense`` calls none);
of nested ones, the outermost (a block's attention is not a block of its own). Linen: read from
the module calls of one traced forward (``nn.intercept_methods``, ``jax.eval_shape``: nothing
runs). NNX: read from the graph (classes with more than one instance that hold other modules,
and ``nnx.vmap`` stacks).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from lowmem_jax.core import linen_wrap

__all__ = ["AUTO_BLOCKS", "repeated_blocks", "linen_blocks", "nnx_blocks", "no_blocks_warning"]

#: ``remat_module``'s ``blocks`` that finds the model's repeated blocks itself.
AUTO_BLOCKS = "auto"


def repeated_blocks(calls: Sequence[tuple[str, tuple[str, ...], bool]]) -> tuple[str, ...]:
    """The block classes of a model, from the module calls of one forward pass: ``(class name,
    the classes of the calls it ran inside, outermost first, whether it called other modules)``
    in order, the model's own call first. A block class calls other modules (a layer such as
    ``Dense`` does not) and runs more than once; of nested ones, the outermost (a block's
    attention is not a block of its own)."""
    counts = collections.Counter(name for name, parents, _ in calls if parents)
    composite = {name for name, parents, calls_others in calls if parents and calls_others}
    candidates = {n for n, k in counts.items() if k > 1 and n in composite}
    outermost = {
        name
        for name, parents, _ in calls
        if name in candidates and not set(parents) & (candidates - {name})
    }
    return tuple(sorted(outermost))


_DISCOVERED: dict[Any, tuple[str, ...]] = {}


def linen_blocks(cls: type, fields: dict, rng_names, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """:func:`repeated_blocks` of ``cls(**fields)`` called on ``args`` (its ``init``, traced by
    ``jax.eval_shape``: nothing runs); kept per class and argument shapes."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    try:
        key = (cls, tree, tuple(
            (x.shape, str(x.dtype)) if hasattr(x, "shape") else x for x in leaves
        ), tuple(sorted(fields.items())))  # fmt: skip
        hash(key)
    except TypeError:  # an unhashable field or argument: trace each time
        key = None
    if key is not None and key in _DISCOVERED:
        return _DISCOVERED[key]
    calls: list[list] = []
    stack: list[list] = []

    def recorder(next_fun, a, k, context):
        if context.method_name != "__call__":
            return next_fun(*a, **k)
        entry = [type(context.module).__name__, tuple(e[0] for e in stack), False]
        if stack:
            stack[-1][2] = True
        calls.append(entry)
        stack.append(entry)
        try:
            return next_fun(*a, **k)
        finally:
            stack.pop()

    linen_wrap.traced_init(cls, fields, rng_names, args, kwargs, recorder)
    found = repeated_blocks([tuple(c) for c in calls])
    if key is not None:
        _DISCOVERED[key] = found
    return found


def nnx_blocks(module: nnx.Module) -> tuple[str, ...]:
    """The block classes of an NNX model, from its graph: classes with more than one instance
    that hold other modules, and modules made by ``nnx.vmap`` (every parameter has a leading
    layer axis of the same size, biases included), outermost first (as :func:`repeated_blocks`)."""
    nodes = [(path, s) for path, s in nnx.iter_graph(module) if path and isinstance(s, nnx.Module)]
    parents = {path[:i] for path, _ in nodes for i in range(1, len(path))}
    composite = [(path, s) for path, s in nodes if path in parents]
    counts = collections.Counter(type(s).__name__ for _, s in composite)

    def stacked(s) -> bool:
        shapes = [x.shape for x in jax.tree.leaves(nnx.state(s, nnx.Param))]
        return bool(shapes) and all(len(x) >= 2 and x[0] == shapes[0][0] > 1 for x in shapes)

    blocks = [(path, type(s).__name__) for path, s in composite
              if counts[type(s).__name__] > 1 or stacked(s)]  # fmt: skip
    candidates = {name for _, name in blocks}
    block_paths = {path for path, _ in blocks}
    inside = {
        name for path, name in blocks if any(path[:i] in block_paths for i in range(len(path)))
    }
    return tuple(sorted(candidates - inside))


def no_blocks_warning(name: str, remat: str) -> str:
    return (
        f"remat={remat!r} on {name}, which has no `remat` attribute and no repeated block (a "
        "submodule class that runs more than once and calls other modules), checkpoints its "
        "whole forward at once, which lowers no peak memory: name its block classes in "
        "Plan(remat_blocks=(...))"
    )
