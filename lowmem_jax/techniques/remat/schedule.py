"""Per-block remat schedules: the least recomputation for an activation budget.

A model's blocks run in sequence (its :class:`~lowmem_jax.ScannedBlocks` stacks, in the
order ``model.block_stacks()`` lists them). Each block may keep every residual (``none``), keep
its matmul / convolution outputs (``dots``) or only its input (``full``): a ``blocks:`` remat
schedule (:mod:`lowmem_jax.blocks.policy`) gives each block one of them.

**Costs** (:func:`measure_block_costs`), measured once per model and precision by the analytic
count (the residuals of the step's jaxpr, no compile) and the jaxpr's FLOPs: for each stack
``s`` and policy ``o``, the step with ``o`` on the blocks of ``s`` and ``none`` elsewhere, minus
the step with ``none`` everywhere, per block:

    bytes(S) = bytes(none) + sum_b dbytes[o_b][stack(b)]
    flops(S) = flops(none) + sum_b dflops[o_b][stack(b)]

The analytic count is a sum of saved residuals, so this is exact for it up to the residuals at a
stack boundary (the tests check a mixed schedule against the count traced whole).

**The dynamic program** (:func:`pareto_schedules`) is a multiple-choice knapsack over the
stacks: blocks of a stack are identical, so a stack's choice is how many of its blocks take
each policy (their order does not change either sum; the ``full`` ones run first). Going
stack by stack it keeps the Pareto set of (bytes, FLOPs) of the stacks so far, dropping every
partial schedule another beats on both, so the last set is every schedule that is the least
recomputation for some activation budget: :func:`least_recompute` reads one off. Rotor
(Beaumont et al. 2019) solves a finer problem (which block inputs to keep across the backward
pass, with the recomputation's own transient peak); this program sees only what the analytic
count sees, and the planner compiles its answers to check them.

**In the planner** the schedules are the remat axis' ``blocks`` family (:data:`BLOCKS`, a
:class:`~lowmem_jax.core.technique.Family`): each schedule the program keeps is a compute class.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from lowmem_jax.blocks.policy import SCHEDULE_POLICIES, parse_policy, schedule_name
from lowmem_jax.core.technique import Family

__all__ = [
    "BlockCosts",
    "Schedule",
    "measure_block_costs",
    "predict",
    "rescale",
    "pareto_schedules",
    "least_recompute",
    "BLOCKS",
]


@dataclasses.dataclass(frozen=True)
class BlockCosts:
    """What each policy costs one block of each stack, next to ``none``.

    Attributes:
      stacks: blocks per stack, in the order the model runs them.
      base_bytes, base_flops: the step with ``none`` on every block (analytic bytes, FLOPs).
      dbytes, dflops: per policy name, per stack: the change of the analytic activation bytes /
        the step's FLOPs when one block of the stack takes that policy instead of ``none``.
    """

    stacks: tuple[int, ...]
    base_bytes: float
    base_flops: float
    dbytes: dict[str, tuple[float, ...]]
    dflops: dict[str, tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One per-block schedule with its predicted activation bytes and step FLOPs."""

    policies: tuple[str, ...]
    bytes: float
    flops: float

    @property
    def name(self) -> str:
        """The ``remat`` value: a preset when every block has the same policy."""
        if len(set(self.policies)) == 1:
            return self.policies[0]
        return schedule_name(self.policies)


def measure_block_costs(
    stacks: Sequence[int],
    activation_bytes: Callable[[str], float],
    flops: Callable[[str], float],
    policies: Sequence[str] = ("dots", "full"),
) -> BlockCosts:
    """Per-block costs from ``1 + len(stacks) * len(policies)`` evaluations of
    ``activation_bytes(remat)`` and ``flops(remat)`` (module docstring)."""
    stacks = tuple(int(n) for n in stacks)
    total = sum(stacks)
    base_bytes = float(activation_bytes("none"))
    base_flops = float(flops("none"))
    dbytes: dict[str, tuple[float, ...]] = {"none": (0.0,) * len(stacks)}
    dflops: dict[str, tuple[float, ...]] = {"none": (0.0,) * len(stacks)}
    starts = list(itertools.accumulate(stacks, initial=0))
    for policy in policies:
        db, df = [], []
        for s, n in enumerate(stacks):
            per_block = ["none"] * total
            per_block[starts[s] : starts[s] + n] = [policy] * n
            name = Schedule(tuple(per_block), 0.0, 0.0).name
            db.append((float(activation_bytes(name)) - base_bytes) / n)
            df.append((float(flops(name)) - base_flops) / n)
        dbytes[policy], dflops[policy] = tuple(db), tuple(df)
    return BlockCosts(stacks, base_bytes, base_flops, dbytes, dflops)


def rescale(costs: BlockCosts, base_bytes: float, uniform_bytes: dict[str, float]) -> BlockCosts:
    """``costs`` carried to another setting (e.g. a precision) from its counts of the uniform
    schedules only: ``base_bytes`` (``none`` throughout) and ``uniform_bytes[policy]`` (that
    policy throughout); each policy's per-block changes are scaled so that its uniform sum is
    the count. Exact where the setting scales every block's residuals alike (the microbatch
    size); an approximation otherwise (dtypes differ between residuals), 2 counts instead of
    ``1 + stacks * policies``."""
    dbytes = {"none": costs.dbytes["none"]}
    for policy, nbytes in uniform_bytes.items():
        before = sum(d * n for d, n in zip(costs.dbytes[policy], costs.stacks, strict=True))
        scale = (nbytes - base_bytes) / before if before else 0.0
        dbytes[policy] = tuple(d * scale for d in costs.dbytes[policy])
    return dataclasses.replace(costs, base_bytes=float(base_bytes), dbytes=dbytes)


def predict(costs: BlockCosts, policies: Sequence[str]) -> Schedule:
    """A schedule's activation bytes and FLOPs by the costs' sums (one policy per block)."""
    if len(policies) != sum(costs.stacks):
        raise ValueError(f"{len(policies)} policies for {sum(costs.stacks)} blocks")
    stack_of = [s for s, n in enumerate(costs.stacks) for _ in range(n)]
    nbytes = costs.base_bytes + sum(
        costs.dbytes[p][s] for p, s in zip(policies, stack_of, strict=True)
    )
    flops = costs.base_flops + sum(
        costs.dflops[p][s] for p, s in zip(policies, stack_of, strict=True)
    )
    return Schedule(tuple(policies), nbytes, flops)


def _stack_choices(n: int, policies: Sequence[str]) -> list[tuple[str, ...]]:
    """Every way to give ``n`` identical blocks the ``policies`` (counts; fixed order)."""
    return [
        tuple(p for p in policies for _ in range(counts[policies.index(p)]))
        for counts in itertools.product(range(n + 1), repeat=len(policies))
        if sum(counts) == n
    ]


def _pareto(points: list[tuple[float, float, tuple[str, ...]]]) -> list:
    """The points no other beats on both bytes and FLOPs (ties: the first), by bytes."""
    out: list = []
    for point in sorted(points, key=lambda p: (p[1], p[0])):  # by FLOPs, then bytes
        if not out or point[0] < out[-1][0]:
            out.append(point)
    return sorted(out, key=lambda p: p[0])


def pareto_schedules(costs: BlockCosts, policies: Sequence[str] | None = None) -> list[Schedule]:
    """Every schedule that is the least recomputation for some activation budget, by bytes
    (module docstring). ``policies``: those the blocks may take (default: every one measured,
    in :data:`~lowmem_jax.blocks.policy.SCHEDULE_POLICIES` order)."""
    policies = tuple(p for p in SCHEDULE_POLICIES if p in (policies or costs.dbytes))
    if "none" not in policies or any(p not in costs.dbytes for p in policies):
        raise ValueError(
            f"policies={policies!r} must include 'none' and only measured ones "
            f"({sorted(costs.dbytes)})"
        )
    # ``full`` first within a stack: the same sums in any order; one fixed order per count.
    order = tuple(sorted(policies, key=lambda p: ("full", "dots", "none").index(p)))
    frontier = [(costs.base_bytes, costs.base_flops, ())]
    for s, n in enumerate(costs.stacks):
        options = []
        for choice in _stack_choices(n, order):
            db = sum(costs.dbytes[p][s] for p in choice)
            df = sum(costs.dflops[p][s] for p in choice)
            options.append((db, df, choice))
        frontier = _pareto(
            [(b + db, f + df, c + dc) for b, f, c in frontier for db, df, dc in options]
        )
    return [Schedule(c, b, f) for b, f, c in frontier]


def least_recompute(schedules: Sequence[Schedule], activation_bytes: float) -> Schedule | None:
    """The schedule of ``schedules`` (:func:`pareto_schedules`) with the fewest FLOPs whose
    activations fit ``activation_bytes``; ``None`` when none does."""
    fits = [s for s in schedules if s.bytes <= activation_bytes]
    return min(fits, key=lambda s: (s.flops, s.bytes), default=None)


def _stacks(model) -> tuple[int, ...] | None:
    stacks = getattr(model, "block_stacks", None)
    return None if stacks is None else tuple(stacks())


def _carry(costs: BlockCosts, saved: Callable[[str], float]) -> BlockCosts:
    return rescale(costs, saved("none"), {p: saved(p) for p in ("dots", "full")})


def _members(costs: BlockCosts) -> list[tuple[float, str]]:
    """The schedules the program keeps, those with one policy throughout left out (they are
    the remat axis' named values)."""
    return [(s.flops, s.name) for s in pareto_schedules(costs) if len(set(s.policies)) > 1]


def _saved_change(costs: BlockCosts, remat: str) -> float:
    return predict(costs, parse_policy(remat).schedule).bytes - costs.base_bytes


_ORDER = ("full", "dots", "none")  # within a stack, as pareto_schedules orders a stack's blocks


def _neighbours(stacks: tuple[int, ...], remat: str) -> list[str]:
    """The schedules one block away from ``remat`` (a schedule, or a policy every block
    takes): one block of a stack moved to another of ``none`` / ``dots`` / ``full``, the
    stack's blocks ordered ``full``, ``dots``, ``none``."""
    policies = parse_policy(remat).schedule or (remat,) * sum(stacks)
    if not set(policies) <= set(_ORDER):
        return []
    names = []
    starts = list(itertools.accumulate(stacks, initial=0))
    for a, b in itertools.pairwise(starts):
        for block, other in itertools.product(range(a, b), _ORDER):
            if other == policies[block]:
                continue
            moved = list(policies)
            moved[block] = other
            moved[a:b] = sorted(moved[a:b], key=_ORDER.index)
            names.append(moved[0] if len(set(moved)) == 1 else schedule_name(moved))
    return names


#: The remat axis' ``blocks`` family: a policy per block of the model's scanned stacks.
BLOCKS = Family(
    "blocks", _stacks, measure_block_costs, _carry, _members, _saved_change, _neighbours
)
