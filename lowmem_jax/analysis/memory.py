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
    (:class:`~lowmem_jax.core.base.BlockwiseLeaf`) and counts one block; 0 when the parameters are
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
The analytic half lives in :mod:`lowmem_jax.analysis.analytic` (re-exported here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import optax

from lowmem_jax.analysis import collectives
from lowmem_jax.analysis.analytic import (
    _model_params,
    analytic_breakdown,
    dense_weight_bytes,
    host_resident_bytes,
    optimizer_breakdown,
    saved_activation_bytes,
    tree_bytes,
)
from lowmem_jax.analysis.flops import jaxpr_flops, xla_flops
from lowmem_jax.analysis.state import state_view
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.base import Optimizer, as_optimizer

PyTree = Any

__all__ = [
    "MemoryReport",
    "analyze",
    "xla_memory",
    "analysis_compiler_options",
    "analytic_breakdown",
    "saved_activation_bytes",
    "dense_weight_bytes",
    "optimizer_breakdown",
    "tree_bytes",
    "host_resident_bytes",
]


@dataclasses.dataclass
class MemoryReport:
    """The result of :func:`analyze`. ``to_dict()`` gives the JSON form.

    Attributes:
      config: what produced it (model, batch size, plan), as given.
      backend: JAX's backend name (``cpu``, ``gpu``, ``tpu``).
      param_count: number of parameters of the model (dense, also when stored compressed).
      xla: XLA's compiled figures in bytes (``source`` names the backend); with more than one
        device, ``collectives``: what the step sends between devices
        (:func:`lowmem_jax.analysis.collectives.collectives`), where it sends anything.
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


def analysis_compiler_options(backend: str | None = None) -> dict[str, Any]:
    """XLA options for a compile whose executable never runs (:func:`analyze`, the inspector).

    On XLA:CPU, LLVM at optimisation level 0 (``xla_backend_optimization_level=0``): XLA assigns
    buffers to the optimised HLO before it generates any code, so every byte figure is the
    default build's while the compile does less work (only the machine code, never run, is
    slower). Elsewhere ``{}``: a GPU's analysis compile also fills the persistent cache for the
    process that then runs and measures the same step. JAX's cache keys include these options,
    so such an executable is never handed to a run that compiles with the defaults.
    """
    cpu = (backend or jax.default_backend()) == "cpu"
    return {"xla_backend_optimization_level": 0} if cpu else {}


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
    host = {
        k: int(getattr(stats, f"host_{k}_size_in_bytes", 0))
        for k in ("argument", "output", "alias", "temp")
    }
    out["host_bytes"] = host if any(host.values()) else None
    return out


# Optimizer-state fields that only wrap another state: the slot is named by what is inside.
def analyze(
    train_step: Callable,
    state,
    batch: PyTree,
    *,
    loss_fn: Callable | None = None,
    plan: Plan | None = None,
    tx: optax.GradientTransformation | Optimizer | None = None,
    config: dict[str, Any] | None = None,
    compiling: contextlib.AbstractContextManager | None = None,
) -> MemoryReport:
    """Compiles ``train_step(state, batch)`` (never runs it) and reports its memory and FLOPs.

    For a step of :func:`lowmem_jax.make_train_step`, pass what it was made from (``loss_fn``,
    ``tx``, ``plan``); for a plain step of your own, ``loss_fn`` alone.

    Args:
      train_step: a jitted step or any function of ``(state, batch)``; a plain function is
        jitted here.
      state: the train state, concrete or abstract (``jax.eval_shape``): a
        :class:`~lowmem_jax.TrainState`, ``flax.training.train_state.TrainState``, a dict or
        any pytree with ``params`` (:func:`~lowmem_jax.analysis.state.state_view`).
      batch: the batch, concrete or ``jax.ShapeDtypeStruct`` leaves.
      loss_fn: the loss, for the analytic activation figure (``None`` leaves it out); cast to
        the plan's compute dtype as the step casts it.
      plan: the step's :class:`~lowmem_jax.Plan` (precision, microbatches); ``None``: fp32, one
        microbatch.
      tx: the step's optimizer (``plan.wrap_optimizer(...)`` or any optax transformation): how
        the parameters are stored; ``None``: as they are.
      config: recorded in the report as is.
      compiling: entered around XLA's compile (e.g. a semaphore: analyses in threads that
        trace and lower at once but compile one at a time).
    """
    state_view(state)  # a state without `params` is refused before the step is traced
    microbatches = 1 if plan is None else plan.microbatches
    if loss_fn is not None and plan is not None:
        loss_fn = plan.model_loss(loss_fn)
    step = train_step if hasattr(train_step, "trace") else jax.jit(train_step)
    traced = step.trace(state, batch)  # one trace for XLA and for the FLOPs count
    lowered = traced.lower()
    with compiling or contextlib.nullcontext():
        compiled = lowered.compile(analysis_compiler_options())
    xla = xla_memory(compiled)
    if jax.device_count() > 1:  # one device has nothing to send
        sent = collectives.collectives(compiled.as_text())
        if sent is not None:
            xla["collectives"] = sent
    analytic = analytic_breakdown(
        state=state,
        batch=batch,
        loss_fn=loss_fn,
        microbatches=microbatches,
        tx=tx,
        blocks_rematerialized=plan is not None and plan.remat.enabled,
    )
    flops, flop_notes = jaxpr_flops(traced.jaxpr)
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
