"""GPipe pipeline parallelism over a stack of identical blocks (Huang et al. 2019, "GPipe").

A stack of ``n`` blocks (:class:`lowmem_jax.ScannedBlocks`, variables ``[n, ...]``) is split
over the ``S`` devices of a mesh axis ``"stage"`` (:data:`STAGE`): device ``s`` holds blocks
``[s n/S, (s+1) n/S)`` and their optimizer state. The stack's input batch ``[B, ...]`` is split
into ``M`` microbatches of ``B / M`` examples, and at clock tick ``t = 0 .. M + S - 2`` stage
``s`` runs its blocks on microbatch ``t - s`` (when ``0 <= t - s < M``) and sends the result to
stage ``s + 1`` (``lax.ppermute``); the last stage's results are the stack's output, broadcast
to every device (``psum`` of the last stage's). The backward pass is the transpose of this
program (JAX's autodiff of ``ppermute`` sends the cotangents back, stage ``s + 1`` to ``s``):
GPipe's schedule, all forward passes then all backward passes, not 1F1B.

The stages idle ``(S - 1) / (M + S - 1)`` of the ticks (:func:`bubble_fraction`): the schedule
runs ``M + S - 1`` ticks of which each stage computes in ``M``; in the idle ticks it computes on
one of the stack's input microbatches and discards the result (one SPMD program, so every
device runs every tick).

As in GPipe, BatchNorm inside a pipelined stack normalises each microbatch by its own
statistics, and its running averages are updated microbatch by microbatch, in order (the same
as running the stack on the microbatches one after another on one device). Dropout draws from
the block's key folded with the microbatch's index.

The default microbatch count is the largest divisor of the stack's examples at most ``4 S``
(GPipe found the bubble negligible from ``M >= 4 S``; :func:`microbatch_count`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from lowmem_jax.blocks.hooks import BlockHook, Stack
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.batches import split_batch

__all__ = [
    "STAGE",
    "Pipeline",
    "microbatch_count",
    "bubble_fraction",
    "PipelinedStacks",
    "run",
]

PyTree = Any

#: The mesh axis the stages of a pipeline are laid out along.
STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline's settings.

    Attributes:
      stages: ``S >= 2``, the devices of the ``"stage"`` axis a stack's blocks are split over.
      microbatches: ``M``, the microbatches a stack's batch is split into; ``0``:
        :func:`microbatch_count`'s default.
      mesh: the device mesh: a ``"stage"`` axis of ``S`` devices, and a ``"data"`` axis
        where the batch is split over data-parallel devices too.
    """

    stages: int
    microbatches: int
    mesh: Mesh


def microbatch_count(examples: int, stages: int, requested: int = 0) -> int:
    """``M`` for a stack's batch of ``examples``: ``requested``, or where that is ``0`` the
    largest divisor of ``examples`` at most ``4 * stages``.

    Raises:
      ValueError: ``requested`` does not divide ``examples``.
    """
    if requested:
        if examples % requested:
            raise ValueError(
                f"pipeline_microbatches={requested} does not divide the {examples} examples a "
                "pipelined stack receives (the batch, or one microbatch of it, on each data "
                "device)"
            )
        return requested
    return max(m for m in range(1, min(examples, 4 * stages) + 1) if examples % m == 0)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of clock ticks a stage idles: ``(S - 1) / (M + S - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


class PipelinedStacks(BlockHook):
    """The per-block hook (:mod:`lowmem_jax.blocks.hooks`) that runs each stack whose length
    divides by the stages as a pipeline of ``pipeline`` (:func:`run`), one per trace of the
    step's loss; :meth:`done` refuses the plan where no stack could be.

    Attributes:
      pipeline: the stages, microbatches and mesh.
      stacks: ``(length, pipelined)`` of each stack traced.
    """

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.stacks: list[tuple[int, bool]] = []

    def run(self, stack: Stack) -> tuple[jax.Array, PyTree] | None:
        stages = self.pipeline.stages
        split = stack.length % stages == 0
        self.stacks.append((stack.length, split))
        if not split:
            return None
        if len(stack.runs) > 1 or stack.blockwise:
            raise ValueError(
                f"pipeline={stages} runs a stack under one remat policy with its weights "
                "stored dense; got "
                + ("a per-block remat schedule" if len(stack.runs) > 1 else "blockwise weights")
            )
        spec, length = stack.runs[0][0], stack.length // stages

        def stage(blocks, state, h, context, microbatch):
            params, keys, index = blocks
            if stack.dropout:  # each microbatch its own draws
                keys = jax.vmap(lambda key: jax.random.fold_in(key, microbatch))(keys)
            return stack.scan(h, (params, state, keys, index), context, length, spec)

        blocks = (stack.params, stack.keys, stack.index)
        return run(stage, blocks, stack.state, stack.x, stack.context, self.pipeline)

    def done(self) -> None:
        if not any(split for _, split in self.stacks):
            lengths = [length for length, _ in self.stacks]
            stages = sorted({s for n in lengths for s in range(2, n + 1) if n % s == 0})
            raise ValueError(
                f"pipeline={self.pipeline.stages} divides none of the model's block stacks "
                + (f"(lengths {lengths}; stage counts that divide one: {stages or 'none'})"
                   if lengths else "(it has no ScannedBlocks stack)")
            )  # fmt: skip


def run(
    stage_fn: Callable[..., tuple[jax.Array, PyTree]],
    blocks: PyTree,
    state: PyTree,
    x: jax.Array,
    context: tuple,
    pipeline: Pipeline,
) -> tuple[jax.Array, PyTree]:
    """A stack's blocks applied to ``x`` as a GPipe pipeline (module docstring).

    Args:
      stage_fn: ``stage_fn(blocks, state, h, context, microbatch) -> (h, state)``: one
        stage's ``n / S`` blocks applied in order to a microbatch ``h [B / M, ...]`` (its
        ``context`` the microbatch's); ``microbatch`` its index (int32 scalar).
      blocks: read-only per-block values, every leaf ``[n, ...]`` (parameters, dropout keys).
      state: per-block values the blocks update (BatchNorm's running averages), ``[n, ...]``.
      x: the stack's input ``[B, ...]``.
      context: values every block reads; a leaf with the batch's leading axis ``B`` is split
        with it, any other is the same for every microbatch.
      pipeline: the stages, microbatches and mesh.

    Returns:
      ``(y [B, ...], state)``: the stack's output, the same on every device, and the updated
      state (``[n, ...]``, laid out over the stages).
    """
    stages = pipeline.stages
    examples = x.shape[0]
    # Over a data axis of D devices microbatch i takes the i-th slice of each device's examples
    # (as the microbatches technique takes them), so no example moves between data devices.
    shards = sharding_lib.shards_in_batch(pipeline.mesh)
    count = microbatch_count(examples // shards, stages, pipeline.microbatches)

    def split(a):
        return split_batch(a, count, shards)

    def batched(a) -> bool:
        return getattr(a, "ndim", 0) >= 1 and a.shape[0] == examples

    xs = split(x)
    in_batch = jax.tree.map(batched, context)
    context = jax.tree.map(lambda a: split(a) if batched(a) else a, context)

    def local(blocks, state, xs, context):
        s = lax.axis_index(STAGE)

        def tick(carry, t):
            h, outs, state = carry
            i = t - s
            index = jnp.clip(i, 0, count - 1)
            valid = (i >= 0) & (i < count)
            # Stage 0 reads the batch; in its idle ticks a stage computes on a microbatch of the
            # stack's input too (not on zeros, where a block's derivative may be infinite: the
            # discarded result's zero cotangent times it would be NaN).
            h = jnp.where((s == 0) | ~valid, _at(xs, index), h)
            ctx = jax.tree.map(lambda a, b: _at(a, index) if b else a, context, in_batch)
            out, new_state = stage_fn(blocks, state, h, ctx, index)
            state = jax.tree.map(lambda new, old: jnp.where(valid, new, old), new_state, state)
            write = valid & (s == stages - 1)
            outs = lax.dynamic_update_index_in_dim(
                outs, jnp.where(write, out, _at(outs, index)), index, 0
            )
            h = lax.ppermute(out, STAGE, [(j, j + 1) for j in range(stages - 1)])
            return (h, outs, state), None

        carry = (xs[0], jnp.zeros_like(xs), state)
        (_, outs, state), _ = lax.scan(tick, carry, jnp.arange(count + stages - 1))
        return lax.psum(jnp.where(s == stages - 1, outs, 0), STAGE), state

    stage_spec = PartitionSpec(STAGE)
    outs, state = jax.shard_map(
        local,
        mesh=pipeline.mesh,
        in_specs=(stage_spec, stage_spec, PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), stage_spec),
        axis_names={STAGE},  # a data axis stays XLA's to partition
        # Without the checks of what varies over the stages, any block's code runs as it is
        # (a loop whose carry starts as a constant would need casting); the transpose then
        # sums the replicated inputs' cotangents over the stages, and shares the output's.
        check_vma=False,
    )(blocks, state, xs, context)
    b = examples // (count * shards)  # [M, D b] back to [B]: device d's examples contiguous
    outs = outs.reshape((count, shards, b) + x.shape[1:]).swapaxes(0, 1)
    return outs.reshape(x.shape), state


def _at(a: jax.Array, index: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
