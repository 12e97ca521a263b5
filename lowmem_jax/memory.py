"""Compile-only memory analysis of a train step: XLA's figures and the report's breakdown.

:func:`analyze` lowers and compiles a train step for example inputs (``jax.ShapeDtypeStruct``
leaves are enough: nothing runs and no data is needed) and returns a :class:`MemoryReport`:

* ``xla``: what the compiled program allocates, from ``compiled.memory_analysis()``: argument,
  output, alias and temp bytes and ``total = argument + output + temp - alias`` (donated
  arguments are aliased to outputs and counted once). On XLA:CPU ``peak_memory_in_bytes`` leaves
  out temporaries, so ``total`` is the figure to compare. Source: ``XLA:<BACKEND>``.
* ``analytic``: the technical report's breakdown, by summing tensor sizes (source: ``analytic``):

  - **model**: the parameters as stored (by dtype);
  - **optimizer**: the gradients (one parameter-sized buffer in the parameter dtype), the
    float32 gradient accumulator when microbatching, and every optimizer slot that mirrors the
    parameters (momentum, Adam moments, ...), by slot name;
  - **activations**: the residuals one microbatch's forward pass saves for the backward pass
    (from ``jax.vjp``'s jaxpr, the mechanism behind ``saved_residuals``), excluding the
    parameters and inputs themselves; with remat, only what the policy saves;
  - **dense weights**: the dense weights the step builds from another stored form (compressed
    sparse storage), in the parameter dtype: every materialized leaf, except that with remat a
    leaf of stacked blocks is densified one block at a time inside the block's checkpoint
    (:class:`~lowmem_jax.base.BlockwiseLeaf`) and counts one block; 0 when the parameters are
    stored as the model sees them;
  - **inputs**: the batch;
  - **state**: everything else in the train state (BatchNorm statistics, loss scale, counters);
  - ``host_resident_bytes``: the part of the above whose sharding keeps it in host memory
    between steps (``Plan.optimizer_memory="pinned_host"``), not a separate part.

* ``flops``: counted from the step's jaxpr (``2 * MACs`` of every matmul and convolution plus one
  per element of every other arithmetic op; loop bodies multiplied by their trip counts, remat
  recomputation included), and XLA's own ``cost_analysis()`` figure, which counts a loop body
  once (so it under-counts scanned layers and microbatch loops).

The two views differ by design: XLA's temp bytes include transient buffers (the backward pass's
own intermediates, fusion scratch, the gradient being built) and reflect XLA's buffer reuse,
while the analytic view counts what must persist between the forward and the backward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

from lowmem_jax import remat
from lowmem_jax.base import BlockwiseLeaf, LazyLeaf, Optimizer, as_optimizer
from lowmem_jax.flops import count_flops, xla_flops
from lowmem_jax.plan import Plan

PyTree = Any

__all__ = [
    "MemoryReport",
    "analyze",
    "xla_memory",
    "analytic_breakdown",
    "saved_activation_bytes",
    "dense_weight_bytes",
    "tree_bytes",
    "host_resident_bytes",
]


def _nbytes(x) -> int:
    """Bytes of an array or abstract value; typed PRNG keys count as their key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree: PyTree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``ShapeDtypeStruct``)."""
    return sum(_nbytes(x) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def host_resident_bytes(tree: PyTree) -> int:
    """Bytes of the leaves of ``tree`` whose sharding names host memory (``pinned_host`` /
    ``unpinned_host``): what stays off the device between steps."""
    return sum(
        _nbytes(x)
        for x in jax.tree.leaves(tree)
        if "host" in str(getattr(getattr(x, "sharding", None), "memory_kind", None) or "")
    )


def _bytes_by_dtype(tree: PyTree) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        out[jnp.dtype(x.dtype).name] += _nbytes(x)
    return dict(out)


@dataclasses.dataclass
class MemoryReport:
    """The result of :func:`analyze`. ``to_dict()`` gives the JSON form.

    Attributes:
      config: what produced it (model, batch size, plan), as given.
      backend: JAX's backend name (``cpu``, ``gpu``, ``tpu``).
      param_count: number of parameters of the model (dense, also when stored compressed).
      xla: XLA's compiled figures in bytes (``source`` names the backend).
      analytic: the model / optimizer / activations / inputs / state breakdown in bytes.
      flops: FLOPs of one step counted from the jaxpr (source: analytic).
      flops_xla: XLA's ``cost_analysis()`` FLOPs (loop bodies counted once).
      notes: how to read the figures.
    """

    config: dict[str, Any]
    backend: str
    param_count: int
    xla: dict[str, Any]
    analytic: dict[str, Any]
    flops: float
    flops_xla: float | None
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def xla_memory(compiled) -> dict[str, Any]:
    """XLA's compiled memory figures in bytes, with ``total_bytes`` and ``source``.

    ``total_bytes = argument + output + temp - alias``: what the compiled step needs at once,
    by XLA's buffer assignment (a compile-time figure, not a runtime measurement).
    ``heap_peak_bytes``: XLA's heap-simulator peak of the module's buffers where the backend
    defines it for the whole step (GPU, TPU); ``None`` on CPU, whose figure covers only part of
    the buffers and is far below ``total_bytes``.
    """
    stats = compiled.memory_analysis()
    backend = jax.default_backend()
    out = {
        "source": f"XLA:{backend.upper()}",
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
    }
    out["total_bytes"] = (
        out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    )
    peak = int(getattr(stats, "peak_memory_in_bytes", 0)) if backend != "cpu" else 0
    out["heap_peak_bytes"] = peak or None
    out["generated_code_bytes"] = int(stats.generated_code_size_in_bytes) or None
    host = {
        k: int(getattr(stats, f"host_{k}_size_in_bytes", 0))
        for k in ("argument", "output", "alias", "temp")
    }
    out["host_bytes"] = host if any(host.values()) else None
    return out


# Optimizer-state fields that only wrap another state: the slot is named by what is inside.
_WRAPPERS = {"inner", "inner_state", "inner_states"}


def _slot_name(path) -> str:
    names = [getattr(k, "name", None) or getattr(k, "key", None) for k in path]
    names = [str(n) for n in names if n is not None and not isinstance(n, int)]
    names = [n for n in names if n not in _WRAPPERS]
    if len(names) > 1 and names[-1] == "scales":  # a quantized slot's scales (optimizer_state)
        return f"{names[0]} scales"
    return names[0] if names else "state"


def optimizer_breakdown(
    params: PyTree, opt_state: PyTree, microbatches: int = 1, model_params: PyTree | None = None
) -> dict[str, int]:
    """Bytes of gradients, accumulator and optimizer state (see the module docstring).

    The gradient (and the float32 accumulator when microbatching) has the shape of the
    parameters the model sees, ``model_params`` (default ``params``): with compressed sparse
    storage that is the dense, transient layout, not the stored values -- unless the step
    differentiates w.r.t. the stored parameters (pass ``model_params=None`` then).
    """
    grad_params = params if model_params is None else model_params
    out = {"gradients": tree_bytes(grad_params)}
    if microbatches > 1:
        out["gradient_accumulator"] = sum(
            int(np.prod(x.shape, dtype=np.int64)) * 4 for x in jax.tree.leaves(grad_params)
        )
    slots: dict[str, int] = defaultdict(int)
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if hasattr(leaf, "shape"):
            slots[_slot_name(path)] += _nbytes(leaf)
    for name, nbytes in slots.items():
        out[f"slot:{name}"] = nbytes
    return out


def saved_activation_bytes(
    loss_fn: Callable, params: PyTree, model_state: PyTree, batch: PyTree, rng
) -> dict[str, Any]:
    """Residuals saved by one forward pass of ``loss_fn`` for the gradient w.r.t. ``params``.

    ``loss_fn(params, model_state, batch, rng) -> (loss, aux)``; inputs may be abstract. Returns
    ``{"bytes", "count", "largest": [(shape, dtype, source), ...]}``; residuals that are the
    arguments themselves (parameters, inputs) are not counted: they are already in memory.
    """
    leaves, tree = jax.tree.flatten((model_state, batch, rng))

    def vjp_wrt_params(p, *leaves):
        # Only the parameters are differentiated; the rest is closed over, so a residual that
        # is an input (the batch) stays recognisable as one of the jaxpr's arguments.
        s, b, r = jax.tree.unflatten(tree, leaves)
        return jax.vjp(lambda p_: loss_fn(p_, s, b, r), p)

    closed, out_shape = jax.make_jaxpr(vjp_wrt_params, return_shape=True)(params, *leaves)
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(out_shape[1]))
    residuals = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    invars = set(jaxpr.invars)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    # Values that depend on no input (e.g. the zeros relu's derivative selects from) are
    # constants XLA folds into the consumer: not stored, not counted.
    dynamic = set(invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in dynamic for v in eqn.invars):
            dynamic.update(eqn.outvars)
    seen, total, items = set(), 0, []
    for v in residuals:
        if isinstance(v, jex_core.Literal) or v in invars or v not in dynamic or v in seen:
            continue
        seen.add(v)
        nbytes = _nbytes(v.aval)
        total += nbytes
        eqn = producers.get(v)
        items.append((nbytes, str(v.aval.str_short()), eqn.primitive.name if eqn else "const"))
    items.sort(reverse=True)
    return {"bytes": total, "count": len(items), "largest": items[:60]}


def dense_weight_bytes(
    state, tx: optax.GradientTransformation | Optimizer, blocks_rematerialized: bool = False
) -> int:
    """Bytes of the dense weights the step builds from the stored ``state.params`` (see the
    module docstring): the leaves ``tx``'s materialization makes that are not stored leaves.

    A leaf the materialization hands out blockwise (when the step differentiates w.r.t. the
    stored parameters, :func:`~lowmem_jax.base.differentiated_loss`) counts one block when
    ``blocks_rematerialized`` (the block loop densifies it inside each block's checkpoint), else
    whole (:class:`~lowmem_jax.ScannedBlocks` densifies it before a loop without remat). A
    ``blocks:`` schedule is counted as rematerialized in every stack."""
    opt = as_optimizer(tx)
    total = 0

    def count(params, opt_state):
        nonlocal total
        stored = {id(x) for x in jax.tree.leaves(params)}
        dense = opt.materialize(params, opt_state, blockwise=opt.grads_wrt_stored)
        for x in jax.tree.leaves(dense, is_leaf=lambda x: isinstance(x, BlockwiseLeaf | LazyLeaf)):
            if isinstance(x, BlockwiseLeaf):
                blocks = 1 if blocks_rematerialized else x.shape[0]
                total += blocks * math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize
            elif isinstance(x, LazyLeaf):  # built where a layer reads it: counted whole
                total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            elif id(x) not in stored:
                total += _nbytes(x)
        return 0

    jax.eval_shape(count, state.params, _opt_state(state))
    return total


def _model_params(state, opt: Optimizer) -> PyTree:
    """Shapes of the parameters the model sees (``opt``'s materialized ``state.params``)."""
    return jax.eval_shape(opt.materialize, state.params, _opt_state(state))


def _opt_state(state) -> PyTree:
    return getattr(state, "opt_state", ())


def analytic_breakdown(
    *,
    state,
    batch: PyTree,
    loss_fn: Callable | None = None,
    microbatches: int = 1,
    tx: optax.GradientTransformation | Optimizer | None = None,
    blocks_rematerialized: bool = False,
) -> dict[str, Any]:
    """The report's model / optimizer / activations / dense weights / inputs breakdown, in
    bytes.

    ``state``: a :class:`~lowmem_jax.TrainState` (or its ``jax.eval_shape``), or any pytree
    state with a ``params`` attribute (``flax.training.train_state.TrainState`` too): its
    ``opt_state``, ``model_state`` and ``rng`` are used where it has them; **state** counts
    every leaf that is neither parameter nor optimizer state. ``loss_fn`` is the loss the step
    differentiates, ``loss_fn(params, model_state, batch, rng)``, in the compute dtype
    (``precision.cast_loss_fn``); without it the activation figure is ``None``. ``tx``: the
    step's optimizer; when it stores the parameters in another form than the model sees
    (compressed sparse storage), the activations are those of the materialized parameters and
    the gradients (and accumulator) take the stored or the model's layout as the step does
    (:attr:`~lowmem_jax.base.Optimizer.grads_wrt_stored`). The model figure always counts the
    stored ``state.params``. ``blocks_rematerialized``: see :func:`dense_weight_bytes`.
    """
    opt = as_optimizer(optax.identity() if tx is None else tx)
    model_params = _model_params(state, opt)
    opt_state = _opt_state(state)
    optimizer = optimizer_breakdown(
        state.params,
        opt_state,
        microbatches,
        state.params if opt.grads_wrt_stored else model_params,
    )
    activations = None
    if loss_fn is not None:
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // microbatches,) + x.shape[1:], x.dtype),
            batch,
        )
        activations = saved_activation_bytes(
            loss_fn,
            model_params,
            getattr(state, "model_state", {}),
            micro,
            getattr(state, "rng", None),
        )
    out = {
        "source": "analytic",
        "model_bytes": tree_bytes(state.params),
        "model_bytes_by_dtype": _bytes_by_dtype(state.params),
        "optimizer_bytes": sum(optimizer.values()),
        "optimizer_breakdown": optimizer,
        "activation_bytes": None if activations is None else activations["bytes"],
        "activation_residuals": activations,
        "dense_weight_bytes": dense_weight_bytes(state, opt, blocks_rematerialized),
        "input_bytes": tree_bytes(batch),
        "state_bytes": tree_bytes(state) - tree_bytes((state.params, opt_state)),
        "host_resident_bytes": host_resident_bytes(state),
    }
    parts = (
        "model_bytes",
        "optimizer_bytes",
        "activation_bytes",
        "dense_weight_bytes",
        "input_bytes",
        "state_bytes",
    )
    out["total_bytes"] = sum(out[k] or 0 for k in parts)
    return out


def analyze(
    train_step: Callable,
    state,
    batch: PyTree,
    *,
    loss_fn: Callable | None = None,
    plan: Plan | None = None,
    tx: optax.GradientTransformation | Optimizer | None = None,
    config: dict[str, Any] | None = None,
) -> MemoryReport:
    """Compiles ``train_step(state, batch)`` (never runs it) and reports its memory and FLOPs.

    For a step of :func:`lowmem_jax.make_train_step`, pass what it was made from (``loss_fn``,
    ``tx``, ``plan``); for a plain step of your own, ``loss_fn`` alone.

    Args:
      train_step: a jitted step or any function of ``(state, batch)``; a plain function is
        jitted here.
      state: the train state, concrete or abstract (``jax.eval_shape``): a
        :class:`~lowmem_jax.TrainState` or any pytree with ``params`` (see
        :func:`analytic_breakdown`).
      batch: the batch, concrete or ``jax.ShapeDtypeStruct`` leaves.
      loss_fn: the loss, for the analytic activation figure (``None`` leaves it out); cast to
        the plan's compute dtype as the step casts it.
      plan: the step's :class:`~lowmem_jax.Plan` (precision, microbatches); ``None``: fp32, one
        microbatch.
      tx: the step's optimizer (``plan.wrap_optimizer(...)`` or any optax transformation): how
        the parameters are stored; ``None``: as they are.
      config: recorded in the report as is.
    """
    microbatches = 1 if plan is None else plan.microbatches
    if loss_fn is not None and plan is not None:
        loss_fn = plan.model_loss(loss_fn)
    step = train_step if hasattr(train_step, "lower") else jax.jit(train_step)
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    xla = xla_memory(compiled)
    analytic = analytic_breakdown(
        state=state,
        batch=batch,
        loss_fn=loss_fn,
        microbatches=microbatches,
        tx=tx,
        blocks_rematerialized=plan is not None and remat.parse_policy(plan.remat).enabled,
    )
    flops, flop_notes = count_flops(getattr(step, "__wrapped__", step), state, batch)
    notes = [
        "xla.total_bytes = argument + output + temp - alias (donated state counted once)",
        "flops: counted from the jaxpr, loop bodies times their trip count; flops_xla: XLA's "
        "cost_analysis, which counts a loop body once",
        *flop_notes,
    ]
    if xla["source"] == "XLA:CPU":
        notes.append(
            "XLA:CPU computes bfloat16 convolutions in float32 (with converts), so bf16 shrinks "
            "parameter bytes but not temp bytes here (fp16 does); measure half-precision "
            "activation savings on a GPU"
        )
    if analytic["host_resident_bytes"] and xla["host_bytes"] is None:
        notes.append(
            f"{analytic['host_resident_bytes']} bytes of the state are placed in host memory; "
            f"{xla['source']} keeps one memory space and counts them in argument/output bytes "
            "(a GPU reports them as host_bytes)"
        )
    model_params = _model_params(state, as_optimizer(optax.identity() if tx is None else tx))
    return MemoryReport(
        config=dict(config or {}),
        backend=jax.default_backend(),
        param_count=int(sum(math.prod(x.shape) for x in jax.tree.leaves(model_params))),
        xla=xla,
        analytic=analytic,
        flops=flops,
        flops_xla=xla_flops(compiled),
        notes=notes,
    )
