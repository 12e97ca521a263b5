"""The optimizer state's stored format: float32 arithmetic, 16-, 8- or 4-bit storage.

:func:`quantized_state` wraps any optimizer (an optax transformation, or an
:class:`lowmem_jax.core.base.Optimizer` such as sparse training) so that its state is *stored* in a
chosen format and every update runs in float32::

    inner = decode(state.inner_state)                  float32, as the inner optimizer made it
    updates, inner = inner_opt.update(f32(grads), inner, f32(params))
    return cast(updates, params' dtypes), QuantizedState(encode(inner))

Formats (``format``), per floating leaf of the inner state (encoded and decoded by
:mod:`lowmem_jax.codecs.state_format`):

============  =================================================================================
``auto``      float32 slots for float32 parameters; bfloat16 for 16-bit parameters (the
              technical report's all-16-bit count; float16 would flush Adam's second moment,
              ``g**2 < 6e-8``, to zero); the arithmetic is float32
``fp32``      float32
``bf16``      bfloat16
``int8``      block-wise dynamic quantization (Dettmers et al., 2022): blocks of 2048, a float32
              absmax per block, the signed dynamic map for first moments and the unsigned one
              for second moments (:mod:`lowmem_jax.codecs.quantization`)
``int4``      Li, Chen, Zhu (2023): first moments block-wise (blocks of 128, 4-bit signed
              dynamic map); second moments rank-1 normalized with the zero-free linear map
============  =================================================================================

Leaves with fewer than ``min_size`` elements (4096, as bitsandbytes) are stored in float32 by
every format but ``auto``; non-floating leaves (step counts, masks, indices) as they are. A leaf
is a *second moment* when its path in the state names one of ``second_moments`` (Adam's ``nu``,
Adagrad's ``sum_of_squares``). The state's structure and dtypes never change between steps, so
it can be donated, checkpointed and selected leafwise (a skipped step keeps the old state).

Inside sparse training (as :class:`lowmem_jax.Plan` composes it) the state holds the compressed
values' slots, and sparse training resets a regrown weight's slots in their codes
(:func:`lowmem_jax.codecs.quantization.zero_where`). Wrapped around sparse training instead, the
reset runs on the decoded float32 state, but the sparse update is not separable by leaf, so the
whole state is decoded at once. Either way, with the zero-free map a reset second moment decodes to
the smallest code, ``scale / 16``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowmem_jax.codecs import leafwise
from lowmem_jax.codecs import state_format as optimizer_state_format
from lowmem_jax.codecs.state_format import (
    DEFAULT_BLOCK,
    FORMATS,
    QUANTIZED_FORMATS,
    SECOND_MOMENTS,
    check_format,
    encode_like,
    encode_new,
    is_quantized,
)
from lowmem_jax.core.base import Optimizer, PyTree, Wrapper, as_optimizer, cast_floating, shapes

__all__ = [
    "FORMATS",
    "QUANTIZED_FORMATS",
    "QuantizedState",
    "QuantizedStateOptimizer",
    "quantized_state",
]


class QuantizedState(NamedTuple):
    """``inner_state``: the inner optimizer's state with its leaves in the stored format
    (:class:`lowmem_jax.codecs.quantization.Quantized` for int8/int4 leaves); ``rng``: the
    stochastic rounding key (uint32[2]), or ``None``."""

    inner_state: PyTree
    rng: jax.Array | None


def _decoded_placeholder(stored: Any) -> Any:
    """The empty stand-in of a stored leaf (or of each leaf of a :func:`leafwise.unit`) as
    :meth:`QuantizedStateOptimizer.decode` gives it, of the leaf's rank."""

    def leaf(x):
        if is_quantized(x):
            return leafwise.placeholder(x, jnp.float32, ndim=len(x.meta.shape))
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return leafwise.placeholder(x, jnp.float32)
        return leafwise.placeholder(x)  # an integer leaf as it is; a non-array stays

    return jax.tree.map(leaf, stored, is_leaf=is_quantized)


def _encode_like(old: Any, new: Any, keys: list, block_size: int) -> Any:
    """``new`` (float32; a leaf or a :func:`leafwise.unit`) stored as ``old`` was, leaf by leaf
    with ``keys`` (:func:`encode_like`)."""
    olds, treedef = jax.tree.flatten(old, is_leaf=is_quantized)
    news = treedef.flatten_up_to(new)
    return treedef.unflatten(
        [encode_like(o, x, k, block_size) for o, x, k in zip(olds, news, keys, strict=True)]
    )


def _f32(tree: PyTree) -> PyTree:
    """``tree``'s shapes, floating leaves as float32 (what the update computes in)."""
    return None if tree is None else cast_floating(shapes(tree), jnp.float32)


def _restrict(params_def, leaves: list, chosen: dict[int, Any]) -> PyTree:
    """The tree of ``leaves`` with leaf ``i`` from ``chosen`` where given, else a placeholder."""
    return params_def.unflatten(
        [chosen[i] if i in chosen else leafwise.placeholder(x) for i, x in enumerate(leaves)]
    )


class QuantizedStateOptimizer(Wrapper):
    """``inner`` with its state stored in ``format``; build with :func:`quantized_state`.

    Forwards the storage of the parameters (``store``, ``materialize``, ``grads_wrt_stored``)
    to ``inner`` (``materialize`` reads the stored state as it is: the storage's own state, e.g.
    a sparse pattern of integers, is not quantized), so it wraps a sparse optimizer as well as a
    plain optax transformation, and is itself an optax transformation (``init`` / ``update``;
    usable in ``optax.chain``).
    """

    def __init__(
        self,
        inner: Optimizer,
        format: str,
        block_size: int,
        min_size: int,
        stochastic_rounding: bool,
        second_moments: tuple[str, ...],
        seed: int,
        sequential: bool = True,
    ):
        self.inner = inner
        self.format = format
        self.block_size = block_size
        self.min_size = min_size
        self.stochastic_rounding = stochastic_rounding
        self.second_moments = second_moments
        self.seed = seed
        self.sequential = sequential

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, state: PyTree) -> PyTree:
        """A fresh inner state -> its stored form (``state.inner_state`` of :meth:`init`)."""

        def leaf(path, x):
            return encode_new(
                path,
                x,
                self.format,
                min_size=self.min_size,
                block_size=self.block_size,
                second_moments=self.second_moments,
            )

        return jax.tree_util.tree_map_with_path(leaf, state)

    @staticmethod
    def decode(stored: PyTree) -> PyTree:
        """The stored inner state -> the inner state with float32 floating leaves."""
        return optimizer_state_format.decode(stored)

    def _wrap(self, inner_state: PyTree) -> QuantizedState:
        rng = jax.random.PRNGKey(self.seed) if self.stochastic_rounding else None
        return QuantizedState(self.encode(inner_state), rng)

    # -- the optax protocol and the storage of the parameters ---------------------------------

    def init(self, params: PyTree) -> QuantizedState:
        return self._wrap(self.inner.init(params))

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, QuantizedState]:
        stored, inner_state = self.inner.store(params, grads)
        return stored, self._wrap(inner_state)

    def update(self, grads, state: QuantizedState, params=None):
        """``grads`` and ``params`` cast to float32, the inner update on the decoded state,
        ``updates`` cast to the dtypes of ``params`` (of ``grads`` without them), the new inner
        state encoded as the old one was.

        With ``sequential``, a quantized format (``int8``, ``int4``) and a separable inner
        update (:func:`lowmem_jax.codecs.leafwise.separability`) this runs one group of leaves at a
        time (:func:`lowmem_jax.codecs.leafwise.groups`), each group in a ``lax.cond`` whose
        predicate reads the previous group's results (the first group's: every gradient): XLA cannot
        decode every leaf at once, nor during the backward pass, so one group's float32
        moments are live at a time. The numbers are those of the whole-tree update; a NaN
        predicate gives NaN updates (a skipped step)."""
        reference = grads if params is None else params
        old, treedef = jax.tree.flatten(state.inner_state, is_leaf=is_quantized)
        rng, keys = state.rng, [None] * len(old)
        if rng is not None:
            rng, sub = jax.random.split(rng)
            keys = list(jax.random.split(sub, max(len(old), 1)))
        schedule, _ = self.schedule(_f32(grads), state.inner_state, _f32(params))
        if schedule is None:
            grads32 = cast_floating(grads, jnp.float32)
            params32 = None if params is None else cast_floating(params, jnp.float32)
            updates, inner_state = self.inner.update(
                grads32, self.decode(state.inner_state), params32
            )
            new = treedef.flatten_up_to(inner_state)
            leaves = [
                encode_like(o, x, k, self.block_size)
                for o, x, k in zip(old, new, keys, strict=True)
            ]
            stored = jax.tree.unflatten(treedef, leaves)
        else:
            dtypes = [x.dtype for x in jax.tree.leaves(reference)]
            # cast in each group: cast up front, the float32 copies can live through the backward
            updates, stored = self._update_in_groups(schedule, grads, state, params, keys, dtypes)
        updates = jax.tree.map(lambda u, r: u.astype(r.dtype), updates, reference)
        return updates, QuantizedState(stored, rng)

    def schedule(
        self, grads: PyTree, stored: PyTree, params: PyTree | None
    ) -> tuple[list[list[int]] | None, str]:
        """``(groups, why)``: the groups of leaf indices :meth:`update` runs one at a time, or
        ``None`` with the reason it updates the whole tree at once."""
        count = jax.tree.structure(grads).num_leaves
        if not self.sequential:
            return None, "sequential=False"
        if self.format not in QUANTIZED_FORMATS:  # a cast fuses into the update's own loops,
            # in place; a group's outputs would be materialized (measured: more bytes)
            return None, f"{self.format}: a cast, fused into the update"
        if count < 2:
            return None, "one leaf"
        # Shapes alone: a state placed in host memory (``optimizer_memory``) is decoded on the
        # device, after the step moves it there.
        decoded = jax.eval_shape(self.decode, shapes(stored))
        why = leafwise.separability(self.inner.update, grads, decoded, params)
        if why is not None:
            return None, f"not separable by leaf: {why}"
        sizes = [int(np.size(g)) for g in jax.tree.leaves(grads)]
        schedule = leafwise.groups(sizes)
        if len(schedule) < 2:
            return None, "one group"
        return schedule, f"{len(schedule)} groups of at most {max(sizes):,} elements"

    def _update_in_groups(self, schedule, grads, state, params, keys, dtypes):
        params_def = jax.tree.structure(grads)
        stored = leafwise.mirrors(state.inner_state, params_def, is_quantized)
        # The rounding keys of each position's stored leaves (a unit holds several), in the
        # whole-tree update's order.
        spans, start = {}, 0
        for k, leaves in enumerate(stored.leaves):
            for i, node in enumerate(leaves):
                count = len(jax.tree.leaves(node, is_leaf=is_quantized))
                spans[(k, i)] = keys[start : start + count]
                start += count
        shared = {
            k: self.decode(leaves[0])
            for k, (leaves, mirror) in enumerate(zip(stored.leaves, stored.kinds, strict=True))
            if not mirror
        }
        grad_leaves = params_def.flatten_up_to(grads)
        param_leaves = None if params is None else params_def.flatten_up_to(params)
        placeholders = [_f32(x) for x in (grad_leaves, param_leaves)]  # as the group's leaves
        updates: list = [None] * len(grad_leaves)
        encoded = [list(leaves) for leaves in stored.leaves]
        gate = grad_leaves  # the first group waits for every gradient

        for number, group in enumerate(schedule):
            spots = [
                (k, i)
                for k, mirror in enumerate(stored.kinds)
                for i in (group if mirror else ([0] if number == 0 else []))
            ]
            operands = (
                [stored.leaves[k][i] for k, i in spots],
                [spans[spot] for spot in spots],
                [grad_leaves[i] for i in group],
                None if param_leaves is None else [param_leaves[i] for i in group],
            )

            def run(operands, group=group, spots=spots):
                state_in, keys_in, grads_in, params_in = operands
                grads_in, params_in = cast_floating((grads_in, params_in), jnp.float32)
                decoded = {spot: self.decode(x) for spot, x in zip(spots, state_in, strict=True)}
                for k, x in shared.items():
                    decoded.setdefault((k, 0), x)
                state_g = stored.rebuild(
                    [
                        [
                            decoded[(k, i)] if (k, i) in decoded else _decoded_placeholder(x)
                            for i, x in enumerate(leaves)
                        ]
                        for k, leaves in enumerate(stored.leaves)
                    ]
                )
                new_updates, new_state = self.inner.update(
                    _restrict(params_def, placeholders[0], dict(zip(group, grads_in, strict=True))),
                    state_g,
                    None
                    if params_in is None
                    else _restrict(
                        params_def, placeholders[1], dict(zip(group, params_in, strict=True))
                    ),
                )
                new_updates = params_def.flatten_up_to(new_updates)
                new_leaves = leafwise.mirrors(new_state, params_def).leaves
                stored_out = [
                    _encode_like(old, new_leaves[k][i], spot_keys, self.block_size)
                    for (k, i), old, spot_keys in zip(spots, state_in, keys_in, strict=True)
                ]
                # in the parameters' dtypes here: a group's updates are materialized
                return [new_updates[i].astype(dtypes[i]) for i in group], stored_out

            def refuse(operands, group=group):
                """A NaN gate: NaN updates (the train step skips and counts them), the
                state as stored."""
                state_in, _, grads_in, _ = operands
                nan = [
                    jnp.full(g.shape, jnp.nan, dtypes[i])
                    for i, g in zip(group, grads_in, strict=True)
                ]
                return nan, list(state_in)

            # A conditional runs as one unit once its predicate is known, and the predicate
            # reads the last group's results: group g + 1 is decoded after group g is encoded.
            # (XLA:CPU drops optimization barriers before scheduling; a data dependency stays.)
            firsts = [x.reshape(-1)[0] for x in gate if x.size]
            ready = jnp.all(jnp.stack([v == v for v in firsts])) if firsts else True
            group_updates, stored_out = jax.lax.cond(ready, run, refuse, operands)
            for i, u in zip(group, group_updates, strict=True):
                updates[i] = u
            for (k, i), x in zip(spots, stored_out, strict=True):
                encoded[k][i] = x
            gate = group_updates
        return params_def.unflatten(updates), stored.rebuild(encoded)

    def describe(self, state: PyTree | None = None, params: PyTree | None = None) -> dict:
        """The inner optimizer's facts plus ``{"optimizer_state": {"format", "quantized_leaves",
        "stored_bytes"}}`` (with ``state``)."""
        out = dict(super().describe(state, params))
        facts: dict[str, Any] = {"format": self.format}
        if state is not None:
            leaves = jax.tree.leaves(state.inner_state, is_leaf=is_quantized)
            facts["quantized_leaves"] = sum(is_quantized(x) for x in leaves)
            facts["stored_bytes"] = sum(
                int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)
            )
        out["optimizer_state"] = facts
        return out

    def __repr__(self) -> str:
        return f"quantized_state({self.inner!r}, format={self.format!r})"


def quantized_state(
    tx: optax.GradientTransformation | Optimizer,
    format: str = "int8",
    *,
    block_size: int | None = None,
    min_size: int = 4096,
    stochastic_rounding: bool = False,
    second_moments: tuple[str, ...] = SECOND_MOMENTS,
    seed: int = 0,
    sequential: bool = True,
) -> QuantizedStateOptimizer:
    """``tx`` with its state stored in ``format`` (see the module docstring).

    Args:
      tx: any optax transformation (``adam``, ``sgd``, ``chain``, ``inject_hyperparams``...)
        or a :class:`lowmem_jax.core.base.Optimizer`.
      format: one of :data:`FORMATS`.
      block_size: elements per absmax block (default 2048 for int8, 128 for int4).
      min_size: leaves with fewer elements are stored in float32.
      stochastic_rounding: round quantized codes stochastically (unbiased) instead of to the
        nearest; the key lives in the state.
      second_moments: state field names whose leaves are non-negative second moments.
      seed: the stochastic rounding key's seed.
      sequential: update a separable inner optimizer one group of leaves at a time (see
        :meth:`QuantizedStateOptimizer.update`); ``False`` decodes the whole state at once.

    Raises:
      ValueError: an unknown format, or a block size that is not an even integer >= 2.
    """
    check_format(format)
    block = DEFAULT_BLOCK.get(format, 2048) if block_size is None else block_size
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"block_size must be an even integer >= 2, got {block_size!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    return QuantizedStateOptimizer(
        as_optimizer(tx),
        format,
        block,
        min_size,
        stochastic_rounding,
        tuple(second_moments),
        seed,
        sequential,
    )
