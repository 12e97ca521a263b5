"""FLOPs of a function, counted from its jaxpr, and XLA's own estimate.

:func:`count_flops` counts ``2 * MACs`` of every matmul and convolution (not the zeros an
input dilation inserts) plus one per element of every other arithmetic op, dead code left out;
loop bodies are multiplied by their trip counts (``scan``), the larger branch of a ``cond`` is
taken, and remat recomputation is included (it is in the jaxpr of the gradient).
:func:`xla_flops` is XLA's ``cost_analysis()`` figure, which counts a loop body once (so it
under-counts scanned layers and microbatch loops).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent
from jax.extend import core as jex_core

__all__ = ["count_flops", "jaxpr_flops", "xla_flops"]

_FREE = {
    "reshape",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "transpose",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "concatenate",
    "stack",
    "pad",
    "gather",
    "scatter",
    "convert_element_type",
    "copy",
    "copy_p",
    "iota",
    "select_n",
    "rev",
    "stop_gradient",
    "name",
    "optimization_barrier",
    "random_bits",
    "random_wrap",
    "random_unwrap",
    "random_fold_in",
    "random_seed",
    "threefry2x32",
    "bitcast_convert_type",
    "device_put",
    "split",
    "pjit",
    "jit",
    "closed_call",
    "remat",
    "checkpoint",
    "scan",
    "while",
    "cond",
    "custom_vjp_call",
    "custom_jvp_call",
    "shard_map",
    "sharding_constraint",
}


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _eqn_flops(eqn) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        k = math.prod(lhs.shape[d] for d in lhs_contract)
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, spatial...)
        k = math.prod(rhs.shape[d] for d in spec[1:])  # C_in/groups x kernel window
        # The zeros an input dilation inserts (a strided conv's transpose) are not multiplied:
        # a window over an input dilated by d holds 1/d of real samples per axis.
        zeros = math.prod(eqn.params.get("lhs_dilation") or (1,))
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k / zeros
    if name in _FREE:
        return 0.0
    return float(sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))


def _jaxpr_flops(jaxpr, notes: set[str]) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(_sub_jaxprs(eqn))
        if name == "scan":
            total += eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr, notes)
        elif name == "cond":
            total += max(_jaxpr_flops(j, notes) for j in subs)
        elif name == "while":
            notes.add("a while loop's body was counted once (unknown trip count)")
            total += sum(_jaxpr_flops(j, notes) for j in subs)
        elif name in ("custom_vjp_call", "custom_jvp_call"):
            jaxpr_ = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            if jaxpr_ is not None:
                total += _jaxpr_flops(getattr(jaxpr_, "jaxpr", jaxpr_), notes)
        elif subs:
            total += sum(_jaxpr_flops(j, notes) for j in subs)
        else:
            total += _eqn_flops(eqn)
    return total


def count_flops(fn: Callable, *args) -> tuple[float, list[str]]:
    """FLOPs of one call of ``fn(*args)`` counted from its jaxpr (module docstring)."""
    return jaxpr_flops(jax.make_jaxpr(fn)(*args))


def jaxpr_flops(closed: jax.extend.core.ClosedJaxpr) -> tuple[float, list[str]]:
    """:func:`count_flops` of a jaxpr already traced (e.g. ``jax.jit(f).trace(*args).jaxpr``)."""
    notes: set[str] = set()
    jaxpr = closed.jaxpr
    # Dead code is not counted (XLA removes it too), e.g. a custom_vjp's gradient for an
    # input nothing differentiates: a model's first convolution's input gradient.
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return _jaxpr_flops(jaxpr, notes), sorted(notes)


def xla_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return None if flops is None else float(flops)
