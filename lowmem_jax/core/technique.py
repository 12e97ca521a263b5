"""The Technique protocol: what one technique declares so that the rest of the library can
iterate over techniques instead of naming them.

A :class:`Technique` is a value (like optax's ``GradientTransformation``): the :class:`Plan`
fields it owns and their validation, the text of its plan labels, its command-line flags
(:class:`Flags`), its rule in the accuracy envelopes (:class:`EnvelopeRule`) and its axis in the
planner's search (:class:`Axis`), and its hooks, grouped by what they act on
(:mod:`lowmem_jax.core.technique_hooks`: the model, the optimizer, the step, the layout over
devices, a workload and a run, what it reports). Every hook is optional; a group left out is
empty. The ordered registry of them is
:data:`lowmem_jax.techniques.TECHNIQUES`; this module imports no technique.

``plan`` below is a :class:`lowmem_jax.Plan`; ``config`` a step's JSON description
(``{"batch_size": B, **plan.to_dict()}``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from lowmem_jax.core.technique_hooks import (
    Evidence,
    LayoutHooks,
    ModelHooks,
    OptimizerHooks,
    ReportHooks,
    StepHooks,
    Verdict,
    WorkloadHooks,
)

__all__ = [
    "Technique",
    "PlanField",
    "Flags",
    "EnvelopeRule",
    "Axis",
    "Family",
    "Evidence",
    "Verdict",
    "examples_rule",
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
      parse: ``parse(value) -> value``: the typed value ``Plan`` holds for what it is given
        (e.g. a remat policy's text parsed once into a
        :class:`~lowmem_jax.blocks.policy.RematSpec`); ``None``: kept as given.
    """

    name: str
    type: Any
    default: Any
    doc: str
    help: str | None = None
    choices: tuple[str, ...] | None = None
    omit_default: bool = False
    parse: Callable[[Any], Any] | None = None

    def field(self) -> dataclasses.Field:
        """The ``dataclasses`` field (``help`` and ``choices`` in its metadata when a flag)."""
        metadata: dict[str, Any] = {
            "omit_default": self.omit_default,
            "doc": self.doc,
            "parse": self.parse,
        }
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


def examples_rule(
    key: str, what: str, examples: Callable[[dict[str, Any]], int | None]
) -> EnvelopeRule:
    """The rule on how few examples BatchNorm may normalise at once: at least 8 in the report's
    envelope (it kept accuracy down to microbatches of about 8 examples; applied to every
    model, which is conservative for those without BatchNorm), any number in ``any``.

    ``examples(config) -> n | None``: the examples of one of the step's ``what`` (e.g.
    ``"microbatches"``), ``None`` where the batch is not split."""

    def outside(config: dict[str, Any], limit: int) -> str | None:
        n = examples(config)
        return f"{what} of {n} examples (< {limit})" if n is not None and n < limit else None

    return EnvelopeRule(
        key,
        {"report": 8, "any": 1},
        outside,
        lambda limit: f"{what} of at least {limit} examples" if limit > 1 else "",
    )


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
class Technique:
    """One technique, as the library's generic code sees it.

    Attributes:
      name: the registry key (the name of its main ``Plan`` field).
      fields: the ``Plan`` fields it owns (:class:`PlanField`; ``Plan`` is made of them).
      validate: ``validate(plan)`` raises ``ValueError`` naming the field and the allowed
        values; called by ``Plan`` on construction, in the registry's order (a later rule may
        read an earlier field).
      envelope, axis: see :class:`EnvelopeRule`, :class:`Axis`; required (``None`` says
        "no limit" / "not searched", a decision each technique states, not a default).
      label: ``label(plan) -> text | None``: its part of a plan's short name (``"microbatches
        4"``), ``None`` where it is off.
      flags: command-line flags beyond one per field with a help text (:class:`Flags`).
      model, optimizer, step, layout, workload, report: its hooks (:class:`ModelHooks`,
        :class:`OptimizerHooks`, :class:`StepHooks`, :class:`LayoutHooks`,
        :class:`WorkloadHooks`, :class:`ReportHooks`), applied in the registry's order.

    Its place in the registry (:data:`lowmem_jax.techniques.TECHNIQUES`, an explicit tuple) is
    where its hooks act in the step, its fields in ``Plan``, its label in a plan's name.
    """

    name: str
    fields: tuple[PlanField, ...]
    validate: Callable[[Any], None]
    envelope: EnvelopeRule | None = dataclasses.field(kw_only=True)
    axis: Axis | None = dataclasses.field(kw_only=True)
    label: Callable[[Any], str | None] = _no_label
    flags: Flags | None = None
    model: ModelHooks = ModelHooks()
    optimizer: OptimizerHooks = OptimizerHooks()
    step: StepHooks = StepHooks()
    layout: LayoutHooks = LayoutHooks()
    workload: WorkloadHooks = WorkloadHooks()
    report: ReportHooks = ReportHooks()
