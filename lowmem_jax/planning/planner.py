"""Give it a byte budget, get the plan with the fewest FLOPs (or the fastest step) whose
compiled step fits it.

:func:`plan_for_budget` (``lowmem plan``) searches the combinations of the techniques inside an
accuracy envelope (:data:`lowmem_jax.planning.envelope.ENVELOPES`):

* **Compute classes.** A step's FLOPs (counted from its jaxpr, recomputation included) are set
  by its remat policy and its factorization; precision, microbatches, sparse storage and the
  optimizer state's format change where bytes live, not the arithmetic (their FLOPs differ by
  well under 1%). Each class's FLOPs are counted once, on the fp32 one-microbatch step, and the
  classes are visited cheapest first.
* **Per-block remat.** Besides the named policies, the ``blocks`` entry of the remat axis is
  every per-block schedule of ``none`` / ``dots`` / ``full`` that a dynamic program over the
  model's blocks finds least-recomputing for some activation budget
  (:mod:`lowmem_jax.techniques.remat.schedule`: each block's costs measured once by the analytic
  count at fp32, carried to the other precisions by their uniform schedules' counts; the schedule
  set and its FLOPs from the fp32 costs). A schedule's activation bytes are the ``none`` step's at
  that precision and microbatch count plus its blocks' changes divided by the microbatch count
  (residuals scale with the batch); schedules share one calibration (below).
* **Inside a class**, candidates go in order of preference: fewer microbatches first (fewer,
  larger kernels run faster), then fewer and milder techniques (the order of each axis in
  :data:`SPACE`). The first candidate whose *compiled* step fits is the answer.
* **Prediction and pruning** (:class:`lowmem_jax.planning.search.Search`): a candidate's bytes are
  predicted by the analytic count times a calibration (XLA's total over the analytic one,
  learnt from the compiles so far). The analytic count falls with more sparsity and fewer
  state bits, so a microbatch count of a class is skipped when its corners (the most
  sparsity, each precision and state format) are all predicted over the budget, and the class
  when that holds at its most microbatches. A borrowed calibration can be too high for a
  class (XLA's overhead differs between remat policies and grows with the microbatch's size),
  so a class rejected only through one (its corners' analytic counts fit) is deferred: up to
  three of those corners are compiled (*probes*, which calibrate their settings) before a
  costlier class's answer is given, if the class would save more than 0.5% of the FLOPs, and
  at the end. Only candidates predicted to fit are compiled.
* **Before giving up** (:mod:`lowmem_jax.planning.descent`): when no class has a plan that fits
  and the least compiled total is within 10% of the budget, a local search from it compiles
  its neighbours (one setting or one block's policy changed), moving to the first that
  compiles smaller, up to 8 compiles.
* **Objective** ``time``: the first plan that fits in each of the three cheapest classes
  that have one, each more than 0.5% costlier in FLOPs than the last, is run and timed here
  (:mod:`lowmem_jax.analysis.timing`); the fastest wins.
* **Over several devices** (``devices=N``, ``lowmem plan --devices N``): the budget is per
  device; the axes that lay the step out over a mesh (:attr:`Axis.over_devices
  <lowmem_jax.core.technique.Axis.over_devices>`: ZeRO's stages, a pipeline's, the devices left
  data-parallel) are storage axes, predicted per device (each device's shards of the state,
  its share of the examples) and compiled over all N.

Every answer is verified: the chosen plan's XLA total is compiled, not predicted. The result
lists each candidate considered and why it was rejected.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
import time
from collections.abc import Callable, Iterator
from typing import Any

from lowmem_jax.compose.plan import Plan
from lowmem_jax.core import base
from lowmem_jax.planning.descent import descend
from lowmem_jax.planning.envelope import ENVELOPES, Envelope
from lowmem_jax.planning.search import (
    AXES,
    MIB,
    SPLIT,
    NoPlanFits,
    Search,
    calibration_key,
    explicit,
    plan_name,
    plan_of,
)
from lowmem_jax.planning.space import (
    applicable,
    axes_in,
    class_corners,
    class_name,
    compute_classes,
    mildest_first,
    most_microbatches,
    named_class,
    over_devices,
    refuse_below_the_least_state,
)
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.recipes import Recipe
from lowmem_jax.workloads.registry import workload

__all__ = [
    "OBJECTIVES",
    "SPACE",
    "BudgetPlan",
    "NoPlanFits",
    "plan_for_budget",
    "plan_for_model",
]

#: The settings searched on each axis, mildest first (envelopes remove some): each registered
#: technique's axis (:attr:`lowmem_jax.core.technique.Technique.axis`) that has fixed candidates
#: (the microbatch counts come from the batch size) and is searched by default.
SPACE = {
    t.axis.key: t.axis.values
    for t in TECHNIQUES
    if t.axis is not None and t.axis.values is not None and t.axis.in_default_space
}

#: What "cheapest" means: FLOPs counted from the jaxpr (recomputation included), or the
#: measured step time of the first plan that fits in each of the cheapest classes.
OBJECTIVES = ("flops", "time")


@dataclasses.dataclass
class BudgetPlan:
    """The answer: the chosen plan, its compiled figures, and what else was considered."""

    plan: Plan
    argv: list[str]
    budget_bytes: int
    envelope: str
    xla: dict[str, Any]
    analytic_total_bytes: int
    flops: float
    flops_overhead: float
    considered: list[dict[str, Any]]
    seconds: float

    reference_flops: float = 0.0
    step_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        return out


def plan_for_budget(
    work: Workload,
    budget_bytes: int,
    *,
    envelope: str = "report",
    recipe: Recipe | None = None,
    space: dict[str, tuple] | None = None,
    objective: str = "flops",
    time_candidates: int = 3,
    repeats: int = 3,
    devices: int = 1,
    log: Callable[[str], None] | None = None,
) -> BudgetPlan:
    """The plan with the fewest FLOPs whose compiled step on ``work`` fits ``budget_bytes``
    (module docstring), inside ``envelope`` (``report`` or ``any``); ``recipe``: the
    optimizer (``None``: the workload's), which sets the optimizer state's bytes; ``space``:
    the settings to search (``None``: :data:`SPACE`; keys of it, each a tuple, mildest first;
    an axis left out is not searched: its technique stays off; a ``microbatches`` tuple limits
    the counts too).

    ``objective="time"``: the first plan that fits in each of the ``time_candidates``
    cheapest classes that have one, each more than 0.5% costlier in FLOPs than the last, is
    run here (compiled, then a warm-up call and ``repeats`` timed calls on a random batch),
    and the fastest is the answer; plans not among them are not timed. ``"flops"``: the
    first of those, nothing runs.

    ``devices > 1``: a budget per device, every plan over all ``devices`` (JAX must see
    exactly that many; the module docstring); FLOPs are the whole step's.

    Raises:
      ValueError: an unknown envelope or objective, a budget that is not positive,
        ``time_candidates`` / ``repeats`` below 1, or ``devices`` not those JAX sees.
      NoPlanFits: no plan fits; the message names the smallest XLA total found and its flags.
    """
    if envelope not in ENVELOPES:
        raise ValueError(f"Unknown envelope={envelope!r}; allowed values: {sorted(ENVELOPES)}")
    if budget_bytes <= 0:
        raise ValueError(f"budget must be positive, got {budget_bytes} bytes")
    if objective not in OBJECTIVES:
        raise ValueError(f"Unknown objective={objective!r}; allowed values: {list(OBJECTIVES)}")
    if time_candidates < 1 or repeats < 1:
        raise ValueError(
            f"time_candidates and repeats must be at least 1, got {time_candidates}, {repeats}"
        )
    base.check_int(devices, "devices", 1)
    start = time.perf_counter()
    env = ENVELOPES[envelope]
    space = SPACE if space is None else space
    if devices > 1:
        space = over_devices(space, work.batch_size, devices)
    axes = axes_in(env, work.batch_size, space)
    search = Search(work, budget_bytes, env, log, recipe, timed=objective == "time")
    if work.task == "custom":
        axes = applicable(search, axes)
    elif devices > 1:  # e.g. the pipeline's stage counts that divide none of the stacks
        axes = applicable(search, axes, keys=tuple(a.key for a in AXES if a.over_devices))
    refuse_below_the_least_state(search, axes)
    reference = search.flops(Plan())
    classes = compute_classes(search, axes)
    fitting = _first_fit_per_class(search, axes, classes, reference)
    if objective == "flops":
        found = next(fitting, (None,))[0]
    else:
        found = _fastest(search, list(itertools.islice(fitting, time_candidates)), repeats)
    if found is None:
        found = descend(search, axes)
    if found is None:
        raise NoPlanFits(_smallest_message(search, budget_bytes, env))
    return _answer(search, found, reference, start)


def _first_fit_per_class(
    search: Search, axes: dict[str, tuple], classes: list[tuple], reference: float
) -> Iterator[tuple[Plan, float]]:
    """(plan, its class's FLOPs): in each class, cheapest first, the first candidate in order
    of preference whose compiled step fits (module docstring). A class whose corners are
    predicted over budget only through a borrowed calibration (their analytic count fits) is
    deferred: it is probed before a costlier class's plan is given if that would save more
    than :data:`_PROBE_GAIN` of the FLOPs, and at the end. After a plan is given, classes
    within :data:`_PROBE_GAIN` of its FLOPs are passed over (for ``objective="time"``: the
    next candidate recomputes measurably more, where a near-copy would time the same)."""
    most = most_microbatches(axes)  # the least-memory count: its corners decide a class
    deferred: list[tuple] = []
    floor = 0.0
    for flops, point in classes:
        if flops < floor:
            continue
        named = named_class(point)  # family members are many: logged when compiled
        if search.log and named:
            search.log(f"class {class_name(point)}: FLOPs {flops / reference:.3f} of the fp32 step")
        corners = _corners(search, axes, point, most)
        if not corners:
            continue
        if _class_may_fit(search, corners, flops, probes=0):
            found = next(_fits_in_class(search, axes, point, flops), None)
            if found is not None:
                yield from _probe_deferred(search, axes, deferred, most, flops / (1 + _PROBE_GAIN))
                yield found
                floor = flops * (1 + _PROBE_GAIN)
                deferred = [d for d in deferred if d[0] >= floor]
            continue
        least = min(corners, key=search.predict)
        search.note(least, flops, "the class's least-memory plan is predicted over budget",
                    logged=named)  # fmt: skip
        if _borrowed(search, corners):
            deferred.append((flops, point))
    yield from _probe_deferred(search, axes, deferred, most, math.inf)


def _probe_deferred(
    search: Search, axes: dict[str, tuple], deferred: list[tuple], most: int, below: float
) -> Iterator[tuple[Plan, float]]:
    """The deferred classes with FLOPs under ``below``, cheapest first, probed (removed from
    ``deferred``; ``most``: the most microbatches, whose corners decide a class): the first
    fit of each class a probe admits."""
    while deferred and deferred[0][0] < below:
        flops, point = deferred.pop(0)
        if _class_may_fit(search, _corners(search, axes, point, most), flops, _PROBES):
            yield from itertools.islice(_fits_in_class(search, axes, point, flops), 1)


def _fits_in_class(search: Search, axes, point, flops) -> Iterator[tuple[Plan, float]]:
    key = SPLIT.key
    for micro in axes[key]:
        corners = _corners(search, axes, point, micro)
        if all(search.predict(c, bound=True) > search.budget for c in corners):
            continue
        for storage in mildest_first(axes):
            plan = plan_of({**point, key: micro, **storage})
            if search.outside(plan) is None and _fits_verified(search, plan, flops):
                yield plan, flops


def _corners(search: Search, axes: dict[str, tuple], point, micro: int) -> list[Plan]:
    """The class's corners (:func:`~lowmem_jax.planning.space.class_corners`) inside the
    envelope: a pipeline's rule reads the whole plan (its microbatches, the data devices)."""
    return [c for c in class_corners(axes, point, micro) if search.outside(c) is None]


def _fastest(search: Search, fits: list[tuple[Plan, float]], repeats: int):
    """The plan of ``fits`` whose step runs fastest here (:func:`step_timing.time_step`, the
    median of ``repeats`` calls after a warm-up, on a random batch); each one's median goes in
    its ``considered`` entry as ``step_seconds``. ``None`` if ``fits`` is empty."""
    for plan, _ in fits:
        seconds = search.step_seconds(plan, repeats)
        search.considered[search.noted[plan]]["step_seconds"] = seconds
        if search.log:
            search.log(f"  {plan_name(plan)}: step {seconds * 1e3:.0f} ms (median of {repeats})")
    timed = [plan for plan, _ in fits]
    return min(timed, key=lambda p: search.considered[search.noted[p]]["step_seconds"],
               default=None)  # fmt: skip


def _class_may_fit(search: Search, corners: list[Plan], flops: float, probes: int) -> bool:
    """Whether some corner of a class (its most microbatches) is predicted to fit. Before
    saying no, up to ``probes`` corners whose ratio is borrowed from other settings but whose
    analytic count alone fits (:func:`_borrowed`) are compiled, least predicted first: a
    borrowed ratio can be too high (XLA's overhead over the analytic count differs between
    remat policies and shrinks with smaller microbatches), and the compile calibrates the
    corner's settings."""
    made = 0
    while not any(search.predict(c, bound=True) <= search.budget for c in corners):
        borrowed = _borrowed(search, corners)
        if not borrowed or made == probes:
            return False
        probe = min(borrowed, key=lambda c: search.predict(c, bound=True))
        fits = search.compile(probe)["total_bytes"] <= search.budget
        search.note(probe, flops, f"{'fits' if fits else 'over budget'} (compiled, a probe)")
        made += 1
    return True


def _borrowed(search: Search, corners: list[Plan]) -> list[Plan]:
    """The corners whose settings were never compiled and whose analytic count fits (XLA's
    total has not been more than :data:`_ANALYTIC_SLACK` below it)."""
    return [
        c for c in corners
        if calibration_key(c) not in search.calibration
        and search.predict(c) <= search.budget * _ANALYTIC_SLACK
    ]  # fmt: skip


_PROBES = 3  # per class
# A deferred class is probed before a costlier answer only if it would save more FLOPs than
# this fraction: each probe is a compile, and the search's answer is within it of the best.
_PROBE_GAIN = 0.005
# XLA's total has come in below the analytic count by up to ~0.2% (WRN-10-1 batch 8, fp32),
# so a probe is also made where the analytic count is slightly over the budget.
_ANALYTIC_SLACK = 1.02


def _fits_verified(search: Search, plan: Plan, flops: float) -> bool:
    """Whether ``plan`` fits: predicted first (no note when over: most are), then compiled
    (which calibrates its settings)."""
    if search.predict(plan, bound=True) > search.budget:
        return False
    total = search.compile(plan)["total_bytes"]
    if total > search.budget:
        search.note(plan, flops, "over budget (compiled)")
        return False
    search.note(plan, flops, "fits (compiled)")
    return True


def _answer(search: Search, plan: Plan, reference: float, start: float) -> BudgetPlan:
    exact = search.flops(plan.on_one_device())  # the whole step's, over a mesh too
    if plan not in search.noted:  # one of the least predicted, compiled before the descent
        search.note(plan, exact, "fits (compiled)")
    search.considered[search.noted[plan]]["verdict"] = "chosen"
    return BudgetPlan(
        plan=explicit(plan),
        argv=search.argv(plan),
        budget_bytes=search.budget,
        envelope=search.envelope.name,
        xla=search.compiled[plan],
        analytic_total_bytes=search.predicted[plan],
        flops=exact,
        flops_overhead=exact / reference,
        considered=search.considered,
        seconds=time.perf_counter() - start,
        reference_flops=reference,
        step_seconds=search.considered[search.noted[plan]].get("step_seconds"),
    )


def _smallest_message(search: Search, budget: int, env: Envelope) -> str:
    """Names the least XLA total compiled (after :func:`~lowmem_jax.planning.descent.descend`)."""
    plan, xla = min(search.compiled.items(), key=lambda kv: kv[1]["total_bytes"])
    argv = search.argv(plan)
    more = "" if env.name == "any" else "; --envelope any allows more"
    return (
        f"no plan in the {env.name!r} envelope fits {budget / MIB:.1f} MiB: the smallest "
        f"budget that can work is {xla['total_bytes'] / MIB:.1f} MiB ({xla['source']}; the "
        f"least of the {len(search.compiled)} plans compiled), by "
        f"`lowmem analyze {shlex.join(argv)}`{more}"
    )


def plan_for_model(
    model: str,
    batch_size: int | None,
    budget_bytes: int,
    *,
    envelope: str = "report",
    seq_len: int | None = None,
    space: dict[str, tuple] | None = None,
    objective: str = "flops",
    devices: int = 1,
    log: Callable[[str], None] | None = None,
) -> BudgetPlan:
    """:func:`plan_for_budget` for a registered model (:func:`lowmem_jax.workloads.workload`)."""
    work = workload(model, batch_size, seq_len=seq_len)
    return plan_for_budget(
        work, budget_bytes, envelope=envelope, space=space, objective=objective,
        devices=devices, log=log,
    )  # fmt: skip
