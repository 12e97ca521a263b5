"""A function re-evaluated from its jaxpr with each loop body that reads the data wrapped
(:mod:`lowmem_jax.techniques.activations.residuals` wraps them so that a loop stacks its iterations'
residuals compressed and its backward pass decompresses one iteration's at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax._src import source_info_util
from jax.extend import core as jex_core

from lowmem_jax.core.jaxprs import scan_dependence, scan_layout

__all__ = ["with_wrapped_loops", "MARK"]

#: The attribute a wrapped body's custom-VJP backward function carries: such a loop is left as
#: it is (:func:`with_wrapped_loops` does not wrap a body twice).
MARK = "compresses_residuals"

#: ``wrap(step, data_argnums, invariant_argnums, iterations) -> step``: a loop body
#: ``step(*leaves) -> (carry, ys)`` wrapped, the leaves in ``data_argnums`` reading the data,
#: those in ``invariant_argnums`` the loop's constants (the same array in each of its
#: ``iterations``).
WrapBody = Callable[[Callable[..., Any], list[int], list[int], int], Callable[..., Any]]


def with_wrapped_loops(fn: Callable[..., Any], data: list[bool], wrap: WrapBody):
    """``fn`` re-evaluated from its jaxpr with the body of each loop (``scan``) that reads the
    data replaced by ``wrap(body, data_argnums)``; ``fn`` itself where it has no such loop.
    ``data``: which of ``fn``'s flattened arguments carry the data. Bodies wrapped already
    (their backward function marked :data:`MARK`: a :class:`~lowmem_jax.ScannedBlocks`
    stack's) and loops inside other calls than ``jit`` (a checkpoint, a custom derivative) are
    left as they are."""

    def run(*args):
        flat, in_tree = jax.tree.flatten(args)
        closed, shapes = jax.make_jaxpr(
            lambda *leaves: fn(*jax.tree.unflatten(in_tree, leaves)), return_shape=True
        )(*flat)
        if not _has_loop(closed.jaxpr):
            return fn(*args)  # as traced: nothing to re-evaluate
        out = _interpret(closed.jaxpr, closed.consts, flat, data, wrap)
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return run


def _interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], data, wrap) -> list:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    dep = {v for v, d in zip(jaxpr.invars, data, strict=True) if d}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        flags = [isinstance(v, jex_core.Var) and v in dep for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan" and any(flags) and not _compresses(eqn):
            outvals = _wrapped_scan(eqn, invals, flags, wrap)
        elif name in ("pjit", "jit") and any(flags) and _has_loop(eqn.params["jaxpr"].jaxpr):
            inner = eqn.params["jaxpr"]
            outvals = _interpret(inner.jaxpr, inner.consts, invals, flags, wrap)
        else:
            # As jax.core.eval_jaxpr binds it: the equation's source line and name stack kept
            # (the inspector attributes buffers by them).
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
                outvals = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outvals = outvals if eqn.primitive.multiple_results else [outvals]
        env.update(zip(eqn.outvars, outvals, strict=True))
        if any(flags):
            dep.update(eqn.outvars)
    return [read(v) for v in jaxpr.outvars]


def _has_loop(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs a loop :func:`_interpret` would compress: a ``scan`` whose body
    does not compress already, at its top level or inside ``jit`` calls."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and not _compresses(eqn):
            return True
        if eqn.primitive.name in ("pjit", "jit") and _has_loop(eqn.params["jaxpr"].jaxpr):
            return True
    return False


def _compresses(eqn: Any) -> bool:
    """Whether a loop's body is wrapped already (its custom VJP marked :data:`MARK`)."""
    body = eqn.params["jaxpr"].jaxpr
    return any(
        getattr(getattr(e.params.get("bwd"), "f", None), MARK, False)
        for e in body.eqns
        if e.primitive.name == "custom_vjp_call"
    )


def _wrapped_scan(eqn: Any, invals: list, flags: list[bool], wrap: WrapBody) -> list:
    """The ``scan`` equation ``eqn`` run with its body wrapped (the body's arguments one by
    one, those that read the data as data)."""
    params = eqn.params
    body, (n_consts, n_carry) = params["jaxpr"], scan_layout(params)
    outs = scan_dependence(eqn, flags)
    flags = list(flags)
    for i in range(n_carry):  # a carry the body makes data-dependent is data from then on
        flags[n_consts + i] = flags[n_consts + i] or outs[i]
    consts = invals[:n_consts]

    def step(*leaves):
        out = jax.core.eval_jaxpr(body.jaxpr, body.consts, *leaves)
        return out[:n_carry], out[n_carry:]

    data_argnums = [i for i, f in enumerate(flags) if f]
    wrapped = wrap(step, data_argnums, list(range(n_consts)), params["length"])

    def scan_body(carry, x):
        return wrapped(*consts, *carry, *x)

    carry, ys = lax.scan(
        scan_body,
        list(invals[n_consts : n_consts + n_carry]),
        list(invals[n_consts + n_carry :]),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]
