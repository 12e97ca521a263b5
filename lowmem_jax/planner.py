"""Give it a byte budget, get the plan with the fewest FLOPs whose compiled step fits it.

:func:`plan_for_budget` (``lowmem plan``) searches the combinations of the techniques inside an
accuracy envelope (:data:`lowmem_jax.envelope.ENVELOPES`):

* **Compute classes.** A step's FLOPs (counted from its jaxpr, recomputation included) are set
  by its remat policy and its factorization; precision, microbatches, sparse storage and the
  optimizer state's format change where bytes live, not the arithmetic (their FLOPs differ by
  well under 1%). Each class's FLOPs are counted once, on the fp32 one-microbatch step, and the
  classes are visited cheapest first.
* **Per-block remat.** Besides the named policies, the ``blocks`` entry of the remat axis is
  every per-block schedule of ``none`` / ``dots`` / ``full`` that a dynamic program over the
  model's blocks finds least-recomputing for some activation budget
  (:mod:`lowmem_jax.remat_schedule`: each block's costs measured once by the analytic count at
  fp32, carried to the other precisions by their uniform schedules' counts; the schedule set
  and its FLOPs from the fp32 costs). A schedule's activation bytes are the ``none`` step's at
  that precision and microbatch count plus its blocks' changes divided by the microbatch count
  (residuals scale with the batch); schedules share one calibration (below).
* **Inside a class**, candidates go in order of preference: fewer microbatches first (fewer,
  larger kernels run faster), then fewer and milder techniques (the order of each axis in
  :data:`SPACE`). The first candidate whose *compiled* step fits is the answer.
* **Prediction and pruning.** A candidate's bytes are predicted by the analytic count
  (:func:`lowmem_jax.memory.analytic_breakdown`, no compile; XLA's total has not been more
  than ~0.2% below it on any configuration of our reports but the plain step), times a
  calibration: the least ratio of XLA's total to the analytic one among compiled plans with
  the same settings but the microbatch count; for settings not compiled yet, the least ratio
  compiled with the same precision and optimizer-state format, else the same precision (1
  before one). The analytic count falls with more sparsity and fewer state bits, so a
  microbatch count of a class is skipped when its corners (the most sparsity, each precision
  and state format) are all predicted over the budget, and the class when that holds at its
  most microbatches. A borrowed ratio can be too high for a class (XLA's overhead differs
  between remat policies and grows with the microbatch's size), so before a class is
  rejected, up to three corners whose analytic count alone fits are compiled (*probes*),
  which calibrates their settings. Only candidates predicted to fit are compiled.

Every answer is verified: the chosen plan's XLA total is compiled, not predicted. The result
lists each candidate considered and why it was rejected.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import shlex
import time
from collections.abc import Callable
from typing import Any

from lowmem_jax import memory, remat_schedule
from lowmem_jax import precision as precision_lib
from lowmem_jax.envelope import ENVELOPES, Envelope, report_sparsity
from lowmem_jax.factorization import FactorConfig
from lowmem_jax.flops import count_flops
from lowmem_jax.plan import Plan
from lowmem_jax.plan_flags import analyze_argv
from lowmem_jax.recipes import Recipe
from lowmem_jax.remat import parse_policy
from lowmem_jax.workloads import Workload, build, workload

__all__ = [
    "SPACE",
    "BudgetPlan",
    "NoPlanFits",
    "parse_bytes",
    "plan_for_budget",
    "plan_for_model",
]

MIB = 2.0**20

#: The settings searched on each axis, mildest first (envelopes remove some).
SPACE = {
    "remat": ("none", "dots", "full", "sqrt", "blocks"),
    "factorize": (None, FactorConfig("tucker", 0.25)),
    "precision": ("fp32", "mixed_bf16", "mixed_fp16", "bf16", "fp16"),
    "sparsity": (0.0, 0.5, 0.7, 0.9),
    "optimizer_state": ("auto", "bf16", "int8", "int4"),
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"48MiB"``, ``"1.5 GiB"``, ``"500MB"``, ``"1024"`` (bytes) -> bytes.

    Raises:
      ValueError: anything else, naming the units allowed.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"budget {text!r} is not a positive size; give a number and a unit, one of "
            "B, KiB, MiB, GiB, KB, MB, GB (e.g. 48MiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


class NoPlanFits(ValueError):
    """No plan in the envelope fits the budget; the message names the smallest found."""


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

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        return out


def _axes(envelope: Envelope, batch_size: int, space: dict[str, tuple]) -> dict[str, tuple]:
    """``space`` inside ``envelope``, with the microbatch counts ``batch_size`` allows."""
    micro = tuple(
        m for m in range(1, batch_size + 1)
        if batch_size % m == 0 and (m == 1 or batch_size // m >= envelope.min_microbatch_examples)
    )  # fmt: skip
    micro = tuple(m for m in micro if m in space.get("microbatches", micro))
    return {
        "remat": space["remat"],
        "factorize": tuple(f for f in space["factorize"] if f is None or envelope.factorize),
        "precision": tuple(p for p in space["precision"] if p in envelope.precisions),
        "microbatches": micro,
        "sparsity": tuple(s for s in space["sparsity"] if s <= envelope.max_sparsity + 1e-9),
        "optimizer_state": tuple(
            s for s in space["optimizer_state"] if s in envelope.optimizer_states
        ),
    }


class _Search:
    """The state of one search: the workload, caches of predictions and compiles, the log."""

    def __init__(self, work: Workload, budget: int, envelope: Envelope, log, recipe):
        self.work, self.budget, self.envelope, self.log = work, budget, envelope, log
        self.recipe = recipe
        self.predicted: dict[Plan, int] = {}
        self.compiled: dict[Plan, dict[str, Any]] = {}
        self.calibration: dict[tuple, float] = {}
        self.considered: list[dict[str, Any]] = []
        self.noted: dict[Plan, int] = {}  # a plan's entry in ``considered``

    def flops(self, plan: Plan) -> float:
        setup = build(self.work, plan, recipe=self.recipe)
        state = setup.abstract_state()
        step = getattr(setup.step, "__wrapped__", setup.step)
        return count_flops(step, state, self.work.batch)[0]

    def predict(self, plan: Plan, bound: bool = False) -> int:
        """Analytic bytes times the calibration of the plan's settings (:func:`_key`); where
        none was compiled with them, 1 (the analytic count), or with ``bound`` the least
        calibration seen so far at the plan's precision.

        The analytic count is assembled from two cached parts: the stored bytes (parameters,
        optimizer state with its accumulator, inputs), which do not depend on remat, and the
        saved activations, which do not depend on sparse storage or the optimizer state (a
        sparse model's materialized weights have the dense shapes)."""
        if plan not in self.predicted:
            self.predicted[plan] = self._stored(
                plan.precision,
                plan.sparsity,
                plan.optimizer_state,
                plan.factorize,
                plan.microbatches > 1,
            ) + self._activation_bytes(plan)
        return int(self.predicted[plan] * self.ratio(plan, bound))

    def ratio(self, plan: Plan, bound: bool) -> float:
        """XLA's total over the analytic one for the plan's settings (the least compiled);
        where none was compiled, 1, or with ``bound`` the least ratio compiled with the same
        precision and optimizer-state format, else the same precision (XLA:CPU computes bf16
        convolutions in float32 and dequantizes a quantized state in temporaries: their
        ratios are their own)."""
        key = _key(plan)
        if key in self.calibration or not bound:
            return self.calibration.get(key, 1.0)
        for same in (_PRECISION, _STATE), (_PRECISION,):
            ratios = [r for k, r in self.calibration.items() if all(k[i] == key[i] for i in same)]
            if ratios:
                return min(ratios)
        return 1.0

    def _activation_bytes(self, plan: Plan) -> int:
        """The analytic activations: traced for a named policy, summed for a schedule."""
        schedule = parse_policy(plan.remat).schedule
        base = self._activations(plan.precision, "none" if schedule else plan.remat,
                                 plan.factorize, plan.microbatches)  # fmt: skip
        if not schedule:
            return base
        costs = self.block_costs(plan.precision, plan.factorize)
        change = remat_schedule.predict(costs, schedule).bytes - costs.base_bytes
        return int(base + change / plan.microbatches)

    @functools.cache  # noqa: B019 (one search: the cache lives as long as it)
    def block_costs(self, precision: str, factorize) -> remat_schedule.BlockCosts:
        """Each block's costs at one microbatch: measured at fp32
        (:func:`remat_schedule.measure_block_costs`), carried to another precision by its
        uniform schedules' counts (:func:`remat_schedule.rescale`)."""
        if precision == "fp32":
            return remat_schedule.measure_block_costs(
                self.work.model.block_stacks(),
                lambda remat: self._activations("fp32", remat, factorize, 1),
                lambda remat: self.flops(Plan(remat=remat, factorize=factorize)),
            )
        uniform = {p: self._activations(precision, p, factorize, 1) for p in ("dots", "full")}
        return remat_schedule.rescale(
            self.block_costs("fp32", factorize),
            self._activations(precision, "none", factorize, 1),
            uniform,
        )

    def schedules(self, factorize) -> list[tuple[float, str]]:
        """(FLOPs, remat) of the per-block schedules the dynamic program keeps (fp32 costs),
        those with one policy throughout left out (they are the named classes)."""
        if not hasattr(self.work.model, "block_stacks"):
            return []  # a model without scanned stacks has no per-block schedule
        front = remat_schedule.pareto_schedules(self.block_costs("fp32", factorize))
        return [(s.flops, s.name) for s in front if len(set(s.policies)) > 1]

    @functools.cache  # noqa: B019 (one search: the cache lives as long as it)
    def _stored(self, precision, sparsity, state, factorize, accumulates) -> int:
        plan = Plan(precision=precision, sparsity=sparsity, optimizer_state=state,
                    factorize=factorize, microbatches=2 if accumulates else 1)  # fmt: skip
        setup = build(self.work, plan, recipe=self.recipe)
        analytic = memory.analytic_breakdown(
            state=setup.abstract_state(), batch=self.work.batch,
            microbatches=plan.microbatches, tx=setup.tx,
        )  # fmt: skip
        return analytic["total_bytes"]

    @functools.cache  # noqa: B019
    def _activations(self, precision, remat, factorize, microbatches) -> int:
        plan = Plan(precision=precision, remat=remat, factorize=factorize,
                    microbatches=microbatches)  # fmt: skip
        setup = build(self.work, plan, recipe=self.recipe)
        analytic = memory.analytic_breakdown(
            state=setup.abstract_state(), batch=self.work.batch,
            loss_fn=precision_lib.cast_loss_fn(setup.loss_fn, plan.policy),
            microbatches=microbatches, tx=setup.tx,
        )  # fmt: skip
        return analytic["activation_bytes"]

    def compile(self, plan: Plan) -> dict[str, Any]:
        if plan not in self.compiled:
            setup = build(self.work, plan, recipe=self.recipe)
            lowered = setup.step.lower(setup.abstract_state(), self.work.batch)
            self.compiled[plan] = memory.xla_memory(lowered.compile())
            self.predict(plan)
            ratio = self.compiled[plan]["total_bytes"] / self.predicted[plan]
            key = _key(plan)
            self.calibration[key] = min(ratio, self.calibration.get(key, ratio))
        return self.compiled[plan]

    def note(self, plan: Plan, flops: float, verdict: str, logged: bool = True) -> None:
        xla = self.compiled.get(plan)
        if plan in self.noted:  # a probe, reached again in the class's order
            gone = self.noted.pop(plan)
            del self.considered[gone]
            self.noted = {p: i - (i > gone) for p, i in self.noted.items()}
        self.noted[plan] = len(self.considered)
        self.considered.append({
            "argv": analyze_argv(self.work.name, self.work.batch_size, plan, self.seq_len()),
            "flops": flops,
            "predicted_bytes": self.predict(plan) if plan in self.predicted else None,
            "xla_total_bytes": None if xla is None else xla["total_bytes"],
            "verdict": verdict,
        })  # fmt: skip
        if self.log and logged:
            got = "" if xla is None else f", XLA {xla['total_bytes'] / MIB:.1f} MiB"
            self.log(f"  {_name(plan)}: {verdict}{got}")

    def seq_len(self) -> int:
        tokens = self.work.batch.get("src")
        return 40 if tokens is None else tokens.shape[1]


def _key(plan: Plan) -> tuple:
    """What a calibration is kept for: every setting but the microbatch count (XLA's temp
    bytes for sparse rewiring or quantized state differ from the analytic count in ways that
    depend on each setting); the per-block schedules as one (``blocks``)."""
    remat = "blocks" if parse_policy(plan.remat).schedule else plan.remat
    return (remat, plan.factorize, plan.precision, plan.sparsity, plan.optimizer_state)


_PRECISION, _STATE = 2, 4  # their places in a key


def _name(plan: Plan) -> str:
    parts = [plan.precision]
    if plan.microbatches > 1:
        parts.append(f"mb {plan.microbatches}")
    if plan.remat != "none":
        parts.append(f"remat {plan.remat}")
    if plan.sparsity is not None:
        parts.append(f"sparse {1 - plan.sparsity.density:.0%}")
    if plan.optimizer_state != "auto":
        parts.append(f"state {plan.optimizer_state}")
    if plan.factorize is not None:
        parts.append(f"{plan.factorize.method} {plan.factorize.compression:.0%}")
    return " + ".join(parts)


def _plan(remat, factorize, precision, microbatches, sparsity, state) -> Plan:
    sparse = report_sparsity(sparsity) if sparsity else None
    return Plan(precision=precision, microbatches=microbatches, remat=remat, sparsity=sparse,
                optimizer_state=state, factorize=factorize)  # fmt: skip


def plan_for_budget(
    work: Workload,
    budget_bytes: int,
    *,
    envelope: str = "report",
    recipe: Recipe | None = None,
    space: dict[str, tuple] | None = None,
    log: Callable[[str], None] | None = None,
) -> BudgetPlan:
    """The plan with the fewest FLOPs whose compiled step on ``work`` fits ``budget_bytes``
    (module docstring), inside ``envelope`` (``report`` or ``any``); ``recipe``: the
    optimizer (``None``: the workload's), which sets the optimizer state's bytes; ``space``:
    the settings to search (``None``: :data:`SPACE`; the same keys, each a tuple, mildest
    first; a ``microbatches`` tuple limits the counts too).

    Raises:
      ValueError: an unknown envelope or a budget that is not positive.
      NoPlanFits: no plan fits; the message names the smallest XLA total found and its flags.
    """
    if envelope not in ENVELOPES:
        raise ValueError(f"Unknown envelope={envelope!r}; allowed values: {sorted(ENVELOPES)}")
    if budget_bytes <= 0:
        raise ValueError(f"budget must be positive, got {budget_bytes} bytes")
    start = time.perf_counter()
    env = ENVELOPES[envelope]
    axes = _axes(env, work.batch_size, SPACE if space is None else space)
    search = _Search(work, budget_bytes, env, log, recipe)
    reference = search.flops(Plan())
    classes = []
    for remat, factorize in itertools.product(axes["remat"], axes["factorize"]):
        if remat == "blocks":
            classes += [(flops, name, factorize) for flops, name in search.schedules(factorize)]
        else:
            classes.append((search.flops(Plan(remat=remat, factorize=factorize)), remat, factorize))
    classes.sort(key=lambda c: c[0])
    most = max(axes["microbatches"])  # the least-memory count: its corners decide a class
    for flops, remat, factorize in classes:
        named = not parse_policy(remat).schedule  # schedules are many: logged when compiled
        if log and named:
            log(f"class remat {remat}, factorize {factorize and factorize.method}: "
                f"FLOPs {flops / reference:.3f} of the fp32 step")  # fmt: skip
        corners = _corners(axes, remat, factorize, most)
        if not _class_may_fit(search, corners, flops):
            least = min(corners, key=search.predict)
            search.note(least, flops, "the class's least-memory plan is predicted over budget",
                        logged=named)  # fmt: skip
            continue
        for micro in axes["microbatches"]:
            corners = _corners(axes, remat, factorize, micro)
            if all(search.predict(c, bound=True) > budget_bytes for c in corners):
                continue
            for precision, sparsity, state in _mildest_first(axes):
                plan = _plan(remat, factorize, precision, micro, sparsity, state)
                if _fits_verified(search, plan, flops):
                    return _answer(search, plan, flops, reference, start)
    raise NoPlanFits(_smallest_message(search, budget_bytes, env))


def _corners(axes: dict[str, tuple], remat, factorize, micro: int) -> list[Plan]:
    """The least-memory plans of a class at ``micro`` microbatches: the most sparsity, each
    precision and optimizer-state format (fewer state bits can cost temp bytes, so each)."""
    sparsity = max(axes["sparsity"])
    return [
        _plan(remat, factorize, p, micro, sparsity, s)
        for p in axes["precision"] for s in axes["optimizer_state"]
    ]  # fmt: skip


def _class_may_fit(search: _Search, corners: list[Plan], flops: float) -> bool:
    """Whether some corner of a class (its most microbatches) is predicted to fit. Before
    saying no, up to :data:`_PROBES` corners whose analytic count alone fits (XLA's total has
    not been more than :data:`_ANALYTIC_SLACK` below it) but whose ratio is borrowed from
    other settings are compiled, least predicted first: a borrowed ratio can be too high
    (XLA's overhead over the analytic count differs between remat policies and shrinks with
    smaller microbatches), and the compile calibrates the corner's settings."""
    probes = 0
    while not any(search.predict(c, bound=True) <= search.budget for c in corners):
        borrowed = [
            c for c in corners
            if _key(c) not in search.calibration
            and search.predict(c) <= search.budget * _ANALYTIC_SLACK
        ]  # fmt: skip
        if not borrowed or probes == _PROBES:
            return False
        probe = min(borrowed, key=lambda c: search.predict(c, bound=True))
        fits = search.compile(probe)["total_bytes"] <= search.budget
        search.note(probe, flops, f"{'fits' if fits else 'over budget'} (compiled, a probe)")
        probes += 1
    return True


_PROBES = 3
# XLA's total has come in below the analytic count by up to ~0.2% (WRN-10-1 batch 8, fp32),
# so a probe is also made where the analytic count is slightly over the budget.
_ANALYTIC_SLACK = 1.02


def _mildest_first(axes: dict[str, tuple]) -> list[tuple]:
    """(precision, sparsity, optimizer_state) combinations: fewest techniques first, then the
    mildest settings (each axis' order)."""
    names = ("precision", "sparsity", "optimizer_state")
    combos = itertools.product(*(range(len(axes[n])) for n in names))
    ordered = sorted(combos, key=lambda idx: (sum(i > 0 for i in idx), sum(idx), idx))
    return [tuple(axes[n][i] for n, i in zip(names, idx, strict=True)) for idx in ordered]


def _fits_verified(search: _Search, plan: Plan, flops: float) -> bool:
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


def _answer(search: _Search, plan: Plan, flops: float, reference: float, start: float):
    exact = search.flops(plan)
    search.considered[-1]["verdict"] = "chosen"
    return BudgetPlan(
        plan=plan,
        argv=analyze_argv(search.work.name, search.work.batch_size, plan, search.seq_len()),
        budget_bytes=search.budget,
        envelope=search.envelope.name,
        xla=search.compiled[plan],
        analytic_total_bytes=search.predicted[plan],
        flops=exact,
        flops_overhead=exact / reference,
        considered=search.considered,
        seconds=time.perf_counter() - start,
        reference_flops=reference,
    )


def _smallest_message(search: _Search, budget: int, env: Envelope) -> str:
    """Names the least XLA total found: the least predicted plans not yet compiled are
    compiled first (up to :data:`_EXTRA_COMPILES`)."""
    left = sorted((p for p in search.predicted if p not in search.compiled), key=search.predict)
    for plan in left[:_EXTRA_COMPILES]:
        search.compile(plan)
    plan, xla = min(search.compiled.items(), key=lambda kv: kv[1]["total_bytes"])
    argv = analyze_argv(search.work.name, search.work.batch_size, plan, search.seq_len())
    more = "" if env.name == "any" else "; --envelope any allows more"
    return (
        f"no plan in the {env.name!r} envelope fits {budget / MIB:.1f} MiB: the smallest "
        f"budget that can work is {xla['total_bytes'] / MIB:.1f} MiB ({xla['source']}; the "
        f"least of the {len(search.compiled)} plans compiled, which the prediction ranked "
        f"least), by `lowmem analyze {shlex.join(argv)}`{more}"
    )


_EXTRA_COMPILES = 3


def plan_for_model(
    model: str,
    batch_size: int | None,
    budget_bytes: int,
    *,
    envelope: str = "report",
    seq_len: int = 40,
    space: dict[str, tuple] | None = None,
    log: Callable[[str], None] | None = None,
) -> BudgetPlan:
    """:func:`plan_for_budget` for a registered model (:func:`lowmem_jax.workloads.workload`)."""
    work = workload(model, batch_size, seq_len=seq_len)
    return plan_for_budget(work, budget_bytes, envelope=envelope, space=space, log=log)
