"""What a compiled step sends between devices: its collectives, read from the optimized HLO.

A sharded step (``Plan(shard=...)``) communicates through the collectives XLA's SPMD
partitioner inserts: gradients all-reduced, parameters all-gathered (after a partitioned update,
and where ``zero3``'s layers use them), batch statistics and the loss all-reduced. This module
counts them in ``compiled.as_text()``: every ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all`` and ``collective-permute`` (and their asynchronous ``-start`` forms), each
executed as often as the loops around it run (a ``while``'s ``known_trip_count``; a loop without
one counts once and says so), with the branches of a conditional each counted once (an upper
bound).

Per collective of ``S`` bytes (the whole tensor on one device: the reduced one, the gathered one,
the one before scattering) over a group of ``n`` devices, each device sends under a ring
schedule (the usual cost model, as NCCL's bus bandwidth)::

    all-reduce          2 (n - 1) / n * S
    all-gather          (n - 1) / n * S
    reduce-scatter      (n - 1) / n * S
    all-to-all          (n - 1) / n * S
    collective-permute  S

These are counts from the compiled program (compile-only), not a measured transfer.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["KINDS", "collectives", "sent_per_device"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s+=\s+(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"\bbranch_computations=\{([^}]*)\}|\b(?:true|false)_computation=%?([\w.\-]+)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PARTICIPANTS = re.compile(r"\b(?:num_partitions|replica_count)=(\d+)")

_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    return int(dtype[1:])  # s4, u8, f16, f32, s64, ...


def _bytes(shape_text: str) -> int:
    """The bytes of a result shape (an array, or a tuple of them; sub-byte types packed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        count = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        total += -(-_bits(dtype) * count // 8)
    return total


def _group_size(attributes: str, devices: int) -> int:
    """The devices in each replica group: ``{{0,1,..}}``, the iota form ``[G,n]<=[..]``, or
    the mesh form ``mesh['a'=8,'b'=1] {'a'}``; 2 for a permutation's pairs; ``devices`` where
    the groups are left empty."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return int(np.prod([sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2))] or [1]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
    if iota:
        return int(iota.group(2))
    explicit = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
    if explicit:
        return len([x for x in explicit.group(1).split(",") if x.strip()])
    if re.search(r"source_target_pairs=\{\{", attributes):
        return 2  # a permutation: each device sends to one other
    return devices


def _elements(shape_text: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start : text.rindex(")")])
    return [p.strip() for p in parts if p.strip()]


def sent_per_device(kind: str, nbytes: int, group: int) -> float:
    """Bytes one device sends for a collective of ``nbytes`` over ``group`` devices (ring)."""
    if group <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(nbytes)
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * (group - 1) / group * nbytes


def _parse(hlo: str) -> tuple[dict[str, list[tuple[str, str, str]]], str | None]:
    """``({computation: [(result shape, opcode, rest of line)]}, entry name)``."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction:
            computations[current].append(instruction.groups())
    return computations, entry


def collectives(hlo: str) -> dict[str, Any] | None:
    """The collectives of one compiled module's text (``compiled.as_text()``), or ``None``
    where it has none.

    Returns:
      ``{"by_kind": {kind: {"count", "bytes", "sent_bytes"}}, "sent_bytes", "devices",
      "notes"}``: per kind, how many run per step, the bytes of their tensors (``S`` above) and
      what one device sends (ring), summed over the step; ``sent_bytes`` over every kind.
    """
    computations, entry = _parse(hlo)
    if entry is None:
        return None
    header = hlo.split("\n", 1)[0]  # SPMD partitions (jit) or replicas (pmap)
    devices = max([int(n) for n in _PARTICIPANTS.findall(header)] or [1])
    by_kind: dict[str, dict[str, float]] = {}
    notes: set[str] = set()

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64 or name not in computations:
            return
        for shape, opcode, rest in computations[name]:
            kind = opcode.removesuffix("-start")
            if kind in KINDS:
                nbytes = _bytes(shape)
                if opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
                    # (operand, result, ...): an async start's value holds both; all-reduce's
                    # start gives its result alone
                    parts = _elements(shape)
                    nbytes = _bytes(parts[1]) if len(parts) > 1 else nbytes
                group = _group_size(rest, devices)
                if kind == "reduce-scatter":
                    nbytes *= group  # S: the tensor before scattering
                row = by_kind.setdefault(kind, {"count": 0, "bytes": 0, "sent_bytes": 0.0})
                row["count"] += times
                row["bytes"] += times * nbytes
                row["sent_bytes"] += times * sent_per_device(kind, nbytes, group)
            if opcode == "while":
                trips = _TRIPS.search(rest)
                if trips is None:
                    notes.add("a loop without a known trip count is counted once")
                inner = times * (int(trips.group(1)) if trips else 1)
                for _, called in _CALLED.findall(rest):
                    visit(called, inner, depth + 1)
            elif opcode == "conditional":
                notes.add("each branch of a conditional is counted (an upper bound)")
                for listed, single in _BRANCHES.findall(rest):
                    for called in re.findall(r"%?([\w.\-]+)", listed) or [single]:
                        visit(called, times, depth + 1)
            elif opcode in ("call", "fusion", "async-start"):
                for _, called in _CALLED.findall(rest):
                    visit(called, times, depth + 1)

    visit(entry, 1)
    if not by_kind:
        return None
    for row in by_kind.values():
        row["count"], row["bytes"] = int(row["count"]), int(row["bytes"])
        row["sent_bytes"] = int(round(row["sent_bytes"]))
    return {
        "by_kind": {k: by_kind[k] for k in KINDS if k in by_kind},
        "sent_bytes": sum(r["sent_bytes"] for r in by_kind.values()),
        "devices": devices,
        "notes": sorted(notes),
    }
