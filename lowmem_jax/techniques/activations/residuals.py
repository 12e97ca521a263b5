"""Compressed activations: the residuals a backward pass needs, stored in fewer bits.

A function's VJP keeps *residuals*: values of the forward pass the backward pass reads (a
layer's input for its weight gradient, a normalisation's centred input, an activation
function's argument). :func:`compress_residuals` makes ``fn``'s forward pass exact and stores
each of those residuals that is an *activation* (it depends on the data arguments) compressed;
the backward pass decompresses each one and runs ``fn``'s own VJP on it. Nothing is recomputed.
This is ActNN's activation-compressed training (Chen et al., ICML 2021), done on the residuals
JAX's autodiff keeps rather than per layer type, so it applies to any model.

The stored formats are :mod:`lowmem_jax.codecs.activation_formats`' (``bf16``; ``int8`` / ``int4`` /
``int2``: ActNN's per-group minimum and range with stochastic rounding; masks in bits). A
compressed residual is an unsigned integer array, so an enclosing :func:`compress_residuals`
never compresses it again (nesting is safe: the inner one's residuals pass through).

Which residuals are compressed: floating residuals of at least ``min_size`` elements that depend
on the arguments in ``data_argnums`` (a dataflow pass over the traced VJP; through ``scan``
bodies, other nested jaxprs conservatively) and are not themselves an argument (the caller
keeps those alive anyway). Parameters, their casts and anything computed from them alone stay
as they are: the input gradient of a linear layer uses the exact weights; only weight
gradients and the gradients through nonlinearities see the compression error.

Loops compress per iteration, so that a loop's backward pass decompresses one iteration's
residuals at a time instead of the whole stack: scanned stacks
(:class:`~lowmem_jax.ScannedBlocks`) wrap their blocks while a :func:`compress_residuals` is
tracing around them (:class:`CompressedBodies`, a per-block hook); any other ``scan`` that reads
the data (a model's ``nn.scan`` / ``nnx.scan``, at the top level or inside ``jit`` calls) gets
its body wrapped by re-evaluating ``fn``'s jaxpr (:func:`.loops.with_wrapped_loops`). A
residual read from a loop's constants alone (the padded input every tap of a dynamic
convolution slices, a decoder's encoder output) is the same in every iteration: it is stored
once as it is, where one compressed copy per iteration would weigh as much or more
(``invariant_argnums``, ``iterations``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from lowmem_jax.blocks import hooks as block_hooks
from lowmem_jax.blocks import policy as remat_policy
from lowmem_jax.blocks.hooks import BlockHook
from lowmem_jax.codecs.activation_formats import (
    FORMATS,
    MASK,
    ActivationSpec,
    compress,
    compress_activation,
    decompress,
    parse_spec,
)
from lowmem_jax.core.jaxprs import data_dependence
from lowmem_jax.techniques.activations.loops import MARK, with_wrapped_loops

__all__ = [
    "FORMATS",
    "ActivationSpec",
    "parse_spec",
    "compress",
    "decompress",
    "compress_activation",
    "compress_residuals",
    "compiler_options",
    "CompressedBodies",
    "residual_report",
    "ResidualReport",
]


def compiler_options(spec: ActivationSpec | str, backend: str | None = None) -> dict[str, str]:
    """XLA options under which compressed residuals take effect on ``backend``: the
    optimization barriers that keep XLA from decompressing in the forward pass (or fusing the
    compression into the backward pass) must survive, which on CPU is remat's option
    (:func:`lowmem_jax.blocks.policy.compiler_options`); ``{}`` for ``none``."""
    return remat_policy.compiler_options("full" if parse_spec(spec).enabled else "none", backend)


# --- a function's residuals -------------------------------------------------------------------


class CompressedBodies(BlockHook):
    """The per-block hook active while a :func:`compress_residuals` traces its forward pass: a
    scanned stack (:class:`~lowmem_jax.ScannedBlocks`) stores each iteration's residuals in
    ``spec``'s format, so its backward pass decompresses one iteration's at a time."""

    def __init__(self, spec: ActivationSpec):
        self.spec = spec

    def wrap_body(self, body, closed: int, iterations: int):
        # The block's input and its context are data. The loop would stack its input and
        # per-block values, so none is kept as it is; the context is the same in every block.
        return compress_residuals(body, self.spec, data_argnums=(0, 2), keep_arguments=False,
                                  invariant_argnums=range(2, 2 + closed),
                                  iterations=iterations)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """A function's VJP residuals, as JAX keeps them and as :func:`compress_residuals` stores
    them (an analytic count from shapes). Residuals that are the function's arguments (the
    caller's arrays) and constant broadcasts (rebuilt, not stored) are left out of both.

    Attributes:
      count: residual arrays.
      plain_bytes: their bytes as JAX keeps them.
      stored_bytes: their bytes as stored compressed.
    """

    count: int
    plain_bytes: int
    stored_bytes: int

    @property
    def ratio(self) -> float:
        """``stored_bytes / plain_bytes``."""
        return self.stored_bytes / max(self.plain_bytes, 1)


def _action(var: Any, activation: bool, producer: Any, spec: ActivationSpec) -> Any:
    """What the forward pass stores for one residual: ``None`` (as it is); ``"compress"`` (an
    activation in ``spec``'s format); ``"bits"`` (a boolean activation, e.g. a ReLU's mask,
    one bit per element: lossless); ``("fill", value)`` (a constant broadcast, e.g. the zeros
    of a ReLU's derivative: stored as nothing, rebuilt in the backward pass)."""
    aval = var.aval
    if (
        producer is not None
        and producer.primitive.name == "broadcast_in_dim"
        and isinstance(producer.invars[0], jex_core.Literal)
        and aval.size >= spec.min_size
    ):
        return ("fill", producer.invars[0].val)
    if not activation or aval.size < spec.min_size:
        return None
    if aval.dtype == jnp.bool_:
        return "bits"
    if jnp.issubdtype(aval.dtype, jnp.floating) and not (
        spec.kind == "bf16" and aval.dtype.itemsize <= 2
    ):
        return "compress"
    return None


def _stored_format(action: Any, spec: ActivationSpec) -> ActivationSpec | None:
    """The format an action stores its residual in (``None``: as it is, or not at all)."""
    return {"compress": spec, "bits": MASK}.get(action) if isinstance(action, str) else None


def _stored_nbytes(aval: Any, action: Any, spec: ActivationSpec) -> int:
    """The bytes a residual of ``aval`` takes as stored for ``action`` (an analytic count)."""
    fmt, itemsize = _stored_format(action, spec), aval.dtype.itemsize
    return aval.size * itemsize if fmt is None else fmt.stored_bytes(aval.size, itemsize)


def _store(x: jax.Array, action: Any, spec: ActivationSpec) -> Any:
    fmt = _stored_format(action, spec)
    if fmt is not None:
        return compress_activation(x, fmt)
    return None if action is not None else x  # a fill is rebuilt, not stored


def _load(stored: Any, action: Any, shape: Any, dtype: Any, spec: ActivationSpec) -> jax.Array:
    fmt = _stored_format(action, spec)
    if fmt is not None:
        return decompress(stored, shape, dtype, fmt)
    return jnp.full(shape, action[1], dtype) if action is not None else stored


def _barrier(stored: list, actions: list, other: Any) -> tuple[list, Any]:
    """``stored`` with its compressed arrays passed through one optimization barrier together
    with ``other`` (the others untouched: a residual kept as it is, a block's weights, must stay
    the very array, which a loop then recognises as its input and does not stack a copy of)."""
    packed = [i for i, a in enumerate(actions) if a in ("compress", "bits")]
    barred, other = lax.optimization_barrier(([stored[i] for i in packed], other))
    stored = list(stored)
    for i, x in zip(packed, barred, strict=True):
        stored[i] = x
    return stored, other


def _body_wrapper(spec: ActivationSpec):
    """A loop body under :func:`compress_residuals`: none of its arguments kept as they are
    (the loop would stack them), except the loop's constants where that weighs less."""

    def wrap(
        step: Callable[..., Any], data_argnums: list[int], invariant_argnums: list[int],
        iterations: int,
    ) -> Callable[..., Any]:  # fmt: skip
        return compress_residuals(
            step,
            spec,
            data_argnums=data_argnums,
            keep_arguments=False,
            invariant_argnums=invariant_argnums,
            iterations=iterations,
        )

    return wrap


def _plan_residuals(
    fn, args, data_argnums, spec, *, keep_arguments=True, invariant_argnums=(), iterations=1,
    active=True,
):  # fmt: skip
    """Traces ``fn``'s VJP once (``active``: with :class:`CompressedBodies` active, so that the
    stacks inside compress per iteration): ``(closed jaxpr of flat args -> out leaves +
    residual leaves, {"out", "res": trees, "n_out": count, "inputs": which residuals are
    arguments}, which residuals to compress)``."""
    flat, in_tree = jax.tree.flatten(args)
    trees = {}
    arg_of = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    data = [i in data_argnums for i in arg_of]
    variant = [i not in invariant_argnums for i in arg_of]
    traced = with_wrapped_loops(fn, data, _body_wrapper(spec)) if active else fn

    def run(*leaves):
        out, vjp_fn = jax.vjp(traced, *jax.tree.unflatten(in_tree, leaves))
        out_leaves, trees["out"] = jax.tree.flatten(out)
        res, trees["res"] = jax.tree.flatten(vjp_fn)
        trees["n_out"] = len(out_leaves)
        return out_leaves + res

    with block_hooks.active(CompressedBodies(spec)) if active else contextlib.nullcontext():
        closed = jax.make_jaxpr(run)(*flat)
    jaxpr = closed.jaxpr
    depends = data_dependence(jaxpr, data)[trees["n_out"] :]
    varies = data_dependence(jaxpr, variant)[trees["n_out"] :] if invariant_argnums else None
    inputs = set(jaxpr.invars)
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    residuals = jaxpr.outvars[trees["n_out"] :]
    trees["inputs"] = [isinstance(v, jex_core.Var) and v in inputs for v in residuals]
    chosen = [
        _action(
            v,
            d and not (keep_arguments and is_input),
            producer.get(v) if isinstance(v, jex_core.Var) else None,
            spec,
        )
        for v, d, is_input in zip(residuals, depends, trees["inputs"], strict=True)
    ]
    for j, v in enumerate(residuals):
        # Read from the loop's constants alone, the same in every iteration: kept as it is, the
        # loop holds (or hoists) one copy; compressed, it stacks one per iteration.
        if varies is not None and not varies[j] and _stored_format(chosen[j], spec) is not None:
            stored = iterations * _stored_nbytes(v.aval, chosen[j], spec)
            if stored >= _stored_nbytes(v.aval, None, spec):
                chosen[j] = None
    return closed, trees, chosen


def compress_residuals(
    fn: Callable[..., Any],
    spec: ActivationSpec | str,
    *,
    data_argnums: Sequence[int] = (0,),
    keep_arguments: bool = True,
    invariant_argnums: Sequence[int] = (),
    iterations: int = 1,
) -> Callable[..., Any]:
    """``fn`` with the same values whose VJP stores its activation residuals in ``spec``'s
    format (module docstring).

    Args:
      fn: a function of positional pytree arguments (arrays, integer arrays and PRNG keys
        allowed) returning a pytree; it must not close over traced values (pass them as
        arguments).
      spec: an activation format (:func:`parse_spec`); ``"none"`` returns ``fn``.
      data_argnums: the arguments that carry the data (e.g. the batch; a block's input): a
        residual is an activation if it depends on one of them.
      keep_arguments: a residual that is one of ``fn``'s arguments is stored as it is (the
        caller keeps its arguments alive anyway, e.g. a loss's batch); ``False`` for a loop's
        body, whose arguments the loop would stack (a block's input under remat).
      invariant_argnums: for a loop's body, the arguments that are the loop's constants (the
        same array in every iteration). A residual that depends on no other argument is
        stored as it is, one copy for the whole loop (JAX hoists loop-invariant residuals),
        where ``iterations`` compressed copies, one per iteration, would take as many bytes
        or more.
      iterations: the loop's length (with ``invariant_argnums``).

    Returns:
      ``fn`` under a ``jax.custom_vjp``: forward values bitwise equal to ``fn``'s, gradients
      computed by ``fn``'s VJP from the decompressed residuals. Each call traces ``fn``'s VJP
      once more (to find its residuals) when it is differentiated.
    """
    spec = parse_spec(spec)
    if not spec.enabled:
        return fn
    data_argnums, invariant_argnums = tuple(data_argnums), tuple(invariant_argnums)

    def call(*args):
        # One custom_vjp per call: its forward pass leaves the residuals' structure here for
        # its own backward pass.
        saved: dict[str, Any] = {}

        @jax.custom_vjp
        def wrapped(*args):
            return fn(*args)

        def forward(*args):
            closed, trees, chosen = _plan_residuals(
                fn, args, data_argnums, spec, keep_arguments=keep_arguments,
                invariant_argnums=invariant_argnums, iterations=iterations,
            )  # fmt: skip
            values = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
            out_leaves, res = values[: trees["n_out"]], values[trees["n_out"] :]
            stored = [_store(r, c, spec) for r, c in zip(res, chosen, strict=True)]
            saved.update(trees=trees, chosen=chosen, avals=[(r.shape, r.dtype) for r in res])
            # The outputs wait for the compressed residuals: else XLA may compress late (the
            # float residuals kept meanwhile) or fuse the compression into the backward pass's
            # decompression (one fusion reading the float residual, kept until then).
            stored, out_leaves = _barrier(stored, chosen, out_leaves)
            return jax.tree.unflatten(trees["out"], out_leaves), stored

        def backward(stored, cotangent):
            trees, chosen, avals = saved["trees"], saved["chosen"], saved["avals"]
            # Decompressed when the backward pass reaches this function, not hoisted earlier.
            stored, cotangent = _barrier(stored, chosen, cotangent)
            res = [
                _load(s, c, shape, dtype, spec)
                for s, c, (shape, dtype) in zip(stored, chosen, avals, strict=True)
            ]
            return tuple(jax.tree.unflatten(trees["res"], res)(cotangent))

        setattr(backward, MARK, True)  # a loop with this body is not wrapped again
        wrapped.defvjp(forward, backward)
        return wrapped(*args)

    return call


def residual_report(
    fn: Callable[..., Any],
    spec: ActivationSpec | str,
    *args: Any,
    data_argnums: Sequence[int] = (0,),
) -> ResidualReport:
    """What ``fn``'s VJP keeps at ``args`` (arrays or ``jax.ShapeDtypeStruct``) and what
    :func:`compress_residuals` stores in ``spec``'s format: an analytic count of the residual
    arrays, traced twice (as JAX keeps them; compressed), nothing computed. Loops count the
    residuals they stack (:class:`~lowmem_jax.ScannedBlocks` compresses per iteration)."""
    spec = parse_spec(spec)
    probe = spec if spec.enabled else parse_spec("int8")
    data_argnums = tuple(data_argnums)

    def residuals(active: bool) -> list[tuple[Any, Any]]:
        closed, trees, actions = _plan_residuals(fn, args, data_argnums, probe, active=active)
        avals = (v.aval for v in closed.jaxpr.outvars[trees["n_out"] :])
        return [
            (a, c)
            for a, c, i in zip(avals, actions, trees["inputs"], strict=True)
            if not i and not isinstance(c, tuple)
        ]

    def nbytes(aval: Any, action: Any) -> int:
        return _stored_nbytes(aval, action if spec.enabled else None, spec)

    plain = residuals(active=False)
    stored = residuals(active=True) if spec.enabled else plain
    return ResidualReport(
        count=len(plain),
        plain_bytes=sum(nbytes(a, None) for a, _ in plain),
        stored_bytes=sum(nbytes(a, c) for a, c in stored),
    )
