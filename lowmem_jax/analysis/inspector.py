"""What holds memory at the peak of a compiled step, buffer by buffer, and which line made it.

:func:`inspect` compiles a step (compile-only: nothing runs, no data) with XLA's dumps on and
reads three of them: the buffer assignment (every value XLA keeps: its allocation, offset and
size), the live ranges (each value's first and last position in the program's schedule) and the
optimized HLO (each instruction's JAX ``op_name`` and the source ``file:line`` JAX recorded).

**Live bytes** at schedule position ``t``: every parameter allocation (the step's arguments,
live throughout), plus the union of the byte ranges of the other values live at ``t`` (a value
that XLA writes in place of another shares its bytes: counted once). The **peak** is the
largest. It is at most XLA's total (``memory_analysis()``: arguments + outputs + temporaries -
aliased); the difference is named in :attr:`Inspection.reconciliation` (XLA packs the
temporaries into one block whose size can exceed the most that is live at once).

**Categories** (a heuristic from the op names JAX writes, stated so that it can be checked):
an argument by its path (``parameter`` under ``params``, ``optimizer state`` under
``opt_state``, ``model state``, ``batch``, else ``argument``); ``output`` for the step's other
outputs; a backward value (``transpose(`` in its op name) shaped like a parameter is a
``gradient``; any other value made before the forward pass ends (its last instruction with
``jvp(`` and no ``transpose(`` in the op name before the middle of the backward pass, whose
instructions have ``transpose(``) and still live after it is a ``saved residual``
(XLA's own layout copies of activations included: they carry no op name); everything else is
``workspace``.

:func:`compare` says what a second step removed from or added to the first's peak, by category
and by source line.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from lowmem_jax.analysis import memory, xla_dumps
from lowmem_jax.core.units import MIB

__all__ = ["Buffer", "Inspection", "inspect", "compare", "CATEGORIES"]

#: Every category, in the order timelines stack them.
CATEGORIES = (
    "parameter",
    "optimizer state",
    "model state",
    "batch",
    "argument",
    "output",
    "saved residual",
    "gradient",
    "workspace",
)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value XLA keeps in memory.

    Attributes:
      name: the HLO value (``instruction{tuple index}``).
      bytes: its size.
      counted_bytes: the part of it counted at the peak (0 where it shares the bytes of another
        value live then: written in place).
      shape: its HLO shape, e.g. ``f32[64,256]{1,0}``.
      memory_space: ``device``, or ``host`` (XLA memory space 5: pinned host).
      allocation: ``argument``, ``output`` or ``temp``.
      category: see the module docstring.
      op_name: the JAX op name of the instruction that makes it (an argument: its path).
      source: ``file:line (function)`` of the innermost frame outside installed packages JAX
        recorded for it (for a copy XLA added, e.g. a layout transpose, that of what it copies,
        marked ``[a copy XLA made]``); ``""`` where none.
      live: its first and last schedule positions.
    """

    name: str
    bytes: int
    counted_bytes: int
    shape: str
    memory_space: str
    allocation: str
    category: str
    op_name: str
    source: str
    live: tuple[int, int]


@dataclasses.dataclass
class Inspection:
    """The peak of one compiled step (module docstring).

    Attributes:
      backend: ``cpu`` / ``gpu`` / ``tpu``: the figures are XLA's for it.
      peak_position: the schedule position of the peak; ``positions`` in all.
      peak_bytes: the live bytes there.
      peak_instruction: the instruction running there, and its op name.
      buffers: the buffers live at the peak, largest counted first.
      timeline: ``{category: [live bytes at each schedule position]}``.
      xla: ``memory_analysis()``'s figures (``argument_bytes``, ``output_bytes``,
        ``alias_bytes``, ``temp_bytes``, ``total_bytes``).
      reconciliation: the peak against XLA's total, and the difference named.
    """

    backend: str
    positions: int
    peak_position: int
    peak_bytes: int
    peak_instruction: str
    buffers: list[Buffer]
    timeline: dict[str, list[int]]
    xla: dict[str, int]
    reconciliation: dict[str, Any]

    def by_category(self) -> dict[str, int]:
        """Counted bytes at the peak per category (largest first)."""
        return _sum_by(self.buffers, lambda b: b.category)

    def by_source(self) -> dict[str, int]:
        """Counted bytes at the peak per source line (largest first); a buffer without one
        (an argument, an XLA copy of one) by its op name, else its HLO name."""
        return _sum_by(self.buffers, lambda b: b.source or b.op_name or b.name)

    def table(self, top: int = 15) -> str:
        """The peak as text: totals per category, then the ``top`` largest buffers."""
        lines = [
            f"peak {self.peak_bytes / MIB:.2f} MiB at position {self.peak_position} of "
            f"{self.positions} ({self.peak_instruction}); XLA:{self.backend.upper()} total "
            f"{self.xla['total_bytes'] / MIB:.2f} MiB: {self.reconciliation['explanation']}",
            "by category: "
            + ", ".join(f"{k} {v / MIB:.2f}" for k, v in self.by_category().items() if v),
            f"{'MiB':>8}  {'category':<15} {'shape':<24} source / op",
        ]
        for b in [b for b in self.buffers if b.counted_bytes][:top]:
            where = b.source or b.op_name or b.name
            lines.append(
                f"{b.counted_bytes / MIB:8.2f}  {b.category:<15} {_short(b.shape):<24} {where}"
                + ("  [host]" if b.memory_space == "host" else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["by_category"] = self.by_category()
        out["by_source"] = self.by_source()
        return out

    def plot(self, path: str, title: str = "") -> None:
        """A PNG of the timeline: live MiB at each schedule position, stacked by category, the
        peak marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [c for c in CATEGORIES if any(self.timeline.get(c, ()))]
        fig, ax = plt.subplots(figsize=(9, 4.5))
        x = np.arange(self.positions)
        ax.stackplot(x, *[np.asarray(self.timeline[c]) / MIB for c in names], labels=names)
        ax.axvline(self.peak_position, color="k", lw=0.8, ls="--")
        ax.annotate(
            f"peak {self.peak_bytes / MIB:.1f} MiB",
            (self.peak_position, self.peak_bytes / MIB),
            xytext=(5, -12),
            textcoords="offset points",
        )
        ax.set_xlabel("position in the compiled program's schedule")
        ax.set_ylabel("live MiB")
        ax.set_title(title or f"live bytes by category (XLA:{self.backend.upper()})")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _sum_by(buffers: Iterable[Buffer], key: Callable[[Buffer], str]) -> dict[str, int]:
    totals: dict[str, int] = collections.Counter()
    for b in buffers:
        totals[key(b)] += b.counted_bytes
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _short(shape: str) -> str:
    return re.sub(r"\{[^}]*\}$", "", shape)


# --- compile with dumps -------------------------------------------------------------------------


def inspect(step: Any, *args: Any) -> Inspection:
    """The peak of ``step(*args)`` (a jitted function, e.g. :func:`lowmem_jax.make_train_step`'s
    or a hand-written ``jax.jit`` step; ``args`` arrays or ``jax.ShapeDtypeStruct``), compiled
    here, as an analysis (:func:`~lowmem_jax.analysis.memory.analysis_compiler_options`), with XLA's
    dumps (module docstring); JAX's persistent cache is set aside (cached: no dumps).

    Raises:
      RuntimeError: XLA wrote no buffer assignment (a backend that does not dump one).
    """
    compiled, (assignment_text, live_text, hlo_text) = xla_dumps.compile_with_dumps(
        step.lower(*args), memory.analysis_compiler_options()
    )
    xla = {k: v for k, v in memory.xla_memory(compiled).items() if isinstance(v, int)}
    return _analyse(assignment_text, live_text, hlo_text, xla, jax.default_backend())


def _argument_category(op_name: str) -> str:
    if "opt_state" in op_name:
        return "optimizer state"
    if "model_state" in op_name:
        return "model state"
    if "params" in op_name:
        return "parameter"
    if op_name.startswith("batch") or "batch" in op_name.split(".")[0]:
        return "batch"
    return "argument"


def _turn(forward: list[int], backward: list[int], positions: int) -> int:
    """Where the backward pass begins: after the last forward instruction before its middle
    (XLA schedules some backward work early, BatchNorm's, and may schedule a forward-named
    fusion among the backward pass: neither moves it)."""
    forward = [i for i in forward if not backward or i < backward[len(backward) // 2]]
    return forward[-1] + 1 if forward else (backward[0] if backward else positions)


def _analyse(assignment: str, live: str, hlo: str, xla: dict[str, int], backend: str) -> Inspection:
    allocations = xla_dumps.allocations(assignment)
    sequence, ranges = xla_dumps.live_ranges(live)
    op_names, sources = xla_dumps.sources(hlo)
    positions = max(len(sequence), 1)
    last = positions - 1
    own = {n: op for n, op in op_names.items() if not op.startswith("copy of ")}
    forward = [i for i, n in enumerate(sequence)
               if "jvp(" in own.get(n, "") and "transpose(" not in own.get(n, "")]  # fmt: skip
    backward = [i for i, n in enumerate(sequence) if "transpose(" in own.get(n, "")]
    turn = _turn(forward, backward, positions)

    def instruction(name: str) -> str:
        return name.split("{", 1)[0]

    # Arguments: live throughout, one buffer per allocation (values written in place into a
    # donated argument share its bytes).
    arguments: list[Buffer] = []
    param_shapes: set[str] = set()
    for a in allocations:
        if a.kind != "argument" or not a.values:
            continue
        name, _, _, shape = a.values[0]
        op = op_names.get(instruction(name), instruction(name))
        category = _argument_category(op)
        if category == "parameter":
            param_shapes.add(_short(shape))
        arguments.append(Buffer(name, a.size, a.size, shape, a.space, "argument", category, op,
                                "", (0, last)))  # fmt: skip

    # Every other value, with a global address (allocation base + offset) for the unions.
    rows = []
    base = 0
    for a in allocations:
        if a.kind in ("argument", "other"):
            continue
        for name, size, offset, shape in a.values:
            if name not in ranges or size == 0 or shape.startswith("("):
                continue  # a tuple's table of pointers, or a value without a range
            start, end = ranges[name]
            op = op_names.get(instruction(name), "")
            if a.kind == "output":
                category = "output"
            elif "transpose(" in op:
                category = "gradient" if _short(shape) in param_shapes else "workspace"
            elif start < turn <= end:  # made before the backward pass, kept into it
                category = "saved residual"
            else:
                category = "workspace"
            rows.append((base + offset, size, start, end, name, shape, a, category, op))
        base += a.size
    lo = np.array([r[0] for r in rows], dtype=np.int64)
    size = np.array([r[1] for r in rows], dtype=np.int64)
    start = np.array([r[2] for r in rows], dtype=np.int64)
    end = np.array([r[3] for r in rows], dtype=np.int64)
    category_of = np.array([CATEGORIES.index(r[7]) for r in rows], dtype=np.int64)

    timeline = np.zeros((len(CATEGORIES), positions), dtype=np.int64)
    for b in arguments:
        timeline[CATEGORIES.index(b.category)] += b.bytes

    def counted_at(t: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices of the rows live at ``t`` and the bytes each adds to the union."""
        idx = np.nonzero((start <= t) & (end >= t))[0]
        if not len(idx):
            return idx, idx
        idx = idx[np.lexsort((-(lo[idx] + size[idx]), lo[idx]))]
        hi = lo[idx] + size[idx]
        reach = np.maximum.accumulate(hi)
        before = np.concatenate([[np.iinfo(np.int64).min], reach[:-1]])
        return idx, np.clip(hi - np.maximum(lo[idx], before), 0, None)

    for t in range(positions):
        idx, counted = counted_at(t)
        if len(idx):
            add = np.bincount(category_of[idx], counted, len(CATEGORIES))
            timeline[:, t] += add.astype(np.int64)
    totals = timeline.sum(0)
    peak = int(np.argmax(totals))
    idx, counted = counted_at(peak)
    buffers = list(arguments)
    for i, c in zip(idx, counted, strict=True):
        _, nbytes, s, e, name, shape, a, category, op = rows[i]
        source = sources.get(instruction(name), "")
        if source and op.startswith("copy of "):
            source += " [a copy XLA made]"
        buffers.append(Buffer(name, nbytes, int(c), shape, a.space, a.kind, category, op, source,
                              (s, e)))  # fmt: skip
    buffers.sort(key=lambda b: (-b.counted_bytes, -b.bytes, b.name))
    peak_bytes = int(totals[peak])
    temp_live = int(sum(b.counted_bytes for b in buffers if b.allocation == "temp"))
    difference = xla["total_bytes"] - peak_bytes
    unused_temp = xla["temp_bytes"] - temp_live
    explanation = (
        f"the peak is {peak_bytes / xla['total_bytes']:.1%} of it"
        if xla["total_bytes"]
        else "XLA reports no bytes"
    )
    if xla["total_bytes"] and abs(difference) > 0.01 * xla["total_bytes"]:
        explanation += (
            f"; of the {difference / MIB:.2f} MiB not live at the peak, "
            f"{unused_temp / MIB:.2f} MiB are of the temporaries' block (XLA packs every "
            "temporary into one block sized for the whole schedule; not all of it is in use at "
            f"once) and {(difference - unused_temp) / MIB:.2f} MiB outputs not yet written"
        )
    name = sequence[peak] if peak < len(sequence) else "?"
    reconciliation = {
        "peak_bytes": peak_bytes,
        "xla_total_bytes": xla["total_bytes"],
        "difference_bytes": difference,
        "temp_live_at_peak_bytes": temp_live,
        "temp_block_unused_at_peak_bytes": unused_temp,
        "explanation": explanation,
    }
    return Inspection(
        backend=backend,
        positions=positions,
        peak_position=peak,
        peak_bytes=peak_bytes,
        peak_instruction=f"{name}: {op_names.get(name, '')}".rstrip(": "),
        buffers=buffers,
        timeline={c: timeline[i].tolist() for i, c in enumerate(CATEGORIES)},
        xla=xla,
        reconciliation=reconciliation,
    )


# --- compare ------------------------------------------------------------------------------------


def compare(before: Inspection, after: Inspection, top: int = 8) -> dict[str, Any]:
    """What ``after``'s peak removed from or added to ``before``'s: the change in counted bytes
    and buffers per category, the ``top`` largest changes per source line (an instruction's
    name where XLA kept no source), and sentences; changes under 0.1% of the larger peak are
    left out."""

    def counts(insp: Inspection, key) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for b in insp.buffers:
            if b.counted_bytes:
                out[key(b)][0] += b.counted_bytes
                out[key(b)][1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}

    noise = 0.001 * max(before.peak_bytes, after.peak_bytes)

    def diff(key) -> list[dict[str, Any]]:
        a, b = counts(before, key), counts(after, key)
        rows = []
        for k in set(a) | set(b):
            (ba, na), (bb, nb) = a.get(k, (0, 0)), b.get(k, (0, 0))
            if abs(bb - ba) > noise:
                rows.append({"key": k, "bytes": bb - ba, "buffers": nb - na, "before": ba,
                             "after": bb})  # fmt: skip
        return sorted(rows, key=lambda r: -abs(r["bytes"]))

    categories = diff(lambda b: b.category)
    sources = diff(lambda b: b.source or b.op_name or b.name)[:top]
    sentences = []
    for row in categories:
        verb = "removed" if row["bytes"] < 0 else "added"
        sentences.append(
            f"{verb} {abs(row['buffers'])} {row['key']} buffers, {abs(row['bytes']) / MIB:.2f} MiB"
            if row["buffers"] * row["bytes"] > 0
            else f"{row['key']}: {row['bytes'] / MIB:+.2f} MiB ({row['buffers']:+d} buffers)"
        )
    return {
        "peak_bytes": {"before": before.peak_bytes, "after": after.peak_bytes},
        "xla_total_bytes": {"before": before.xla["total_bytes"], "after": after.xla["total_bytes"]},
        "categories": categories,
        "sources": sources,
        "sentences": sentences,
    }
