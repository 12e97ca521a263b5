"""What a technique declares for ``lowmem report`` (:mod:`lowmem_jax.report.run`): the rows it
adds to the grid (:class:`ReportRow`, through ``ReportHooks.rows``) and a section of its
own after the grid (:class:`ReportSection`, through ``ReportHooks.section``).

This module imports no technique and nothing that builds a step.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = [
    "ReportRow",
    "GridContext",
    "ReportSection",
    "divisor_at_most",
    "rows_of",
]


def divisor_at_most(batch_size: int, target: float) -> int:
    """The largest divisor of ``batch_size`` that is <= ``target`` (at least 1)."""
    return max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= max(target, 1))


@dataclasses.dataclass(frozen=True)
class GridContext:
    """What a memory report's rows depend on (:mod:`lowmem_jax.report.grid`).

    Attributes:
      batch_size: the examples in a step's batch.
      saved_name: the ``checkpoint_name`` the model tags its main outputs with (``conv_out``
        in the WideResNet, ``dot_out`` in the DynamicConv Transformer).
      images: the batch holds images (their stored dtype can change).
      optimizer: the workload's optax transformation (its recipe's), for rows that apply to
        some optimizers only; ``None`` where unknown (such rows are left out).
    """

    batch_size: int
    saved_name: str
    images: bool
    optimizer: Any = None

    def examples(self, target: float) -> int | None:
        """Examples per microbatch nearest below ``target`` that split the batch into more
        than one microbatch (:func:`divisor_at_most`), or ``None`` where none does."""
        size = divisor_at_most(self.batch_size, target)
        return size if 1 < size < self.batch_size else None


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One row of a memory report (``lowmem report``).

    Attributes:
      name: the row's label (``"state int8"``).
      group: the report's group it belongs to (``"optimizer state"``).
      fields: ``{plan field: value}`` of its plan (the rest at their defaults).
      quick: in ``lowmem report``'s default grid (``--grid quick``): a technique's setting
        there is the one the report's study uses.
      section: where the row sits among the report's rows (a key of
        :data:`lowmem_jax.report.grid.ROW_ORDER`); ``None``: with the rows of the technique
        that declares it.
    """

    name: str
    group: str
    fields: dict[str, Any]
    quick: bool = False
    section: str | None = None


def rows_of(
    group: str,
    quick: str,
    settings: list[tuple[str, dict[str, Any]]] | Callable[[GridContext], list],
) -> Callable[[GridContext], tuple[ReportRow, ...]]:
    """A technique's ``ReportHooks.rows``: a :class:`ReportRow` per ``(name, fields)`` of
    ``settings`` (a list, or a function of the :class:`GridContext`); ``quick`` by name."""

    def report_rows(context: GridContext) -> tuple[ReportRow, ...]:
        given = settings(context) if callable(settings) else settings
        return tuple(ReportRow(n, group, f, quick=n == quick) for n, f in given)

    return report_rows


@dataclasses.dataclass(frozen=True)
class ReportSection:
    """A section of ``lowmem report`` after the grid, declared by a technique (the sharding
    technique's per-device bytes by stage and device count): its own flag, rows, markdown and
    plot. The report runs it with a *setting*, the flag's value resolved, where the setting
    is not empty.

    Attributes:
      key: the section's key in the report's JSON, in ``run_report``'s ``sections`` and the
        ``dest`` of its flag; its plot is ``<key>.png``.
      add_flag: ``add_flag(parser)`` adds the ``lowmem report`` flag.
      setting: ``setting(args, batch_size) -> setting``: the flag's value, resolved once JAX
        runs (e.g. ``auto`` -> the device counts the backend has); falsy: no section.
      argv: ``argv(setting) -> [flag, text]``: the flag that gives ``setting``, for the
        command a report records.
      check: ``check(batch_size, setting)`` raises ``ValueError`` naming the flag's parameter
        on a setting the report cannot run, before anything compiles.
      rows: ``rows(analyze, setting, progress) -> [dict, ...]``, where ``analyze(plan) ->
        xla`` compiles the report's workload under ``plan`` (a ``Plan``) and gives XLA's
        figures (:func:`lowmem_jax.analysis.memory.xla_memory`), and ``progress`` takes a line or is
        ``None``.
      markdown: ``markdown(rows) -> [line, ...]``: the section of ``report.md``.
      plot: ``plot(rows, title, path)``: writes the section's figure.
    """

    key: str
    add_flag: Callable[[argparse.ArgumentParser], None]
    setting: Callable[[argparse.Namespace, int], Any]
    argv: Callable[[Any], list[str]]
    check: Callable[[int, Any], None]
    rows: Callable[[Callable[[Any], dict[str, Any]], Any, Any], list[dict[str, Any]]]
    markdown: Callable[[list[dict[str, Any]]], list[str]]
    plot: Callable[[list[dict[str, Any]], str, str], None]
