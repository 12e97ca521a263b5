"""The state of one :func:`lowmem_jax.planning.planner.plan_for_budget` search: what each plan
costs, predicted and compiled, and the log of what was considered.

**Prediction.** A plan's bytes are predicted by the analytic count
(:func:`lowmem_jax.analysis.memory.analytic_breakdown`, no compile; XLA's total has not been more
than ~0.2% below it on any configuration of our reports but the plain step), times a calibration:
the least ratio of XLA's total to the analytic one among compiled plans with the same settings
but the microbatch count (:func:`calibration_key`); for settings not compiled yet, with
``bound``, the least ratio compiled with the same values of the axes whose ratios are their own
(precision, compressed activations, optimizer-state format; :meth:`Search.ratio`), 1 before
one. A per-block schedule's activation bytes are the ``none`` step's at those settings and
microbatch count plus its blocks' changes
(:mod:`lowmem_jax.techniques.remat.schedule`) divided by the microbatch count (residuals scale with
the batch). Over a mesh (``shard``, ``pipeline``) the count is one device's: its shard of each state
leaf, the gradient split as the parameters are, its share of the batch and of the residuals.

**Compiles** are cached per plan, and each calibrates its settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from lowmem_jax.analysis import memory
from lowmem_jax.analysis.flops import count_flops
from lowmem_jax.analysis.timing import time_step
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core import mesh as sharding
from lowmem_jax.core.units import MIB
from lowmem_jax.planning.envelope import Envelope
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.builder import build
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.flags import analyze_argv


class NoPlanFits(ValueError):
    """No plan in the envelope fits the budget; the message names the smallest found."""


class Search:
    """The state of one search: the workload, caches of predictions and compiles, the log.
    ``timed``: the steps that fit will be run and timed (``objective="time"``), so they compile
    with XLA's defaults; otherwise as an analysis (the same bytes, a shorter compile:
    :func:`~lowmem_jax.analysis.memory.analysis_compiler_options`)."""

    def __init__(
        self, work: Workload, budget: int, envelope: Envelope, log, recipe, timed: bool = False
    ):
        self.work, self.budget, self.envelope, self.log = work, budget, envelope, log
        self.recipe, self.timed = recipe, timed
        self.predicted: dict[Plan, int] = {}
        self.compiled: dict[Plan, dict[str, Any]] = {}
        self.calibration: dict[tuple, float] = {}
        self.considered: list[dict[str, Any]] = []
        self.noted: dict[Plan, int] = {}  # a plan's entry in ``considered``
        self.executables: dict[Plan, Any] = {}  # compiled steps that fit, kept to time them

    @functools.cache  # noqa: B019 (one search: the cache lives as long as it)
    def flops(self, plan: Plan) -> float:
        """The step's FLOPs, counted from its jaxpr (recomputation included)."""
        setup = build(self.work, plan, recipe=self.recipe)
        state = setup.abstract_state()
        step = getattr(setup.step, "__wrapped__", setup.step)
        return count_flops(step, state, self.work.batch)[0]

    def predict(self, plan: Plan, bound: bool = False) -> int:
        """Analytic bytes times the calibration of the plan's settings
        (:func:`calibration_key`; :meth:`ratio`).

        The analytic count is assembled from two cached parts: the stored bytes (parameters,
        optimizer state with its accumulator, inputs) and the saved activations, each from
        the settings of the axes that change it (:attr:`Axis.parts`: remat does not change the
        stored bytes, nor sparse storage or the optimizer state the activations: a sparse
        model's materialized weights have the dense shapes)."""
        if plan not in self.predicted:
            stored = self._stored(settings(plan, "stored"), _split(plan) > 1)
            self.predicted[plan] = stored + self._activation_bytes(plan)
        return int(self.predicted[plan] * self.ratio(plan, bound))

    def ratio(self, plan: Plan, bound: bool) -> float:
        """XLA's total over the analytic one for the plan's settings (the least compiled);
        where none was compiled, 1, or with ``bound`` the least ratio compiled with the same
        values of the axes whose ratios are their own (:attr:`Axis.own_ratio`: precision,
        compressed activations, optimizer-state format), else of fewer of them (the last in
        the registry's order dropped first, down to the first)."""
        key = calibration_key(plan)
        if key in self.calibration or not bound:
            return self.calibration.get(key, 1.0)
        mine = dict(key)
        own = [a.key for a in AXES if a.own_ratio]
        for n in range(len(own), 0, -1):
            ratios = [r for k, r in self.calibration.items()
                      if all(dict(k)[name] == mine[name] for name in own[:n])]  # fmt: skip
            if ratios:
                return min(ratios)
        return 1.0

    def _activation_bytes(self, plan: Plan) -> int:
        """The analytic activations: traced, or for a family's member (:class:`Family`) the
        axis' first value's traced plus the member's change divided by the microbatch count
        (residuals scale with the batch)."""
        saved = settings(plan, "activations")
        axis = _family_axis(plan)
        if axis is None:
            return self._activations(saved, _split(plan))
        base = self._activations(_with(saved, axis.field, axis.values[0]), _split(plan))
        costs = self.family_costs(axis.key, _with(saved, axis.field, None))
        change = axis.family.saved_change(costs, getattr(plan, axis.field))
        return int(base + change / _split(plan))

    @functools.cache  # noqa: B019 (one search: the cache lives as long as it)
    def family_costs(self, key: str, saved: tuple) -> Any:
        """The costs of the family of the compute axis ``key`` (:class:`Family`), the other
        activation-part settings ``saved`` (:func:`settings`, the axis' own ``None``):
        measured where every other storage setting is at its default (e.g. fp32), carried from
        there to the others (:attr:`Family.carry`). ``None`` where the model has nothing the
        family is built on."""
        axis = next(a for a in COMPUTE if a.key == key)
        structure = axis.family.structure(self.work.model)
        if structure is None:
            return None

        def saved_bytes(value: Any) -> int:
            return self._activations(_with(saved, axis.field, value), 1)

        reference = _storage_at_defaults(saved)
        if saved != reference:
            return axis.family.carry(self.family_costs(key, reference), saved_bytes)
        compute = {f: v for f, v in saved if f in _COMPUTE_FIELDS and f != axis.field}
        return axis.family.measure(
            structure,
            saved_bytes,
            lambda value: self.flops(Plan(**compute, **axis.plan_fields(value))),
        )

    def family_classes(self, key: str, point: dict[str, Any]) -> list[tuple[float, dict]]:
        """(FLOPs, compute point) of the members of the family of the compute axis ``key``
        worth a class each, the other compute axes at ``point``'s values (reference costs:
        every storage setting at its default)."""
        axis = next(a for a in COMPUTE if a.key == key)
        others = plan_of({k: v for k, v in point.items() if k != key})
        saved = _with(settings(others, "activations"), axis.field, None)
        costs = self.family_costs(key, saved)
        if costs is None:
            return []  # e.g. remat's per-block schedules on a model without scanned stacks
        return [(flops, {**point, key: value}) for flops, value in axis.family.members(costs)]

    @functools.cache  # noqa: B019 (one search: the cache lives as long as it)
    def _stored(self, stored: tuple, accumulates: bool) -> int:
        """The parameters, optimizer state (gradient and accumulator included), model state
        and batch one device holds: over a mesh, its shard of each state leaf (the plan's
        layout), the gradient and accumulator split as the parameters are, its share of the
        batch."""
        plan = Plan(**dict(stored), **SPLIT.plan_fields(2 if accumulates else 1))
        setup = build(self.work, plan, recipe=self.recipe)
        state = setup.abstract_state()
        analytic = memory.analytic_breakdown(
            state=state, batch=self.work.batch, microbatches=_split(plan), tx=setup.tx
        )
        if plan.mesh() is None:
            # The transient dense weights depend on the remat (one block's, or all): left to
            # the calibration, as before the analytic count included them.
            return analytic["total_bytes"] - analytic["dense_weight_bytes"]
        split = analytic["optimizer_breakdown"]
        grads = split["gradients"] + split.get("gradient_accumulator", 0)
        share = memory.tree_bytes(state.params, per_device=True) / memory.tree_bytes(state.params)
        mine = memory.tree_bytes(state, per_device=True) + int(grads * share)
        return mine + memory.tree_bytes(setup.abstract_batch(), per_device=True)

    @functools.cache  # noqa: B019
    def _activations(self, saved: tuple, microbatches: int) -> int:
        """The saved residuals of one device's examples (those of the whole batch over the
        data devices: residuals scale with the examples)."""
        plan = Plan(**dict(saved), **SPLIT.plan_fields(microbatches))
        setup = build(self.work, plan, recipe=self.recipe)
        analytic = memory.analytic_breakdown(
            state=setup.abstract_state(), batch=self.work.batch,
            loss_fn=plan.model_loss(setup.loss_fn),
            microbatches=microbatches, tx=setup.tx,
        )  # fmt: skip
        return analytic["activation_bytes"] // sharding.data_devices(plan.mesh())

    def outside(self, plan: Plan) -> str | None:
        """Why ``plan`` is outside the search's envelope (the whole plan's rules: a pipeline's
        microbatches depend on the step's and the data devices), or ``None``."""
        config = {**explicit(plan).to_dict(), "batch_size": self.work.batch_size}
        return self.envelope.why_outside(config)

    def compile(self, plan: Plan) -> dict[str, Any]:
        if plan not in self.compiled:
            setup = build(self.work, plan, recipe=self.recipe)
            lowered = setup.step.lower(setup.abstract_state(), self.work.batch)
            options = None if self.timed else memory.analysis_compiler_options()
            executable = lowered.compile(options)
            self.compiled[plan] = memory.xla_memory(executable)
            if self.timed and self.compiled[plan]["total_bytes"] <= self.budget:
                self.executables[plan] = executable
            self.predict(plan)
            ratio = self.compiled[plan]["total_bytes"] / self.predicted[plan]
            key = calibration_key(plan)
            self.calibration[key] = min(ratio, self.calibration.get(key, ratio))
        return self.compiled[plan]

    def step_seconds(self, plan: Plan, repeats: int) -> float:
        """The median time of ``repeats`` calls of the compiled step of ``plan`` (which fits),
        after a warm-up, on a random batch and a freshly initialised state."""
        setup = build(self.work, plan, recipe=self.recipe)
        batch = setup.example_batch()
        return time_step(self.executables[plan], setup.init_state(batch), batch, repeats).median

    def note(self, plan: Plan, flops: float, verdict: str, logged: bool = True) -> None:
        xla = self.compiled.get(plan)
        if plan in self.noted:  # a probe, reached again in the class's order
            gone = self.noted.pop(plan)
            del self.considered[gone]
            self.noted = {p: i - (i > gone) for p, i in self.noted.items()}
        self.noted[plan] = len(self.considered)
        self.considered.append({
            "name": plan_name(plan) or "no technique",
            "argv": self.argv(plan),
            "flops": flops,
            "predicted_bytes": self.predict(plan) if plan in self.predicted else None,
            "xla_total_bytes": None if xla is None else xla["total_bytes"],
            "verdict": verdict,
        })  # fmt: skip
        if self.log and logged:
            got = "" if xla is None else f", XLA {xla['total_bytes'] / MIB:.1f} MiB"
            self.log(f"  {plan_name(plan)}: {verdict}{got}")

    def argv(self, plan: Plan) -> list[str]:
        """The ``lowmem analyze`` flags of ``plan`` (its device counts written out)."""
        return analyze_argv(self.work.name, self.work.batch_size, explicit(plan), self.seq_len())

    def seq_len(self) -> int | None:
        """Tokens per sequence of a sequence model's batch; None for images."""
        tokens = self.work.batch.get("src", self.work.batch.get("inputs"))
        return None if tokens is None else tokens.shape[1]


#: The registered techniques' planner axes, in the registry's order.
AXES = [t.axis for t in TECHNIQUES if t.axis is not None]
#: The axes whose values make the planner's compute classes (:attr:`Axis.compute`).
COMPUTE = [axis for axis in AXES if axis.compute]
#: The axis whose candidates come from the batch size: the count of microbatches it splits into.
SPLIT = next(axis for axis in AXES if axis.values is None)
_COMPUTE_FIELDS = {axis.field for axis in COMPUTE}


def settings(plan: Plan, part: str) -> tuple[tuple[str, Any], ...]:
    """The plan's fields set by the axes with candidates (storage and compute; not the
    microbatch count) that change ``part`` of the analytic count (:attr:`Axis.parts`:
    ``"stored"`` or ``"activations"``), as ``(field, value)`` pairs in the registry's order."""
    return tuple(
        (axis.field, getattr(plan, axis.field))
        for axis in AXES
        if axis.values is not None and part in axis.parts
    )


def _with(saved: tuple, field: str, value: Any) -> tuple:
    """``saved`` (:func:`settings`) with ``field`` at ``value``."""
    return tuple((f, value if f == field else v) for f, v in saved)


def _storage_at_defaults(saved: tuple) -> tuple:
    """``saved`` with every storage axis' field at the plan's default (compute fields kept)."""
    default = Plan()
    return tuple((f, v if f in _COMPUTE_FIELDS else getattr(default, f)) for f, v in saved)


def _family_axis(plan: Plan):
    """The compute axis at one of its family's members in ``plan`` (:class:`Family`), or
    ``None``."""
    return next((a for a in COMPUTE if a.family and a.value(plan) == a.family.value), None)


def calibration_key(plan: Plan) -> tuple[tuple[str, Any], ...]:
    """What a calibration is kept for, as ``(axis, value)`` pairs: every searched axis but the
    microbatch count (XLA's temp bytes for sparse rewiring or quantized state differ from the
    analytic count in ways that depend on each setting); the per-block schedules as one
    (``blocks``)."""
    return tuple((axis.key, axis.value(plan)) for axis in AXES if axis.values is not None)


def explicit(plan: Plan) -> Plan:
    """``plan`` with its data axis' size written out where it says "every visible device"
    (``devices=0`` beside ``shard``: the search's plans take the devices the planner was
    given), so that its flags mean the same on a machine with more."""
    if plan.shard == "none" or plan.devices:
        return plan
    return dataclasses.replace(plan, devices=sharding.data_devices(plan.mesh()))


def plan_of(point: dict[str, Any]) -> Plan:
    """The :class:`Plan` of one point of the search space: ``{axis key: value}`` for axes of
    registered techniques (:attr:`Technique.axis`; e.g. ``sparsity`` a fraction: 0 for dense,
    else the report's sparse storage at that fraction); axes left out keep the plan's
    default."""
    axes = {axis.key: axis for axis in AXES}
    unknown = set(point) - set(axes)
    if unknown:
        raise ValueError(f"Unknown search axes {sorted(unknown)}; allowed values: {list(axes)}")
    fields: dict[str, Any] = {}
    for key, value in point.items():
        fields.update(axes[key].plan_fields(value))
    return Plan(**fields)


def plan_name(plan: Plan) -> str:
    """A plan's short name: each technique's label in the registry's order
    (``"fp16 + microbatches 4 + remat full"``)."""
    return " + ".join(label for t in TECHNIQUES if (label := t.label(plan)) is not None)


def _split(plan: Plan) -> int:
    """How many microbatches the plan splits its batch into (:data:`SPLIT`)."""
    return SPLIT.value(plan)
