"""The hook groups of a :class:`~lowmem_jax.core.technique.Technique`, by what they act on: the
model (:class:`ModelHooks`), the optimizer (:class:`OptimizerHooks`), the step
(:class:`StepHooks`), the state's layout over devices (:class:`LayoutHooks`), a workload and a
run (:class:`WorkloadHooks`, :class:`WarmStart`) and what it reports (:class:`ReportHooks`,
whose verdict reads :class:`Evidence` and gives a :class:`Verdict`). Every hook is optional.

``plan`` below is a :class:`lowmem_jax.Plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from lowmem_jax.core.jaxprs import equations
from lowmem_jax.core.report_hooks import GridContext, ReportRow, ReportSection

__all__ = [
    "ModelHooks",
    "OptimizerHooks",
    "StepHooks",
    "LayoutHooks",
    "WorkloadHooks",
    "WarmStart",
    "ReportHooks",
    "Evidence",
    "Verdict",
]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a technique the plan turns on changed the step, and the evidence.

    Attributes:
      technique: the technique's name.
      took_effect: ``False`` where the setting is on but the step is as without it (e.g. an
        int8 state whose every leaf is under the size that gets quantized).
      evidence: what was found, in one line (counts, bytes, dtypes).
    """

    technique: str
    took_effect: bool
    evidence: str


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a compiled-step check looks at (nothing is run).

    Attributes:
      state: the train state (arrays or ``jax.ShapeDtypeStruct``).
      batch: the batch (arrays or shapes).
      tx: the step's optimizer (an ``lm.Optimizer``).
      jaxpr: the step's jaxpr (``jax.make_jaxpr(step)(state, batch).jaxpr``).
      saved_residuals: ``saved_residuals(checkpoints: bool) -> bytes | None``: what one
        microbatch's forward pass saves for the backward pass (analytic), with the step's
        ``jax.checkpoint`` regions or with them inlined (no rematerialization; ``None`` where
        one sits inside a custom derivative, whose rule cannot be rewritten); ``None`` where
        the caller gave no loss (:func:`lowmem_jax.analysis.verdicts`).
    """

    state: Any
    batch: Any
    tx: Any
    jaxpr: Any
    saved_residuals: Callable[[bool], int | None] | None = None

    def equations(self) -> list[Any]:
        """Every equation of the step, those of nested jaxprs (loops, conds, checkpoints,
        custom derivatives) included, with the number of enclosing loops: ``(eqn, depth)``."""
        return list(equations(self.jaxpr))


Hook = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """What a technique does to the model.

    Attributes:
      configure: ``configure(model, plan) -> model``: the model (Linen or NNX) with the
        technique's settings (:meth:`Plan.configure_model`, in the registry's order).
      block: ``block(plan) -> BlockHook | None``: what the technique does to each stack of
        blocks (:class:`~lowmem_jax.blocks.hooks.BlockHook`), made afresh each time the step's
        loss is traced and active while it is (:meth:`Plan.model_loss`); ``None`` where the
        plan leaves it off.
    """

    configure: Hook | None = None
    block: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class OptimizerHooks:
    """What a technique does to the optimizer (:meth:`Plan.wrap_optimizer`): each
    ``(tx, plan, params) -> tx`` (``params``: the model's parameters, arrays or shapes, or
    ``None``).

    Attributes:
      inner: around the user's optax transformation, innermost (e.g. its state's float format);
        every technique's ``inner`` applies before any ``wrap``.
      wrap: around the optimizer so far (e.g. sparse training around it).
    """

    inner: Callable[[Any, Any, Any], Any] | None = None
    wrap: Callable[[Any, Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What a technique does to the train step (:func:`lowmem_jax.make_train_step`), each
    ``(fn, plan) -> fn``, folded in the registry's order.

    Attributes:
      loss: the model's loss ``loss_fn(params, model_state, batch, rng) -> (loss, (model state,
        metrics))``, on the parameters the model sees (e.g. cast to the compute dtype).
      stored_loss: the loss as differentiated, on what the gradient is taken w.r.t. (e.g. the
        parameters gathered from their partitions).
      grad_fn: ``grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)``
        (e.g. accumulated over microbatches).
      apply: ``apply(params, updates, rng) -> params``, the stored parameters updated
        (``optax.apply_updates``; e.g. rounded stochastically to their dtype), ``rng`` the
        step's key; not for an optimizer that applies its updates itself.
      step: ``step(state, batch) -> (state, metrics)``, traced inside ``jit`` (e.g. the state's
        layout over a mesh on the way in and out).
      compiler_options: ``compiler_options(plan) -> {option: value}``: XLA options the jitted
        step needs (:meth:`Plan.compiler_options` joins them).
    """

    loss: Hook | None = None
    stored_loss: Hook | None = None
    grad_fn: Hook | None = None
    apply: Hook | None = None
    step: Hook | None = None
    compiler_options: Callable[[Any], dict[str, str]] | None = None


@dataclasses.dataclass(frozen=True)
class LayoutHooks:
    """Where a technique puts the step over devices and memories.

    Attributes:
      mesh_axis: ``mesh_axis(plan) -> (name, size) | None``: the axis of the device mesh the
        technique lays the step out along (:meth:`Plan.mesh` is one mesh with every
        technique's axis; a size of ``0``: the visible devices the other axes leave).
      state_shardings: ``state_shardings(state, plan) -> shardings | None``: where the train
        state's leaves live over :meth:`Plan.mesh` (arrays or shapes in, a matching tree of
        shardings out; :meth:`Plan.state_shardings` merges the techniques' per leaf).
      one_device: ``one_device(plan) -> {field: value}``: the settings that put the plan's
        step on one device, for a comparison (``{}`` where it runs on one).
      host_devices: ``host_devices(args)`` asks XLA:CPU for the host devices the technique's
        command-line flags need; the CLI calls it before JAX starts.
    """

    mesh_axis: Callable[[Any], tuple[str, int] | None] | None = None
    state_shardings: Callable[[Any, Any], Any] | None = None
    one_device: Callable[[Any], dict[str, Any]] | None = None
    host_devices: Callable[[argparse.Namespace], None] | None = None


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Starting a run from another model's trained variables (``lowmem train
    --decompose-from DIR``: the training loop restores them and asks the technique).

    Attributes:
      check: ``check(plan, source)`` raises ``ValueError`` in one line where the run's plan
        and its ``source`` (a checkpoint directory, or ``None``) do not go together (the
        technique needs one, or a source is given with the technique off).
      plan: ``plan(work, plan, variables) -> plan``: the plan with what it reads from the
        trained ``variables`` (``{"params": ..., <collections>}``), e.g. ranks.
      variables: ``variables(setup, variables) -> variables``: the built step's model's
        variables made from the trained ones (e.g. decomposed), for its first state.
      describe: ``describe(plan) -> words`` for the run's log line.
    """

    check: Callable[[Any, str | None], None]
    plan: Callable[[Any, Any, Any], Any]
    variables: Callable[[Any, Any], Any]
    describe: Callable[[Any], str]


@dataclasses.dataclass(frozen=True)
class WorkloadHooks:
    """What a technique does where a plan meets a workload (:func:`lowmem_jax.build`) or a run.

    Attributes:
      bind: ``bind(work, plan, total_steps) -> (work, plan)``: the workload and plan the step is
        built from (e.g. sparse training's defaults from the workload: which leaves, when to
        stop); raises ``ValueError`` in one line where the plan cannot apply to the workload
        (e.g. a batch its microbatches do not divide). ``total_steps``: the run's length, or
        ``None`` (an analysis).
      check: ``check(setup)`` raises ``ValueError`` in one line where the step cannot do what
        the plan asks (e.g. a remat policy saving a tag the model never makes); called before
        the step is made (``setup.step`` is ``None``), so a refusal builds nothing.
      warm_start: see :class:`WarmStart`.
    """

    bind: Callable[[Any, Any, int | None], tuple[Any, Any]] | None = None
    check: Callable[[Any], None] | None = None
    warm_start: WarmStart | None = None


@dataclasses.dataclass(frozen=True)
class ReportHooks:
    """What a technique reports.

    Attributes:
      verdict: ``verdict(evidence, plan) -> Verdict | None``: whether the setting changed the
        step (``None`` where the technique is off); :func:`lowmem_jax.verdicts`.
      rows: ``rows(context) -> (ReportRow, ...)``: the technique alone at the settings a memory
        report shows (:mod:`lowmem_jax.core.report_hooks`).
      section: a section of ``lowmem report`` of its own, after the grid, with its own flag
        (:class:`~lowmem_jax.core.report_hooks.ReportSection`).
      compile_cost: ``compile_cost(plan) -> factor``: about how many times longer the step
        takes to trace and compile with the setting than without it (measured on XLA:CPU);
        ``lowmem report``'s estimate of the time left weighs its rows by the product.
    """

    verdict: Callable[[Evidence, Any], Verdict | None] | None = None
    rows: Callable[[GridContext], tuple[ReportRow, ...]] | None = None
    section: ReportSection | None = None
    compile_cost: Callable[[Any], float] | None = None
