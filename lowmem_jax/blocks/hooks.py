"""Per-block hooks: what a technique does to each stack of blocks a
:class:`~lowmem_jax.blocks.scanned.ScannedBlocks` runs, without the stack knowing the technique.

A :class:`BlockHook` acts on the stacks traced while it is active (:func:`active`): the composer
activates each technique's ``ModelHooks.block`` around the step's loss
(:meth:`lowmem_jax.Plan.model_loss`), and a technique may activate one around a trace of its own
(compressed activations: around the forward pass it records). A stack asks every active hook:

* :meth:`BlockHook.run`: the stack's result computed another way (a pipeline over devices), or
  ``None``; the first active hook that answers runs the stack.
* :meth:`BlockHook.wrap_body`: the function each of the stack's loops iterates (one block, or a
  segment of blocks under a segmenting policy), wrapped (e.g. its residuals stored compressed);
  the first hook activated is the outermost.

After the loss is traced the composer calls :meth:`BlockHook.done` (e.g. to refuse a setting
that reached no stack).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BlockHook", "Stack", "active", "current"]


@dataclasses.dataclass(frozen=True)
class Stack:
    """A stack of ``length`` blocks being traced, as a hook sees it.

    Attributes:
      length: the blocks ``n``.
      runs: ``((policy, start, stop), ...)``: the runs of blocks under one remat policy (a
        :class:`~lowmem_jax.blocks.policy.RematSpec`; one run unless the stack has a per-block
        schedule).
      blockwise: some stacked parameter is held blockwise (densified per block in the loop).
      x: the stack's input ``[B, ...]``.
      context: the values every block reads (an encoder's output, masks).
      params: the stacked parameters' leaves, ``[n, ...]`` each (``None`` for a blockwise one).
      state: the blocks' other collections (BatchNorm's running averages), ``[n, ...]``.
      keys: the blocks' dropout keys ``[n, 2]`` (zeros without dropout).
      index: the blocks' indices ``[n]`` int32.
      dropout: the blocks draw dropout (``keys`` are real keys).
      scan: ``scan(h, xs, context, length, policy) -> (h, per-block outputs)``: ``length``
        blocks applied in order to ``h`` under ``policy`` (``xs``: ``(params, state, keys,
        index)`` of those blocks), as the stack runs them (with the active hooks' bodies).
    """

    length: int
    runs: tuple[tuple[Any, int, int], ...]
    blockwise: bool
    x: Any
    context: tuple
    params: list
    state: dict
    keys: Any
    index: Any
    dropout: bool
    scan: Callable[..., tuple[Any, Any]]


class BlockHook:
    """What a technique does to each stack (module docstring); the defaults do nothing."""

    def run(self, stack: Stack) -> tuple[Any, Any] | None:
        """``(output, new state)`` of the whole stack computed here, or ``None``: the stack
        runs as its policies say."""
        del stack
        return None

    def wrap_body(self, body: Callable[..., Any], closed: int, iterations: int) -> Callable:
        """``body(h, block_xs, *closed_values) -> (h, per-block outputs)`` (the function a loop
        of ``iterations`` iterates; ``closed`` values every iteration reads: the context, the
        blockwise weights), wrapped; ``body`` itself by default."""
        del closed, iterations
        return body

    def done(self) -> None:
        """Called once the traced loss returned (e.g. raises where no stack took the hook)."""


_ACTIVE: contextvars.ContextVar[tuple[BlockHook, ...]] = contextvars.ContextVar(
    "lowmem_block_hooks", default=()
)


def current() -> tuple[BlockHook, ...]:
    """The active hooks, the first activated first."""
    return _ACTIVE.get()


@contextlib.contextmanager
def active(*hooks: BlockHook) -> Iterator[None]:
    """Makes ``hooks`` active (after those already active) for what is traced inside."""
    token = _ACTIVE.set(_ACTIVE.get() + tuple(hooks))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
