"""The Technique protocol: what one technique declares so that the rest of the library can
iterate over techniques instead of naming them.

A :class:`Technique` is a value (like optax's ``GradientTransformation``): the :class:`Plan`
fields it owns and their validation, the text of its plan labels, and optionally its command-line
flags (:class:`Flags`), its rule in the accuracy envelopes (:class:`EnvelopeRule`) and its axis in
the planner's search (:class:`Axis`). The ordered registry of them is
:data:`lowmem_jax.techniques.TECHNIQUES`; this module imports no technique.

``plan`` below is a :class:`lowmem_jax.Plan`; ``config`` a step's JSON description
(``{"batch_size": B, **plan.to_dict()}``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from lowmem_jax.core.jaxprs import equations
from lowmem_jax.core.report_hooks import GridContext, ReportRow, ReportSection

__all__ = [
    "Technique",
    "PlanField",
    "Flags",
    "EnvelopeRule",
    "Axis",
    "Family",
    "Evidence",
    "Verdict",
]


def _no_label(plan: Any) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class PlanField:
    """One field of :class:`lowmem_jax.Plan`, declared by the technique that owns it.

    Attributes:
      name: the field's name.
      type: its annotation.
      default: its default (the technique off).
      doc: its entry in ``Plan``'s docstring.
      help: the help text of its ``--field-name`` flag; ``None``: no flag of its own.
      choices: the flag's allowed values (``None``: any of ``type``).
      omit_default: :meth:`Plan.to_dict` leaves the field out at its default.
    """

    name: str
    type: Any
    default: Any
    doc: str
    help: str | None = None
    choices: tuple[str, ...] | None = None
    omit_default: bool = False

    def field(self) -> dataclasses.Field:
        """The ``dataclasses`` field (``help`` and ``choices`` in its metadata when a flag)."""
        metadata: dict[str, Any] = {"omit_default": self.omit_default, "doc": self.doc}
        if self.help is not None:
            metadata.update(help=self.help, choices=self.choices)
        return dataclasses.field(default=self.default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Flags:
    """Command-line flags beyond the one-flag-per-field ones (``Plan`` fields declared with a
    help text become ``--field-name`` flags by themselves).

    Attributes:
      add: ``add(parser, base_plan)`` adds the flags (an argument group of their own).
      fields: ``fields(args) -> {plan field: value}`` from parsed arguments; raises
        ``ValueError`` naming the flag on a bad value.
      argv: ``argv(plan) -> [flag, value, ...]``: the flags that give the plan's setting (none
        where it is the default), the inverse of ``fields``.
      given: ``given(args) -> [flag, ...]``: those of its flags the command line set.
    """

    add: Callable[[argparse.ArgumentParser, Any], None]
    fields: Callable[[argparse.Namespace], dict[str, Any]]
    argv: Callable[[Any], list[str]]
    given: Callable[[argparse.Namespace], list[str]]


@dataclasses.dataclass(frozen=True)
class EnvelopeRule:
    """A technique's limit in each accuracy envelope (:mod:`lowmem_jax.planning.envelope`).

    Attributes:
      key: the limit's name in :meth:`Envelope.describe` (e.g. ``"max_sparsity"``).
      limits: ``{envelope name: limit}``; every envelope has one.
      outside: ``outside(config, limit) -> reason | None``: why a step is outside, or ``None``.
      describe: ``describe(limit) -> words``: the limit in a few words (``lowmem report``'s
        sentence on its envelope: "at most 70% sparsity"); ``""`` where it allows everything.
        ``limit`` may come back from JSON (a list for a tuple).
    """

    key: str
    limits: dict[str, Any]
    outside: Callable[[dict[str, Any], Any], str | None]
    describe: Callable[[Any], str]


@dataclasses.dataclass(frozen=True)
class Family:
    """A value of a compute axis that stands for a family of settings the planner expands
    from the model (remat's ``blocks``: a policy per block,
    :mod:`lowmem_jax.techniques.remat.schedule`), each member a compute class of its own.

    The planner measures the family's costs on the model through two functions of the axis'
    value it gives: ``saved(value)``, the analytic bytes one microbatch's forward pass saves
    for the backward pass with the axis at ``value`` and the plan's other settings fixed, and
    ``flops(value)``, the step's FLOPs.

    Attributes:
      value: the family's name among the axis' values (``"blocks"``).
      structure: ``structure(model) -> s | None``: what the members are built on (remat: the
        model's block stacks); ``None`` where the model has none (no member).
      measure: ``measure(s, saved, flops) -> costs`` at the search's reference settings.
      carry: ``carry(costs, saved) -> costs``: the costs carried to other settings of the
        other axes by a few counts of ``saved`` (the FLOPs do not change).
      members: ``members(costs) -> [(flops, value), ...]``: the members worth a class each.
      saved_change: ``saved_change(costs, value) -> bytes``: a member's saved bytes minus
        those with the axis at its first value, at one microbatch.
      neighbours: ``neighbours(s, value) -> [value, ...]``: the members one change away from
        ``value`` (a member or another value of the axis), for the planner's descent.
    """

    value: Any
    structure: Callable[[Any], Any]
    measure: Callable[[Any, Callable[[Any], float], Callable[[Any], float]], Any]
    carry: Callable[[Any, Callable[[Any], float]], Any]
    members: Callable[[Any], list[tuple[float, Any]]]
    saved_change: Callable[[Any, Any], float]
    neighbours: Callable[[Any, Any], list[Any]]


@dataclasses.dataclass(frozen=True)
class Axis:
    """A technique's axis in the planner's search (:mod:`lowmem_jax.planning.planner`).

    The planner sorts axes by role: ``compute`` axes make its classes (cheapest FLOPs first),
    the axis whose candidates come from the batch size splits it (microbatches), and every
    other axis is a *storage* axis, searched mildest first inside a class by
    :func:`lowmem_jax.planning.space.mildest_first`.

    Attributes:
      key: the axis' name in a search space and in a point of it.
      values: the candidates, mildest first; ``None``: from the batch size (``candidates``).
      plan_fields: ``plan_fields(value) -> {plan field: value}``.
      within: ``within(value, limit, batch_size) -> bool``: the value is inside an envelope
        whose limit (:class:`EnvelopeRule`) is ``limit``.
      compute: the axis sets the step's FLOPs (a compute class), else only where bytes live.
      candidates: ``candidates(batch_size) -> values`` where ``values`` is ``None``.
      family: a value of a compute axis that stands for a family of settings the planner
        expands itself, not a plan (:class:`Family`; remat's ``"blocks"``).
      value_of: ``value_of(plan) -> value``: the plan's point on the axis (``plan_fields``'
        inverse; a family's member gives the family's value); ``None``: the plan field named
        ``key``.
      parts: the parts of the analytic count the axis changes: ``"stored"`` (parameters,
        optimizer state, batch) and/or ``"activations"`` (the saved residuals).
      own_ratio: XLA's total over the analytic count depends on the value in a way of its own
        (XLA:CPU computes bf16 convolutions in float32; a quantized format decodes into
        temporaries), so the planner borrows a calibration only from the same value.
      corner: the storage axis' values at a class's least-memory plans (its *corners*):
        ``"last"`` (the last value stores least) or ``"each"`` (fewer stored bytes can cost
        temporaries, so every value is a corner).
      in_default_space: searched by default (:data:`lowmem_jax.planning.planner.SPACE`); else only
        where a search's ``space`` names it.
      stored_falls: later values store no more parameter, optimizer-state and batch bytes
        (the planner's least arguments are at the last value); ``False``: values in another
        order (precision: mixed precisions keep float32 weights), each one is tried.
      over_devices: ``over_devices(n) -> values``: the axis lays the step out over a device
        mesh, searched (over these values) only where the planner is given ``n > 1`` devices
        and a budget per device; ``None``: a setting of one device's step.
    """

    key: str
    values: tuple | None
    plan_fields: Callable[[Any], dict[str, Any]]
    within: Callable[[Any, Any, int], bool]
    compute: bool = False
    candidates: Callable[[int], tuple] | None = None
    family: Family | None = None
    value_of: Callable[[Any], Any] | None = None
    parts: tuple[str, ...] = ("stored",)
    own_ratio: bool = False
    corner: str = "each"
    in_default_space: bool = True
    stored_falls: bool = True
    over_devices: Callable[[int], tuple] | None = None

    @property
    def families(self) -> tuple:
        """The values that stand for a family (:attr:`family`), not a plan."""
        return () if self.family is None else (self.family.value,)

    @property
    def field(self) -> str:
        """The plan field the axis sets (its only one)."""
        (name,) = self.plan_fields(self.space(2)[0])
        return name

    @property
    def storage(self) -> bool:
        """A storage axis: neither a compute class nor from the batch size."""
        return not self.compute and self.values is not None

    def value(self, plan: Any) -> Any:
        """The plan's point on this axis (:attr:`value_of`)."""
        return self.value_of(plan) if self.value_of is not None else getattr(plan, self.key)

    def space(self, batch_size: int) -> tuple:
        """The candidates for a batch of ``batch_size``."""
        return self.values if self.values is not None else self.candidates(batch_size)


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


@dataclasses.dataclass(frozen=True)
class Technique:
    """One technique, as the library's generic code sees it.

    Attributes:
      name: the registry key (the name of its main ``Plan`` field).
      order: its place in the registry (:data:`lowmem_jax.techniques.TECHNIQUES` is sorted by
        it): where its hooks act in the step, its fields in ``Plan``, its label in a plan's
        name.
      fields: the ``Plan`` fields it owns (:class:`PlanField`; ``Plan`` is made of them).
      validate: ``validate(plan)`` raises ``ValueError`` naming the field and the allowed
        values; called by ``Plan`` on construction.
      label: ``label(plan) -> text | None``: its part of a plan's short name (``"microbatches 4"``),
        ``None`` where it is off.
      envelope, axis: see :class:`EnvelopeRule`, :class:`Axis`; required (``None`` says
        "no limit" / "not searched", a decision each technique states, not a default).
      flags: see :class:`Flags`.

    Hooks, each optional, each ``(thing, plan) -> thing`` (the optimizer's also take the
    model's ``params``: arrays or shapes, or ``None``); the composers apply them in the
    registry's order (:meth:`Plan.configure_model`, :meth:`Plan.wrap_optimizer`,
    :func:`lowmem_jax.make_train_step`):

      configure_model: the model (Linen or NNX) with the technique's settings.
      inner_optimizer: the user's optax transformation, innermost (e.g. its state's float
        format); applied for every technique before any ``wrap_optimizer``.
      wrap_optimizer: the optimizer so far (e.g. sparse training around it).
      wrap_loss: the model's loss ``loss_fn(params, model_state, batch, rng) -> (loss, (model
        state, metrics))``, on the parameters the model sees (e.g. cast to the compute dtype).
      wrap_stored_loss: the loss as differentiated, on what the gradient is taken w.r.t.
        (e.g. the parameters gathered from their partitions).
      wrap_grad_fn: ``grad_fn(params, model_state, batch, rng) -> (grads, model_state,
        metrics)`` (e.g. accumulated over microbatches).
      wrap_step: ``step(state, batch) -> (state, metrics)``, traced inside ``jit`` (e.g. the
        state's layout over a mesh on the way in and out).
      compiler_options: XLA options the jitted step needs.
      mesh_axis: ``mesh_axis(plan) -> (name, size) | None``: the axis of the device mesh the
        technique lays the step out along (:meth:`Plan.mesh` is one mesh with every
        technique's axis; a size of ``0``: the visible devices the other axes leave).
      state_shardings: ``state_shardings(state, plan) -> shardings | None``: where the train
        state's leaves live over :meth:`Plan.mesh` (arrays or shapes in, a matching tree of
        shardings out; :meth:`Plan.state_shardings` merges the techniques' per leaf).
      one_device: ``one_device(plan) -> {field: value}``: the settings that put the plan's
        step on one device, for a comparison (``{}`` where it runs on one).
      took_effect: ``took_effect(evidence, plan) -> Verdict | None``: whether the setting
        changed the step (``None`` where the technique is off);
        :func:`lowmem_jax.analysis.verdicts`.
      report_rows: ``report_rows(context) -> (ReportRow, ...)``: the technique alone at the
        settings a memory report shows (:mod:`lowmem_jax.core.report_hooks`); ``None``: no
        rows.
      report_section: a section of ``lowmem report`` of its own, after the grid, with its
        own flag (:class:`lowmem_jax.core.report_hooks.ReportSection`).
      host_devices: ``host_devices(args)`` asks XLA:CPU for the host devices the technique's
        command-line flags need; the CLI calls it before JAX starts.
      compile_cost: ``compile_cost(plan) -> factor``: about how many times longer the step
        takes to trace and compile with the setting than without it (measured on XLA:CPU);
        ``lowmem report``'s estimate of the time left weighs its rows by the product.
    """

    name: str
    order: int
    fields: tuple[PlanField, ...]
    validate: Callable[[Any], None]
    envelope: EnvelopeRule | None = dataclasses.field(kw_only=True)
    axis: Axis | None = dataclasses.field(kw_only=True)
    label: Callable[[Any], str | None] = _no_label
    flags: Flags | None = None
    configure_model: Callable[[Any, Any], Any] | None = None
    inner_optimizer: Callable[[Any, Any, Any], Any] | None = None
    wrap_optimizer: Callable[[Any, Any, Any], Any] | None = None
    wrap_loss: Callable[[Callable, Any], Callable] | None = None
    wrap_stored_loss: Callable[[Callable, Any], Callable] | None = None
    wrap_grad_fn: Callable[[Callable, Any], Callable] | None = None
    wrap_step: Callable[[Callable, Any], Callable] | None = None
    compiler_options: Callable[[Any], dict[str, str]] | None = None
    mesh_axis: Callable[[Any], tuple[str, int] | None] | None = None
    state_shardings: Callable[[Any, Any], Any] | None = None
    one_device: Callable[[Any], dict[str, Any]] | None = None
    took_effect: Callable[[Evidence, Any], Verdict | None] | None = None
    report_rows: Callable[[GridContext], tuple[ReportRow, ...]] | None = None
    report_section: ReportSection | None = None
    host_devices: Callable[[argparse.Namespace], None] | None = None
    compile_cost: Callable[[Any], float] | None = None
