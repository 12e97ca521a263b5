"""The configurations a memory report analyses (``lowmem report``, :mod:`lowmem_jax.report`):
rows of ``(name, group, plan)``, the plain Flax/Optax step, our step with no technique, each
technique alone at several settings, then combinations; :func:`model_grid` picks a model's
grid, ``full`` or ``quick``.
"""

from __future__ import annotations

import dataclasses

from lowmem_jax.factorization import FactorConfig
from lowmem_jax.plan import Plan
from lowmem_jax.remat import CONV_OUT, DOT_OUT
from lowmem_jax.sparsity import report_sparsity

__all__ = ["GridRow", "GRIDS", "divisor_at_most", "standard_grid", "quick_rows", "model_grid"]

# (name, group, plan); plan None is the plain step (lowmem_jax.workloads.build_plain).
GridRow = tuple[str, str, Plan | None]


def divisor_at_most(batch_size: int, target: float) -> int:
    """The largest divisor of ``batch_size`` that is <= ``target`` (at least 1)."""
    return max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= max(target, 1))


def standard_grid(
    batch_size: int, saved_name: str = CONV_OUT, *, images: bool = True
) -> list[GridRow]:
    """``(name, group, plan)`` for ``plain`` (plan ``None``), the baseline, single techniques
    and combinations.

    Microbatch sizes are 64, 32, ..., 2 examples for a power-of-two batch; for another batch each
    becomes the largest divisor of ``batch_size`` below it (100: 50, 25, 10, 5, 2), so every
    row splits the batch evenly. ``saved_name``: the ``checkpoint_name`` the ``save:`` remat row
    keeps (``conv_out`` in the WideResNet, ``dot_out`` in the DynamicConv Transformer).
    ``images``: the batch holds images, so the ``uint8 input`` rows apply (``input_dtype``).
    """

    def micro(target: int) -> int:
        return divisor_at_most(batch_size, target)

    grid: list[GridRow] = [("plain", "plain", None), ("baseline", "baseline", Plan())]
    for precision in ("mixed_bf16", "mixed_fp16", "bf16", "fp16"):
        grid.append((precision, "precision", Plan(precision=precision)))
    sizes = sorted({micro(t) for t in (64, 32, 16, 8, 4, 2) if 1 < micro(t) < batch_size},
                   reverse=True)  # fmt: skip
    for size in sizes:
        grid.append((f"microbatch {size}", "microbatching", Plan(microbatches=batch_size // size)))
    for remat in ("dots", f"save:{saved_name}", "full", "every:2", "sqrt"):
        grid.append((f"remat {remat}", "remat", Plan(remat=remat)))
    for sparsity in (0.5, 0.7, 0.9):
        grid.append(
            (f"sparse {sparsity:.0%} dsr", "sparsity", Plan(sparsity=report_sparsity(sparsity)))
        )
    for fmt in ("bf16", "int8", "int4"):
        grid.append((f"state {fmt}", "optimizer state", Plan(optimizer_state=fmt)))
    uint8 = {"input_dtype": "uint8"} if images else None
    if uint8:
        grid.append(("uint8 input", "input", Plan(**uint8)))
    for fmt in ("bf16", "int8", "int2"):
        grid.append((f"act {fmt}", "activations", Plan(activations=fmt)))
    for fmt in ("bf16", "int8", "int4"):
        plan = Plan(optimizer_state=fmt, sparsity=report_sparsity(0.9))
        grid.append((f"sparse 90% dsr + state {fmt}", "optimizer state", plan))
    tucker = FactorConfig("tucker", 0.25)
    grid.append(("factorize tucker 25%", "factorization", Plan(factorize=tucker)))
    plan = Plan(remat="full", factorize=tucker)
    grid.append(("factorize tucker 25% + remat full", "factorization", plan))
    combos = [
        ("mixed_fp16", 32, "full"),
        ("fp16", 32, "full"),
        ("fp16", 8, "full"),
        ("fp16", 4, "full"),
        ("bf16", 4, "full"),
        ("fp16", 2, "full"),
    ]
    seen = set()
    for precision, target, remat in combos:
        size = micro(target)
        if 1 < size < batch_size and (precision, size) not in seen:
            seen.add((precision, size))
            plan = Plan(precision=precision, microbatches=batch_size // size, remat=remat)
            grid.append((f"{precision} + mb {size} + remat {remat}", "combined", plan))
    # Inside the report's envelope (lowmem_jax.report.ENVELOPE): the smallest microbatch of at
    # least 8 examples, then with DSR 70%.
    size = min(d for d in range(8, batch_size + 1) if batch_size % d == 0) if batch_size > 8 else 0
    if 1 < size < batch_size:
        plan = Plan(precision="mixed_fp16", microbatches=batch_size // size, remat="full")
        grid.append((f"mixed_fp16 + mb {size} + remat full", "combined", plan))
        plan = dataclasses.replace(plan, sparsity=report_sparsity(0.7))
        name = f"mixed_fp16 + mb {size} + remat full + sparse 70%"
        grid.append((name, "combined", plan))
        if uint8:
            grid.append((f"{name} + uint8 input", "combined", dataclasses.replace(plan, **uint8)))
        # Compression instead of recomputation: no second forward pass.
        plan = dataclasses.replace(plan, remat="none", activations="int8")
        name = f"mixed_fp16 + mb {size} + act int8 + sparse 70%"
        grid.append((name, "combined", plan))
        # What `lowmem plan` answers at 700 MiB for the IWSLT transformer: float32, remat dots.
        plan = Plan(microbatches=batch_size // size, remat="dots", optimizer_state="bf16",
                    sparsity=report_sparsity(0.7))  # fmt: skip
        name = f"mb {size} + remat dots + state bf16 + sparse 70%"
        grid.append((name, "combined", plan))
    size = micro(2)
    if 1 < size < batch_size:  # the least-memory combination, at three sparsities
        for sparsity in (0.7, 0.8, 0.9):
            plan = Plan(
                precision="fp16",
                microbatches=batch_size // size,
                remat="full",
                sparsity=report_sparsity(sparsity),
            )
            name = f"fp16 + mb {size} + remat full + sparse {sparsity:.0%}"
            grid.append((name, "combined", plan))
            if sparsity == 0.7:  # the mask fixed at initialisation: no rewiring in the step
                static = dataclasses.replace(plan.sparsity, algorithm="static")
                name = f"fp16 + mb {size} + remat full + static sparse 70%"
                grid.append((name, "combined", dataclasses.replace(plan, sparsity=static)))
        if uint8:
            grid.append((f"{name} + uint8 input", "combined", dataclasses.replace(plan, **uint8)))
        plan = dataclasses.replace(plan, optimizer_state="int4")
        grid.append((f"fp16 + mb {size} + remat full + sparse 90% + state int4", "combined", plan))
    return grid


#: Which rows a report analyses: ``quick`` (``lowmem report``'s default) the plain step, the
#: baseline, each technique alone at the report's setting and the combined rows the headline
#: comes from; ``full`` the whole :func:`standard_grid`.
GRIDS = ("quick", "full")


def quick_rows(grid: list[GridRow]) -> list[GridRow]:
    """The rows of ``grid`` that ``--grid quick`` keeps: ``plain`` and ``baseline``;
    ``mixed_fp16``, the microbatch row nearest 8 examples, ``remat full``, ``sparse 70% dsr``,
    ``state int8``, ``uint8 input``, ``factorize tucker 25%`` and ``act int8``; of the combined
    rows, the in-envelope ones (``mixed_fp16`` with the most techniques, compressed activations
    aside; for a model without image input, ``lowmem plan``'s float32 answer for the IWSLT
    transformer) and the least-memory ones at 90% sparsity or with a static mask (the last
    two). A combined row whose twin with ``uint8 input`` is in the grid is left to the twin
    (the same plan with 1-byte images: fewer bytes, the same compile)."""
    singles = {"mixed_fp16", "remat full", "sparse 70% dsr", "state int8", "uint8 input",
               "factorize tucker 25%", "act int8"}  # fmt: skip
    micro = [name for name, group, _ in grid if group == "microbatching"]
    if micro:
        singles.add(min(micro, key=lambda n: abs(int(n.split()[-1]) - 8)))
    combined = [name for name, group, _ in grid if group == "combined"]
    combined = [n for n in combined if f"{n} + uint8 input" not in combined]
    images = any(group == "input" for _, group, _ in grid)
    inside = [n for n in combined if n.startswith("mixed_fp16 + ") and "sparse 70%" in n
              and "act " not in n]  # fmt: skip
    planned = [n for n in combined if "remat dots + state bf16" in n and not images]
    least = [n for n in combined if n.startswith("fp16 + ") and
             ("sparse 90%" in n or "static sparse" in n) and "state" not in n]  # fmt: skip
    keep = {"plain", "baseline", *singles, *inside[-1:], *planned, *least[-2:]}
    return [row for row in grid if row[0] in keep]


def model_grid(model: str, batch_size: int, grid: str = "full") -> list[GridRow]:
    """:func:`standard_grid` for a named model (``grid="quick"``: its :func:`quick_rows`): the
    remat row saves its tagged outputs (``dot_out`` in the DynamicConv Transformer, else
    ``conv_out``); ``uint8 input`` rows for image models.

    Raises:
      ValueError: a ``grid`` not in :data:`GRIDS`.
    """
    if grid not in GRIDS:
        raise ValueError(f"Unknown grid={grid!r}; allowed values: {list(GRIDS)}")
    images = not model.startswith("dynamicconv")
    rows = standard_grid(batch_size, CONV_OUT if images else DOT_OUT, images=images)
    return rows if grid == "full" else quick_rows(rows)
