"""The configurations a memory report analyses (``lowmem report``, :mod:`lowmem_jax.report.run`):
rows of ``(name, group, plan)``: the plain Flax/Optax step, our step with no technique, each
registered technique alone at the settings it declares
(:attr:`lowmem_jax.core.technique_hooks.ReportHooks.rows`), then combinations
(:mod:`lowmem_jax.report.combined`); :func:`model_grid` picks a model's grid, ``full`` or
``quick``.
"""

from __future__ import annotations

import dataclasses

import optax

from lowmem_jax.blocks.policy import CONV_OUT, DOT_OUT
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.report_hooks import GridContext, divisor_at_most
from lowmem_jax.report.combined import combined_rows
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.registry import workload

__all__ = ["GridRow", "GRIDS", "ROW_ORDER", "divisor_at_most", "standard_grid", "model_grid"]

# (name, group, plan); plan None is the plain step (lowmem_jax.workloads.build_plain).
GridRow = tuple[str, str, Plan | None]

#: Which rows a report analyses: ``quick`` (``lowmem report``'s default) the plain step, the
#: baseline, each technique alone at the report's setting and the combined rows the headline
#: comes from; ``full`` the whole :func:`standard_grid`.
GRIDS = ("quick", "full")

#: The order of a report's rows after ``plain`` and ``baseline``, written once: each technique's
#: rows alone (by its name; the technical report's order: precision, microbatching, remat,
#: sparsity, ..., not the order the step composes them in), then the rows that combine them
#: (:attr:`ReportRow.section`). A technique that is not named here comes after ``factorize``.
ROW_ORDER = (
    "precision",
    "microbatches",
    "remat",
    "sparsity",
    "optimizer_state",
    "second_moment",
    "input_dtype",
    "activations",
    "sparse + state",
    "factorize",
    "factorize + remat",
    "combined",
)


def standard_grid(
    batch_size: int,
    saved_name: str = CONV_OUT,
    *,
    images: bool = True,
    quick: bool = False,
    optimizer: optax.GradientTransformation | None = None,
) -> list[GridRow]:
    """``(name, group, plan)`` for ``plain`` (plan ``None``), the baseline, each technique
    alone and the combinations, in :data:`ROW_ORDER` (rows of one section in the order given);
    ``quick``:
    only the rows marked :attr:`ReportRow.quick` after the first two (each technique alone at
    the report's setting, the combined rows the headline comes from).

    A row's microbatches split the batch evenly (each the largest divisor of ``batch_size``
    at most the examples it names). ``saved_name``: the ``checkpoint_name`` the ``save:``
    remat row keeps (``conv_out`` in the WideResNet, ``dot_out`` in the DynamicConv
    Transformer). ``images``: the batch holds images, so the ``uint8 input`` rows apply.
    ``optimizer``: the workload's, for the rows that apply to some optimizers only (``None``:
    unknown, those rows left out).
    """
    context = GridContext(batch_size, saved_name, images, optimizer)
    rows = [
        dataclasses.replace(row, section=row.section or t.name)
        for t in TECHNIQUES if t.report.rows for row in t.report.rows(context)
    ]  # fmt: skip
    rows = sorted(rows + combined_rows(context), key=lambda row: _place(row.section))
    grid: list[GridRow] = [("plain", "plain", None), ("baseline", "baseline", Plan())]
    return grid + [(r.name, r.group, Plan(**r.fields)) for r in rows if r.quick or not quick]


def _place(section: str) -> float:
    """Where rows of ``section`` sit (:data:`ROW_ORDER`): an unnamed technique's after
    ``factorize``'s."""
    if section in ROW_ORDER:
        return ROW_ORDER.index(section)
    return ROW_ORDER.index("factorize") + 0.5


def model_grid(model: str, batch_size: int, grid: str = "full") -> list[GridRow]:
    """:func:`standard_grid` for a named model (``grid="quick"``: its quick rows): the
    remat row saves its tagged outputs (``dot_out`` in the DynamicConv Transformer, else
    ``conv_out``); ``uint8 input`` rows for image models.

    Raises:
      ValueError: a ``grid`` not in :data:`GRIDS`.
    """
    if grid not in GRIDS:
        raise ValueError(f"Unknown grid={grid!r}; allowed values: {list(GRIDS)}")
    work = workload(model, batch_size)
    images = work.task == "classification"
    saved = CONV_OUT if images else DOT_OUT
    optimizer = work.recipe.optimizer_for(1)
    return standard_grid(
        batch_size, saved, images=images, quick=grid == "quick", optimizer=optimizer
    )
