"""Compressed activations: the residuals a backward pass needs, stored in fewer bits.

A function's VJP keeps *residuals*: values of the forward pass the backward pass reads (a
layer's input for its weight gradient, a normalisation's centred input, an activation
function's argument). :func:`compress_residuals` makes ``fn``'s forward pass exact and stores
each of those residuals that is an *activation* (it depends on the data arguments) compressed;
the backward pass decompresses each one and runs ``fn``'s own VJP on it. Nothing is recomputed.
This is ActNN's activation-compressed training (Chen et al., ICML 2021), done on the residuals
JAX's autodiff keeps rather than per layer type, so it applies to any model.

Formats (:func:`parse_spec`, ``Plan(activations=...)``):

=========  ===============================================================================
``none``   residuals as the forward pass made them
``bf16``   float32 residuals rounded to bfloat16 (nearest even); 16-bit ones kept
``int8``   ``b = 8``, ``4``, ``2`` bits per element: each group of ``G = 256`` consecutive
``int4``   elements (of the flattened residual) keeps its minimum ``z`` and range ``r`` (float32)
``int2``   and codes ``q = SR((x - z) / r * (2^b - 1))`` in ``[0, 2^b - 1]``; decompressed as
           ``z + q * r / (2^b - 1)``. ``SR`` is ActNN's stochastic rounding (``floor(v + u)``,
           ``u ~ U[0, 1)``: unbiased, ``E[x_hat] = x``; error below one step ``r / (2^b - 1)``)
=========  ===============================================================================

A suffix ``:nearest`` (e.g. ``int8:nearest``) rounds to nearest instead (error below half a
step, biased): a named departure from ActNN. The noise ``u`` is a counter-based hash of each
element's bits and position (``lowbias32``), not a PRNG stream: no key is threaded through the
model, the step stays deterministic, and the noise differs between elements and between steps
whenever the values do.

A compressed residual is one ``uint8`` (``int*``) or ``uint16`` (``bf16``) array: ``int*``
rows of ``[z, r as 8 bytes | G * b / 8 bytes of packed codes]``, one row per group. Being
unsigned integers, compressed residuals are never compressed again by an enclosing
:func:`compress_residuals` (nesting is safe: the inner one's residuals pass through).

Which residuals are compressed: floating residuals of at least ``min_size`` elements that depend
on the arguments in ``data_argnums`` (a dataflow pass over the traced VJP; through ``scan``
bodies, other nested jaxprs conservatively) and are not themselves an argument (the caller
keeps those alive anyway). Parameters, their casts and anything computed from them alone stay
as they are: the input gradient of a linear layer uses the exact weights; only weight
gradients and the gradients through nonlinearities see the compression error.

Scanned stacks (:class:`~lowmem_jax.ScannedBlocks`) compress per block inside the loop while a
:func:`compress_residuals` is tracing around them (:func:`active_spec`), so the backward loop
decompresses one block's residuals at a time; a model's own ``nn.scan`` / ``nnx.scan`` gets
its stacked residuals compressed, decompressed whole when the backward pass starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from lowmem_jax import remat as remat_lib

__all__ = [
    "FORMATS",
    "ActivationSpec",
    "parse_spec",
    "compress",
    "decompress",
    "compress_residuals",
    "compress_activation",
    "compiler_options",
    "active_spec",
    "residual_report",
    "ResidualReport",
]

#: The formats ``Plan(activations=...)`` accepts (each int one also as ``NAME:nearest``).
FORMATS = ("none", "bf16", "int8", "int4", "int2")

_BITS = {"int8": 8, "int4": 4, "int2": 2}
_HEADER = 8  # bytes per group: the minimum and the range, float32 each


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """A parsed activation format.

    Attributes:
      name: the format string it was parsed from.
      kind: ``"none"``, ``"bf16"`` or ``"int"``.
      bits: bits per code (``int``: 8, 4 or 2; ``bf16``: 16; ``none``: 0).
      stochastic: stochastic rounding (ActNN's rule) rather than to nearest.
      group_size: elements per group sharing a minimum and range.
      min_size: residuals with fewer elements are kept as they are.
    """

    name: str
    kind: str
    bits: int = 0
    stochastic: bool = True
    group_size: int = 256
    min_size: int = 1024

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def stored_bytes(self, size: int, itemsize: int) -> int:
        """Bytes of one compressed residual of ``size`` elements of ``itemsize`` bytes."""
        if self.kind == "bf16":
            return size * min(itemsize, 2)
        if self.kind == "bits":
            return -(-size // 8)
        groups = -(-size // self.group_size)
        return groups * (_HEADER + self.group_size * self.bits // 8)


#: Boolean residuals (masks), one bit per element: exact.
_MASK = ActivationSpec("bits", "bits", bits=1, stochastic=False)


def parse_spec(name: str | ActivationSpec) -> ActivationSpec:
    """Parses an activation format (see the module docstring).

    Raises:
      ValueError: naming ``activations`` and the allowed values.
    """
    if isinstance(name, ActivationSpec):
        return name
    base, _, option = name.partition(":") if isinstance(name, str) else (None, "", "")
    if base == "none" and not option:
        return ActivationSpec(name, "none")
    if base == "bf16" and not option:
        return ActivationSpec(name, "bf16", bits=16, stochastic=False)
    if base in _BITS and option in ("", "nearest"):
        return ActivationSpec(name, "int", bits=_BITS[base], stochastic=option != "nearest")
    raise ValueError(
        f"Unknown activations={name!r}; allowed values: {list(FORMATS)} "
        "(an int format also as NAME:nearest, e.g. int8:nearest)"
    )


# --- one array --------------------------------------------------------------------------------


def _uniform_noise(x: jax.Array) -> jax.Array:
    """``u`` in ``[0, 1)`` per element of flat float ``x``: the ``lowbias32`` hash of the
    element's float32 bits xor its position times the golden ratio."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    h = bits ^ (lax.iota(jnp.uint32, x.size) * jnp.uint32(0x9E3779B9))
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def compress(x: jax.Array, spec: ActivationSpec | str) -> jax.Array:
    """``x`` (any shape, floating) in ``spec``'s format: ``uint16[x.shape]`` for ``bf16``;
    ``uint8[groups, 8 + G * b / 8]`` for ``int*`` (``groups = ceil(x.size / G)``; the last
    group is padded by repeating ``x``'s last element, which leaves its range as it is).
    :func:`decompress` inverts it."""
    spec = parse_spec(spec)
    if spec.kind == "bf16":
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    if spec.kind == "bits":
        flat = x.reshape(-1).astype(jnp.uint8)
        flat = jnp.pad(flat, (0, -flat.size % 8))
        return _pack(flat.reshape(-1, 1, 8), 1).reshape(-1)
    if spec.kind != "int":
        raise ValueError(f"activations={spec.name!r} stores nothing compressed")
    g, levels = spec.group_size, (1 << spec.bits) - 1
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % g
    if pad:
        flat = jnp.concatenate([flat, jnp.broadcast_to(flat[-1], (pad,))])
    groups = flat.reshape(-1, g)
    noise = _uniform_noise(flat).reshape(groups.shape) if spec.stochastic else jnp.float32(0.5)
    lo = groups.min(axis=1, keepdims=True)
    span = groups.max(axis=1, keepdims=True) - lo
    scale = jnp.where(span > 0, levels / jnp.where(span > 0, span, 1.0), 0.0)
    codes = jnp.clip(jnp.floor((groups - lo) * scale + noise), 0, levels).astype(jnp.uint8)
    if spec.bits < 8:
        codes = _pack(codes.reshape(codes.shape[0], -1, 8 // spec.bits), spec.bits)
    header = lax.bitcast_convert_type(jnp.concatenate([lo, span], axis=1), jnp.uint8)
    return jnp.concatenate([header.reshape(header.shape[0], _HEADER), codes], axis=1)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """``uint8[rows, n, 8 / bits]`` codes of ``bits`` bits each -> ``uint8[rows, n]`` (code
    ``i`` of a byte in bits ``[bits * i, bits * (i + 1))``)."""
    out = codes[..., 0]
    for i in range(1, codes.shape[-1]):
        out = out | (codes[..., i] << jnp.uint8(bits * i))
    return out


def decompress(
    stored: jax.Array, shape: Sequence[int], dtype: Any, spec: ActivationSpec | str
) -> jax.Array:
    """The ``dtype[shape]`` array :func:`compress` stored in ``stored``."""
    spec = parse_spec(spec)
    if spec.kind == "bf16":
        return lax.bitcast_convert_type(stored, jnp.bfloat16).astype(dtype)
    if spec.kind == "bits":
        bits = [(stored >> jnp.uint8(i)) & jnp.uint8(1) for i in range(8)]
        size = int(np.prod(shape))
        return jnp.stack(bits, axis=1).reshape(-1)[:size].reshape(shape).astype(dtype)
    levels = (1 << spec.bits) - 1
    header = lax.bitcast_convert_type(stored[:, :_HEADER].reshape(-1, 2, 4), jnp.float32)
    lo, span = header[:, :1], header[:, 1:]
    packed = stored[:, _HEADER:]
    per_byte = 8 // spec.bits
    if per_byte > 1:
        mask = jnp.uint8(levels)
        parts = [(packed >> jnp.uint8(spec.bits * i)) & mask for i in range(per_byte)]
        packed = jnp.stack(parts, axis=2).reshape(packed.shape[0], -1)
    flat = lo + packed.astype(jnp.float32) * (span / levels)
    size = int(np.prod(shape))
    return flat.reshape(-1)[:size].reshape(shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def compress_activation(x: jax.Array, spec: ActivationSpec) -> jax.Array:
    """:func:`compress` as :func:`compress_residuals` calls it: a named call, so that a traced
    step shows each compressed residual (an equation named ``compress_activation``)."""
    return compress(x, spec)


def compiler_options(spec: ActivationSpec | str, backend: str | None = None) -> dict[str, str]:
    """XLA options under which compressed residuals take effect on ``backend``: the
    optimization barriers that keep XLA from decompressing in the forward pass (or fusing the
    compression into the backward pass) must survive, which on CPU is remat's option
    (:func:`lowmem_jax.remat.compiler_options`); ``{}`` for ``none``."""
    return remat_lib.compiler_options("full" if parse_spec(spec).enabled else "none", backend)


# --- a function's residuals -------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[ActivationSpec | None] = contextvars.ContextVar(
    "lowmem_activations", default=None
)


def active_spec() -> ActivationSpec | None:
    """The format of the :func:`compress_residuals` whose forward pass is being traced (``None``
    outside one): a model's loop may compress per iteration with it."""
    return _ACTIVE.get()


@contextlib.contextmanager
def _active(spec: ActivationSpec) -> Iterator[None]:
    token = _ACTIVE.set(spec)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _depends(jaxpr: Any, data: Sequence[bool]) -> list[bool]:
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
            outs = _scan_depends(eqn, ins)
        elif name == "optimization_barrier":
            outs = ins
        elif sub is not None:
            outs = _depends(sub, ins)
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


def _scan_depends(eqn: Any, ins: list[bool]) -> list[bool]:
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    flags = list(ins)
    while True:
        outs = _depends(body, flags)
        grown = [a or b for a, b in zip(flags[consts : consts + carry], outs[:carry], strict=True)]
        if grown == flags[consts : consts + carry]:
            return outs
        flags[consts : consts + carry] = grown


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


def _store(x: jax.Array, action: Any, spec: ActivationSpec) -> Any:
    if action == "compress":
        return compress_activation(x, spec)
    if action == "bits":
        return compress_activation(x, _MASK)
    if action is not None:
        return None  # a fill
    return x


def _load(stored: Any, action: Any, shape: Any, dtype: Any, spec: ActivationSpec) -> jax.Array:
    if action == "compress":
        return decompress(stored, shape, dtype, spec)
    if action == "bits":
        return decompress(stored, shape, dtype, _MASK)
    if action is not None:
        return jnp.full(shape, action[1], dtype)
    return stored


def _plan_residuals(fn, args, data_argnums, spec, *, keep_arguments=True, active=True):
    """Traces ``fn``'s VJP once (``active``: with :func:`active_spec` set, so that loops inside
    compress per iteration): ``(closed jaxpr of flat args -> out leaves + residual leaves,
    {"out", "res": trees, "n_out": count, "inputs": which residuals are arguments}, which
    residuals to compress)``."""
    flat, in_tree = jax.tree.flatten(args)
    trees = {}

    def run(*leaves):
        out, vjp_fn = jax.vjp(fn, *jax.tree.unflatten(in_tree, leaves))
        out_leaves, trees["out"] = jax.tree.flatten(out)
        res, trees["res"] = jax.tree.flatten(vjp_fn)
        trees["n_out"] = len(out_leaves)
        return out_leaves + res

    with _active(spec) if active else contextlib.nullcontext():
        closed = jax.make_jaxpr(run)(*flat)
    jaxpr = closed.jaxpr
    arg_of = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    data = [i in data_argnums for i in arg_of]
    depends = _depends(jaxpr, data)[trees["n_out"] :]
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
    return closed, trees, chosen


def compress_residuals(
    fn: Callable[..., Any],
    spec: ActivationSpec | str,
    *,
    data_argnums: Sequence[int] = (0,),
    keep_arguments: bool = True,
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

    Returns:
      ``fn`` under a ``jax.custom_vjp``: forward values bitwise equal to ``fn``'s, gradients
      computed by ``fn``'s VJP from the decompressed residuals. Each call traces ``fn``'s VJP
      once more (to find its residuals) when it is differentiated.
    """
    spec = parse_spec(spec)
    if not spec.enabled:
        return fn
    data_argnums = tuple(data_argnums)

    def call(*args):
        # One custom_vjp per call: its forward pass leaves the residuals' structure here for
        # its own backward pass.
        saved: dict[str, Any] = {}

        @jax.custom_vjp
        def wrapped(*args):
            return fn(*args)

        def forward(*args):
            closed, trees, chosen = _plan_residuals(
                fn, args, data_argnums, spec, keep_arguments=keep_arguments
            )
            values = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
            out_leaves, res = values[: trees["n_out"]], values[trees["n_out"] :]
            stored = [_store(r, c, spec) for r, c in zip(res, chosen, strict=True)]
            saved.update(trees=trees, chosen=chosen, avals=[(r.shape, r.dtype) for r in res])
            # The outputs wait for the compressed residuals: else XLA may compress late (the
            # float residuals kept meanwhile) or fuse the compression into the backward pass's
            # decompression (one fusion reading the float residual, kept until then).
            # Only the compressed ones: a residual passed through as it is (a block's weights)
            # must stay the very array, which a loop then recognises as its input and does not
            # stack a copy of.
            packed = [i for i, c in enumerate(chosen) if c in ("compress", "bits")]
            out_leaves, barred = lax.optimization_barrier((out_leaves, [stored[i] for i in packed]))
            for i, x in zip(packed, barred, strict=True):
                stored[i] = x
            return jax.tree.unflatten(trees["out"], out_leaves), stored

        def backward(stored, cotangent):
            trees, chosen, avals = saved["trees"], saved["chosen"], saved["avals"]
            # Decompressed when the backward pass reaches this function, not hoisted earlier.
            packed = [i for i, c in enumerate(chosen) if c in ("compress", "bits")]
            barred, cotangent = lax.optimization_barrier(([stored[i] for i in packed], cotangent))
            stored = list(stored)
            for i, x in zip(packed, barred, strict=True):
                stored[i] = x
            res = [
                _load(s, c, shape, dtype, spec)
                for s, c, (shape, dtype) in zip(stored, chosen, avals, strict=True)
            ]
            return tuple(jax.tree.unflatten(trees["res"], res)(cotangent))

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
        if action == "compress" and spec.enabled:
            return spec.stored_bytes(aval.size, aval.dtype.itemsize)
        if action == "bits" and spec.enabled:
            return _MASK.stored_bytes(aval.size, 1)
        return aval.size * aval.dtype.itemsize

    plain = residuals(active=False)
    stored = residuals(active=True) if spec.enabled else plain
    return ResidualReport(
        count=len(plain),
        plain_bytes=sum(nbytes(a, None) for a, _ in plain),
        stored_bytes=sum(nbytes(a, c) for a, c in stored),
    )
