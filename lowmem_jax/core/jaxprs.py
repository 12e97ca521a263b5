"""Walking a traced step: every equation of a jaxpr, those nested in calls, loops,
conditionals, checkpoints and custom derivatives included; which values depend on which inputs
(nothing is compiled or run); a function with its checkpoints inlined."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

__all__ = [
    "equations",
    "traced_equations",
    "data_dependence",
    "scan_dependence",
    "scan_layout",
    "without_checkpoints",
    "host_memory_reads",
]


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


def host_memory_reads(jaxpr: Any) -> list[str]:
    """The equations that compute on the device from a value in host memory (an operand whose
    aval's ``memory_space`` is ``Host``), as ``"primitive"`` names: every equation but a move
    or a layout (``device_put``, ``sharding_constraint``), an ordering that passes values
    through unchanged (``optimization_barrier``), a call, loop or other equation that
    only passes values to a jaxpr of its own (whose equations are checked in turn), and the
    host's own computations (``compute_on``), which are not entered."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("device_put", "sharding_constraint", "optimization_barrier", "compute_on"):
            continue
        subs = [
            getattr(sub, "jaxpr", sub)
            for value in eqn.params.values()
            for sub in (value if isinstance(value, (tuple, list)) else (value,))
            if hasattr(getattr(sub, "jaxpr", sub), "eqns")
        ]
        if subs:
            for sub in subs:
                found += host_memory_reads(sub)
        elif any(getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
                 for v in eqn.invars):  # fmt: skip
            found.append(name)
    return found


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


# Equations whose parameters hold jaxprs that run inside the equation as ordinary code: their
# checkpoints are inlined too. Custom derivatives keep theirs (their rules were written for it).
_INLINED_INSIDE = ("pjit", "jit", "closed_call", "scan", "while", "cond")


def without_checkpoints(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every ``jax.checkpoint`` region (``nn.remat``, ``nnx.remat``, a remat
    policy's) evaluated in place, in loops, calls and conditionals too: the same values, and
    under ``jax.vjp`` the residuals the function saves without rematerialization."""

    def inlined(*args: Any) -> Any:
        flat, tree = jax.tree.flatten(args)
        closed, shape = jax.make_jaxpr(
            lambda *leaves: fn(*jax.tree.unflatten(tree, leaves)), return_shape=True
        )(*flat)
        outs = _eval_inlined(closed.jaxpr, closed.consts, flat)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return inlined


def _eval_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("checkpoint", "remat2"):
            body = eqn.params["jaxpr"]
            outs = _eval_inlined(getattr(body, "jaxpr", body), getattr(body, "consts", ()), ins)
        elif eqn.primitive.name == "shard_map" and _SHARD_MAP_PARAMS <= set(eqn.params):
            outs = _shard_map_inlined(eqn.params, ins)
        else:
            params = eqn.params
            if eqn.primitive.name in _INLINED_INSIDE:
                params = {k: _inlined_param(v) for k, v in params.items()}
            bind = eqn.primitive.get_bind_params(params)
            # JAX <= 0.6 returns (subfuns, params); later versions the params alone.
            subfuns, bind = bind if isinstance(bind, tuple) else ((), bind)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *ins, **bind)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


# What a shard_map equation is bound again from (JAX >= 0.7's names).
_SHARD_MAP_PARAMS = {"jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes"}


def _shard_map_inlined(params: dict, args: Sequence[Any]) -> list[Any]:
    """A ``shard_map`` equation evaluated with its body's checkpoints inlined (the body is
    traced again inside the same ``shard_map``, where its collectives' axes are bound)."""
    body = params["jaxpr"]
    outs = jax.shard_map(
        lambda *xs: tuple(_eval_inlined(body, (), xs)),
        mesh=params["mesh"],
        in_specs=params["in_specs"],
        out_specs=params["out_specs"],
        check_vma=params["check_vma"],
        axis_names=params["newly_manual_axes"],
    )(*args)
    return list(outs)


def _inlined_param(value: Any) -> Any:
    """A closed jaxpr parameter (or a tuple of them, ``cond``'s branches) with its checkpoints
    inlined, on the same input types; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_inlined_param(v) for v in value)
    if not (hasattr(value, "consts") and hasattr(value, "in_avals")):
        return value
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in value.in_avals]
    jaxpr = getattr(value, "jaxpr", value)
    return jax.make_jaxpr(lambda *xs: _eval_inlined(jaxpr, value.consts, xs))(*avals)
