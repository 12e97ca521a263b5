"""Stacks of identical blocks run with ``lax.scan``, each block under its remat policy.

:class:`ScannedBlocks` stores its blocks' variables with a leading ``[n]`` axis (under
:data:`STACK`) and applies them in sequence; the policies are :mod:`lowmem_jax.blocks.policy`'s (a
name for the whole stack, or one per block: a stack's slice of a ``blocks:`` schedule, scanned run
by run). Segmenting policies (``every:K``, ``sqrt``) nest two scans over ``[n // K, K]``, so the
parameter layout does not depend on the policy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowmem_jax.blocks import hooks as block_hooks
from lowmem_jax.blocks.policy import RematSpec, parse_policy
from lowmem_jax.core.base import BlockwiseLeaf

__all__ = [
    "ScannedBlocks",
    "STACK",
    "in_stack",
    "straight_line",
    "with_layout",
    "at_use",
]


#: The variable name under which :class:`ScannedBlocks` stores its blocks' stacked variables.
STACK = "stack"


def in_stack(names: Sequence[str]) -> bool:
    """Whether the parameter at path ``names`` belongs to a :class:`ScannedBlocks` stack (its
    leading axis indexes the blocks)."""
    return STACK in names


def at_use(layout: Callable[[Any], Any], param: Any, after: Any = None) -> tuple[Any, Any]:
    """(``param`` through ``layout``, ``after``), the layout applied not before ``after`` exists
    (a model's ``outer_param_layout``): an optimization barrier joins the two, so XLA cannot
    schedule a move to the device at the step's start, where the copy would stay on it through
    the passes before its use. Use the ``after`` returned: the barrier's differentiation would
    otherwise materialise a zero cotangent for it."""
    param, after = jax.lax.optimization_barrier((param, after))
    return layout(param), after


def with_layout(module: type[nn.Module], layout: Callable[[Any], Any] | None, initializing: bool):
    """``module`` (a Linen class) whose parameters pass through ``layout`` where it runs (a
    model's ``outer_param_layout``, for its layers outside the stacks): ``nn.map_variables``, so
    the stored parameters and their paths are unchanged; ``module`` itself when ``layout`` is
    None or while initialising (``initializing``: the caller's ``self.is_initializing()``;
    mapped there, the stored parameters would be the laid-out ones, a cast's rounding kept)."""
    if layout is None or initializing:
        return module
    return nn.map_variables(module, "params", trans_in_fn=layout)


def straight_line(unroll: bool | None, remat: str | RematSpec, dtype: Any = None) -> bool:
    """Whether a stack runs as straight-line code, not a loop (:class:`ScannedBlocks`'
    ``unroll``): ``True``/``False`` as given; ``None``: a stack without remat whose activations'
    ``dtype`` is not float16."""
    if unroll is not None:
        return unroll
    return not parse_policy(remat).enabled and jnp.dtype(dtype or jnp.float32) != jnp.float16


class ScannedBlocks(nn.Module):
    """``length`` blocks of identical shapes, applied in sequence with ``lax.scan`` and remat.

    Each block maps ``x -> block(x, *context, train=train)`` with the same shape and dtype;
    ``context`` (e.g. an encoder's output and masks) is the same for every block. Variables of
    the block are
    stored stacked: every leaf of the block's ``params`` (and of any other collection, such as
    ``batch_stats``) gets a leading ``[length]`` axis, under ``params/stack`` and
    ``<collection>/stack`` (:data:`STACK`).

    Attributes:
      make_block: a zero-argument callable returning a fresh (unbound) block module, e.g.
        ``functools.partial(PreActBlock, features=64)``. It is called as
        ``block(x, *context, train=train)``.
      length: number of blocks ``n >= 1``.
      remat: a policy name or :class:`RematSpec` (module docstring), or one policy name per
        block (a model's slice of a ``blocks:`` schedule, :func:`stack_policies`): each run of
        equal names is scanned under its policy.
      unroll: ``True``: every run of blocks as straight-line code (``lax.scan(unroll=True)``:
        same parameters and results; XLA schedules the blocks as it would a Python loop);
        ``False`` (default): every run a loop; ``None``: a run without remat is unrolled unless
        it computes in float16 (:func:`straight_line`). Why: unrolled, XLA sees the forward and
        backward passes whole and may recompute cheap elementwise results instead of keeping
        the residuals a loop must stack; but it may also schedule a remat'd block's
        recomputation early and keep it, undoing the remat, and on XLA:CPU an unrolled float16
        step keeps more than a looped one (``benchmarks/results/unroll_*``).
      param_layout: applied to one block's parameters inside the loop, before the block uses
        them (and again when remat recomputes the block), e.g. ZeRO-3's gather of that
        block's partitioned parameters (:func:`lowmem_jax.core.mesh.replicate`, set by
        ``Plan.configure_model``); ``None``: used as stored.

    A stacked parameter given as a :class:`~lowmem_jax.core.base.BlockwiseLeaf` (compressed sparse
    weights, see ``Optimizer.materialize(blockwise=True)``) is densified inside the loop, one
    block at a time, under the block's remat policy: one block's dense weights exist at a time
    (the backward pass rebuilds them). Without remat the backward pass keeps every block's
    dense weights anyway, so the stack is densified whole, before the loop.
    """

    make_block: Callable[[], nn.Module]
    length: int
    remat: str | RematSpec | tuple[str, ...] = "none"
    unroll: bool | None = False
    param_layout: Callable[[Any], Any] | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *context: Any, train: bool) -> jax.Array:
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        runs = _policy_runs(self.remat, self.length)
        block = self.make_block()

        def init_stack(rng):
            keys = jax.random.split(rng, self.length)
            return jax.vmap(
                lambda k: block.init({"params": k, "dropout": k}, x, *context, train=False)
            )(keys)

        if self.is_initializing():
            stacked = init_stack(self.make_rng("params"))
            params = self.param(STACK, lambda _: stacked["params"])
            others = {c: v for c, v in stacked.items() if c != "params"}
        else:
            params = self.get_variable("params", STACK)
            others = {
                c: v[STACK] for c, v in self.variables.items() if c != "params" and STACK in v
            }
        mutable = [c for c in others if train and self.is_mutable_collection(c)]
        use_dropout = train and self.has_rng("dropout")
        keys = (
            jax.random.split(self.make_rng("dropout"), self.length)
            if use_dropout
            else jnp.zeros((self.length,), jnp.uint32)
        )

        # Blockwise leaves stay whole (closed over); the loop carries the block index instead.
        leaves, treedef = jax.tree.flatten(params, is_leaf=_is_blockwise)
        if not any(spec.enabled for spec, _, _ in runs):
            leaves = [x.dense() if _is_blockwise(x) else x for x in leaves]
        blockwise = {i: x for i, x in enumerate(leaves) if _is_blockwise(x)}
        params = [None if i in blockwise else x for i, x in enumerate(leaves)]

        def apply_block(h, xs, context, stored):
            p, state, key, index = xs
            # Tied to the block's input, the stored weights are densified when the block runs:
            # XLA may not hoist a lone block's dense copy (loop-invariant) out of an enclosing
            # loop (the microbatches'), where it would stay alive throughout.
            stored, h = jax.lax.optimization_barrier((stored, h))
            p = [stored[i].block(index) if i in stored else x for i, x in enumerate(p)]
            p = jax.tree.unflatten(treedef, p)
            if self.param_layout is not None:
                p = self.param_layout(p)
            rngs = {"dropout": key} if use_dropout else {}
            out = block.apply(
                {"params": p, **state},
                h,
                *context,
                train=train,
                rngs=rngs,
                mutable=mutable or False,
            )
            h, new_state = out if mutable else (out, {})
            return h, {c: new_state.get(c, state[c]) for c in state}

        xs = (params, others, keys, jnp.arange(self.length, dtype=jnp.int32))
        closed = (tuple(context), blockwise)
        hooks = () if self.is_initializing() else block_hooks.current()
        ran = None
        if hooks:
            stack = block_hooks.Stack(
                length=self.length, runs=tuple(runs), blockwise=bool(blockwise), x=x,
                context=tuple(context), params=params, state=others, keys=keys, index=xs[3],
                dropout=use_dropout,
                scan=lambda h, run_xs, ctx, length, spec: _scan_run(
                    apply_block, h, run_xs, (ctx, {}), length, spec, self.unroll
                ),
            )  # fmt: skip
            ran = next((out for hook in hooks if (out := hook.run(stack)) is not None), None)
        if ran is not None:  # a hook ran the stack (e.g. as a pipeline over devices)
            x, new_others = ran
            runs = []
        outs = []
        for spec, start, stop in runs:
            run_xs = jax.tree.map(lambda a, i=start, j=stop: a[i:j], xs) if len(runs) > 1 else xs
            x, run_others = _scan_run(
                apply_block, x, run_xs, closed, stop - start, spec, self.unroll, self.param_layout
            )
            outs.append(run_others)
        if outs:
            new_others = (
                outs[0] if len(outs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
            )

        if self.is_initializing():
            for c, v in others.items():
                self.variable(c, STACK, lambda v=v: v)
        elif mutable:
            for c in mutable:
                self.put_variable(c, STACK, new_others[c])
        return x


def _is_blockwise(x: Any) -> bool:
    return isinstance(x, BlockwiseLeaf)


def _policy_runs(remat: str | RematSpec | tuple[str, ...], length: int) -> list[tuple]:
    """``[(spec, start, stop)]``: the runs of blocks under one policy (one run unless ``remat``
    is a per-block tuple)."""
    if not isinstance(remat, tuple):
        spec = parse_policy(remat)
        if spec.schedule:
            raise ValueError(
                f"remat={spec.name!r} is a model's schedule; a stack takes its slice "
                "(lowmem_jax.blocks.policy.stack_policies)"
            )
        return [(spec, 0, length)]
    if len(remat) != length:
        raise ValueError(f"remat gives {len(remat)} policies for a stack of {length} blocks")
    runs, start = [], 0
    for name, group in itertools.groupby(remat):
        stop = start + len(list(group))
        runs.append((parse_policy(name), start, stop))
        start = stop
    return runs


def _scan_run(
    apply_block, x, xs, closed, length: int, spec: RematSpec, unroll: bool | None, layout=None
):
    """``length`` blocks applied in sequence under ``spec``; ``(x, per-block outputs)``.

    ``layout``: the stack's ``param_layout``; where it moves memory (its ``moves_memory``
    attribute: weight streaming's), a lone block's parameters (``xs[0]``) are moved before they
    are taken out of their stack, inside the block's checkpoint, so nothing indexes them in
    host memory.

    ``apply_block(h, xs, *closed)``: ``closed`` are the values every block reads (the context,
    the blockwise-stored weights), passed explicitly so that the active per-block hooks'
    bodies (:meth:`~lowmem_jax.blocks.hooks.BlockHook.wrap_body`, the outermost: e.g. each
    block's residuals, its checkpointed input under remat, stored compressed) see them."""
    unroll = straight_line(unroll, spec, x.dtype)
    segment = spec.segment_length(length) if spec.segment else 1
    hooks = block_hooks.current()

    def outermost(fn, iterations: int):
        for hook in reversed(hooks):  # the first activated outermost
            fn = hook.wrap_body(fn, len(closed), iterations)
        return lambda h, block_xs: fn(h, block_xs, *closed)

    if length == 1 and getattr(layout, "moves_memory", False):
        # Streamed from host memory: moved, then taken out of its stack, inside the checkpoint.
        def lone(h, block_xs, *rest):
            block_xs = (layout(block_xs[0]), *block_xs[1:])
            return apply_block(h, jax.tree.map(lambda a: a[0], block_xs), *rest)

        if spec.enabled:
            lone = jax.checkpoint(lone, policy=spec.policy, prevent_cse=True)
        x, out = outermost(lone, 1)(x, xs)
        return x, jax.tree.map(lambda a: a[None], out)
    if length == 1:
        # A lone block may change the shape (stride, width), which a scan carry cannot;
        # outside a loop, CSE must be prevented explicitly for remat to hold.
        if spec.enabled:
            apply_block = jax.checkpoint(apply_block, policy=spec.policy, prevent_cse=True)
        x, out = outermost(apply_block, 1)(x, jax.tree.map(lambda a: a[0], xs))
        return x, jax.tree.map(lambda a: a[None], out)
    if segment == 1:
        if spec.enabled:
            apply_block = jax.checkpoint(apply_block, policy=spec.policy, prevent_cse=False)
        return jax.lax.scan(outermost(apply_block, length), x, xs, unroll=unroll)
    return _segmented_scan(apply_block, outermost, x, xs, length, segment, spec, unroll)


def _segmented_scan(
    apply_block, outermost, x, xs, length: int, segment: int, spec: RematSpec, unroll: bool
):
    """Scans ``length`` blocks in checkpointed segments of ``segment`` blocks (plus a remainder);
    ``outermost`` wraps each segment (:func:`_scan_run`)."""
    full = length // segment * segment
    # Blocks inside a segment are checkpointed too: the backward pass of a segment then holds K
    # block inputs plus one block's internals, not K blocks' internals (n/K + K inputs overall).
    apply_block = jax.checkpoint(apply_block, policy=spec.policy, prevent_cse=False)

    def run_segment(h, seg_xs, *closed):
        return jax.lax.scan(lambda c, b: apply_block(c, b, *closed), h, seg_xs, unroll=unroll)

    checkpointed = jax.checkpoint(run_segment, policy=spec.policy, prevent_cse=False)
    run_segment = outermost(checkpointed, length // segment)
    head = jax.tree.map(lambda a: a[:full].reshape((-1, segment) + a.shape[1:]), xs)
    x, ys = jax.lax.scan(run_segment, x, head, unroll=unroll)
    ys = jax.tree.map(lambda a: a.reshape((full,) + a.shape[2:]), ys)
    if full < length:
        tail = jax.tree.map(lambda a: a[full:], xs)
        x, tail_ys = run_segment(x, tail)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, tail_ys)
    return x, ys
