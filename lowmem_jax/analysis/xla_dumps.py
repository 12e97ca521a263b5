"""Reading XLA's text dumps of one compiled module: the buffer assignment (each value's
allocation, offset and size), the live ranges (the schedule and each value's first and last
position in it), and the optimized HLO (each instruction's JAX ``op_name`` and source frames).

The formats are XLA's debug output (``xla_dump_to`` with ``xla_dump_hlo_as_text``), read as
XLA 0.10's JAX writes them; :mod:`lowmem_jax.analysis.inspector` turns them into the peak.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["Allocation", "allocations", "compile_with_dumps", "live_ranges", "sources"]


def compile_with_dumps(
    lowered: Any, compiler_options: dict[str, Any] | None = None
) -> tuple[Any, tuple[str, str, str]]:
    """``lowered.compile(compiler_options)`` with XLA's text dumps, and the three dumps of the
    module (the largest, where a jit compiled small helpers too): ``(compiled, (buffer
    assignment, live ranges, optimized HLO))``. JAX's persistent compilation cache is set aside
    for this compile (a cached executable comes with no dumps) and restored after.

    Raises:
      RuntimeError: XLA wrote no buffer assignment (a backend that does not dump one).
    """
    with tempfile.TemporaryDirectory(prefix="lowmem_inspect_") as where:
        enabled = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            compiled = lowered.compile(
                compiler_options={
                    **(compiler_options or {}),
                    "xla_dump_to": where,
                    "xla_dump_hlo_as_text": True,
                }
            )
        finally:
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()
        found = glob.glob(os.path.join(where, "*after_optimizations-buffer-assignment.txt"))
        if not found:
            raise RuntimeError(f"XLA wrote no buffer assignment for this step (in {where})")
        stem = max(found, key=os.path.getsize)[: -len("-buffer-assignment.txt")]
        texts = []
        for suffix in ("-buffer-assignment.txt", "-live-range.txt", ".txt"):
            with open(stem + suffix) as f:
                texts.append(f.read())
    return compiled, (texts[0], texts[1], texts[2])


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(
    r"^ value: <\d+ (\S+?)(\{[^}]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$"
)
_RANGE = re.compile(r"^    (\S+?\{[^}]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")


@dataclasses.dataclass
class Allocation:
    index: int
    size: int
    kind: str  # argument / output / temp / other
    space: str
    values: list[tuple[str, int, int, str]]  # (name{index}, size, offset, shape)


def allocations(text: str) -> list[Allocation]:
    """The allocations of a buffer assignment, each with its values ``(name{index}, size,
    offset, shape)``; ``kind`` is ``argument``, ``output``, ``temp`` or ``other`` (constants,
    thread-local), ``space`` ``host`` for XLA's memory space 5 (pinned host), else ``device``."""
    out: list[Allocation] = []
    for line in text.splitlines():
        head = _ALLOCATION.match(line)
        if head:
            attrs = head.group(3)
            if "parameter" in attrs:
                kind = "argument"
            elif "preallocated-temp" in attrs:
                kind = "temp"
            elif "thread-local" in attrs or "constant" in attrs:
                kind = "other"
            else:
                kind = "output"  # maybe-live-out, or the output tuple
            color = re.search(r"color (\d+)", attrs)
            space = "host" if color and int(color.group(1)) == 5 else "device"
            out.append(Allocation(int(head.group(1)), int(head.group(2)), kind, space, []))
            continue
        value = _VALUE.match(line)
        if value and out:
            name = value.group(1) + (value.group(2) or "{}")
            out[-1].values.append((name, int(value.group(3)), int(value.group(4)), value.group(5)))
    return out


def live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The schedule (instruction names in order) and ``{name{index}: (first, last)}``."""
    sequence: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "sequence"
        elif stripped == "BufferLiveRange:":
            section = "ranges"
        elif stripped.startswith("Live ranges at") or stripped.startswith("Stack trace"):
            section = None
        elif section == "sequence" and ":" in stripped:
            sequence.append(stripped.split(":", 1)[1])
        elif section == "ranges":
            found = _RANGE.match(line)
            if found:
                ranges[found.group(1)] = (int(found.group(2)), int(found.group(3)))
    return sequence, ranges


def sources(hlo: str) -> tuple[dict[str, str], dict[str, str]]:
    """``{instruction: op_name}`` and ``{instruction: "file:line (function)"}``."""
    tables: dict[str, dict[int, str]] = {"FileNames": {}, "FunctionNames": {}}
    locations: dict[int, tuple[int, int, int]] = {}
    frames: dict[int, tuple[int, int]] = {}
    section = None
    op_names: dict[str, str] = {}
    frame_of: dict[str, int] = {}
    operands: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and not line.strip():
            section = None
            continue
        if section in tables:
            key, _, name = line.partition(" ")
            tables[section][int(key)] = name.strip('"')
        elif section == "FileLocations":
            key, _, rest = line.partition(" ")
            fields = dict(re.findall(r"(\w+)=(\d+)", rest))
            locations[int(key)] = (
                int(fields["file_name_id"]), int(fields["function_name_id"]), int(fields["line"])
            )  # fmt: skip
        elif section == "StackFrames":
            key, _, rest = line.partition(" ")
            fields = dict(re.findall(r"(\w+)=(\d+)", rest))
            frames[int(key)] = (int(fields["file_location_id"]), int(fields["parent_frame_id"]))
        else:
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            name = found.group(1)
            op = _OP_NAME.search(line)
            if op:
                op_names[name] = op.group(1).replace("\\'", "'")
            frame = _FRAME_ID.search(line)
            if frame:
                frame_of[name] = int(frame.group(1))
            if not op:  # a copy XLA added (layouts): named after what it copies
                operands[name] = re.findall(r"%([\w.\-]+)", found.group(2).split("metadata=")[0])
    for _ in range(4):  # through chains of such copies
        for name, sources_of in operands.items():
            if name in op_names:
                continue
            first = next((o for o in sources_of if o in op_names), None)
            if first is not None:
                op_names[name] = f"copy of {op_names[first]}"
                if first in frame_of:
                    frame_of[name] = frame_of[first]

    def where(frame: int) -> str:
        chain = []
        while frame in frames and len(chain) < 64:
            location, parent = frames[frame]
            chain.append(locations.get(location))
            frame = parent - 1  # the dump numbers parents one past the parent's id
        chain = [c for c in chain if c is not None]
        if not chain:
            return ""
        mine = [c for c in chain if "-packages/" not in tables["FileNames"].get(c[0], "")]
        file_id, function_id, line_no = (mine or chain)[0]
        path = tables["FileNames"].get(file_id, "?")
        return f"{_relative(path)}:{line_no} ({tables['FunctionNames'].get(function_id, '?')})"

    return op_names, {name: where(frame) for name, frame in frame_of.items()}


def _relative(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative
