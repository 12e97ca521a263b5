"""Walking a traced step: every equation of a jaxpr, those nested in calls, loops,
conditionals, checkpoints and custom derivatives included; which values depend on which inputs
(nothing is compiled or run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

__all__ = ["equations", "traced_equations", "data_dependence", "scan_dependence", "scan_layout"]


def equations(jaxpr: Any, depth: int = 0) -> Iterator[tuple[Any, int]]:
    """``(eqn, loops)`` for every equation of ``jaxpr`` and of the jaxprs in its equations'
    parameters, depth first; ``loops``: the ``scan`` / ``while`` equations around it."""
    for eqn in jaxpr.eqns:
        yield eqn, depth
        inner = depth + (eqn.primitive.name in ("scan", "while"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from equations(sub, inner)


def traced_equations(fn: Callable[..., Any], *args: Any) -> Iterator[Any]:
    """Every equation of ``fn(*args)``'s jaxpr, nested ones included (traced; ``args`` may be
    ``jax.ShapeDtypeStruct``)."""
    return (eqn for eqn, _ in equations(jax.make_jaxpr(fn)(*args).jaxpr))


def data_dependence(jaxpr: Any, data: Sequence[bool]) -> list[bool]:
    """Which of ``jaxpr``'s outputs depend on the inputs flagged in ``data``: forward dataflow;
    into calls (``jit``, checkpoints), through ``scan`` bodies to a fixpoint over the carry,
    an optimization barrier one to one; any other equation with a flagged input (``while``,
    ``cond``) flags all its outputs."""
    dep = {v for v, d in zip(jaxpr.invars, data, strict=True) if d}

    def flagged(v: Any) -> bool:
        return isinstance(v, jex_core.Var) and v in dep

    for eqn in jaxpr.eqns:
        ins = [flagged(v) for v in eqn.invars]
        if not any(ins):
            continue
        name, sub = eqn.primitive.name, _called_jaxpr(eqn)
        if name == "scan":
            outs = scan_dependence(eqn, ins)
        elif name == "optimization_barrier":
            outs = ins
        elif sub is not None:
            outs = data_dependence(sub, ins)
        else:
            outs = [True] * len(eqn.outvars)
        dep.update(v for v, d in zip(eqn.outvars, outs, strict=True) if d)
    return [flagged(v) for v in jaxpr.outvars]


def _called_jaxpr(eqn: Any) -> Any:
    """The jaxpr a call-like equation (``jit``, a checkpoint, a custom derivative's primal)
    runs on its operands one to one, else ``None``."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = getattr(eqn.params.get(key), "jaxpr", eqn.params.get(key))
        if (
            hasattr(sub, "eqns")
            and len(sub.invars) == len(eqn.invars)
            and len(sub.outvars) == len(eqn.outvars)
        ):
            return sub
    return None


def scan_layout(params: dict[str, Any]) -> tuple[int, int]:
    """``(constants, carries)``: how many of a ``scan`` equation's inputs are each (the rest
    are the scanned ``xs``). JAX up to 0.10 names the counts (``num_consts``, ``num_carry``);
    later versions pack the inputs as ``(consts, carry, xs)`` in ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_dependence(eqn: Any, ins: list[bool]) -> list[bool]:
    """Which outputs of the ``scan`` equation ``eqn`` (carry, then stacked outputs) depend on its
    inputs flagged in ``ins``: the body analysed to a fixpoint over its carry."""
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = scan_layout(eqn.params)
    flags = list(ins)
    while True:
        outs = data_dependence(body, flags)
        grown = [a or b for a, b in zip(flags[consts : consts + carry], outs[:carry], strict=True)]
        if grown == flags[consts : consts + carry]:
            return outs
        flags[consts : consts + carry] = grown
