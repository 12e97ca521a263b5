"""Training metrics as JSON lines and TensorBoard scalars, one writer for both training loops.

:class:`MetricsWriter` takes one record (a flat ``dict``; nested dicts are flattened with ``/``)
and its step, and writes it

- as one line of ``<directory>/metrics.jsonl`` (the whole record, ``json.dumps``), and
- as TensorBoard scalars in ``<directory>/events.out.tfevents.*`` (with :mod:`tensorboardX`, no
  TensorFlow needed): every number in the record except ``step`` (the x axis), tag = key,
  ``global_step`` = step. Booleans, strings and ``None`` are left out of TensorBoard (they stay
  in the JSON line).

Both are flushed after every record, so a killed run keeps what it wrote.

Resuming. A writer opened at ``start_step`` keeps the JSON records with ``step <=
start_step`` and drops the later ones (they were written after the checkpoint the run resumes
from, and the resumed run writes them again); on a fresh run (``start_step=0``) that starts the
history anew. TensorBoard event files are append-only: a reopened directory gets a new event
file that begins with TensorBoard's *purge* marker (``SessionLog.START`` at ``start_step + 1``),
so TensorBoard (and :func:`read_scalars`) hides the older files' events with ``step >
start_step``; they stay on disk. The training loops write a step's record before they save
that step's checkpoint, so a checkpoint at step ``s`` implies that every record up to ``s`` was
written: nothing is lost or duplicated across a kill and a resume.
"""

from __future__ import annotations

import glob
import json
import numbers
import os
import struct
from typing import Any

__all__ = ["MetricsWriter", "read_scalars", "read_jsonl", "scalars_of"]

JSONL_NAME = "metrics.jsonl"
EVENTS_GLOB = "events.out.tfevents.*"


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars :class:`MetricsWriter` writes for ``record``: tag -> value."""
    return {
        k: float(v)
        for k, v in _flatten(record).items()
        if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (``[]`` if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Writes each record to ``<directory>/metrics.jsonl`` and as TensorBoard scalars.

    Args:
      directory: where ``metrics.jsonl`` and the event files go (created if missing).
      start_step: the step the run starts from (its resumed checkpoint's, or 0): JSON records
        after it are dropped and TensorBoard events after it purged (module docstring).
      tensorboard: also write TensorBoard event files (``False``: JSON lines only).

    Attributes:
      kept: the records of ``metrics.jsonl`` up to ``start_step`` (a resumed run's history so
        far).
    """

    def __init__(self, directory: str, *, start_step: int = 0, tensorboard: bool = True):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.jsonl_path = os.path.join(directory, JSONL_NAME)
        kept = [r for r in read_jsonl(self.jsonl_path) if r.get("step", 0) <= start_step]
        self.kept = kept  # the records of the run up to start_step, as written then
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.jsonl_path)  # atomic: a kill here keeps the old file or the new
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            existing = len(glob.glob(os.path.join(directory, EVENTS_GLOB)))
            self._tb = SummaryWriter(
                directory,
                purge_step=start_step + 1 if existing else None,
                flush_secs=10,
                # tensorboardX names files by the second: a counter keeps two apart
                filename_suffix=f".{existing}",
            )

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        """Appends ``record`` (its ``step`` key unless ``step`` is given) and flushes."""
        step = int(record["step"] if step is None else step)
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for tag, value in scalars_of(record).items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _records(path: str):
    """The TFRecord payloads of one event file: ``uint64 length, uint32 masked crc32c(length),
    data, uint32 masked crc32c(data)``, little-endian; the checksums are verified."""
    from tensorboardX.record_writer import masked_crc32c

    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            length, length_crc = struct.unpack("<QI", header)
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4:
                return  # a record cut short by a kill: ignored, as TensorBoard does
            if length_crc != masked_crc32c(header[:8]) or struct.unpack("<I", footer)[0] != (
                masked_crc32c(data)
            ):
                raise ValueError(f"corrupted record in {path}")
            yield data


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Reads the TensorBoard scalars in ``directory``'s event files: tag -> ``[(step, value)]``.

    Files are read in the order they were created (the wall time in their names); a purge
    marker (``SessionLog.START`` at step ``p``) drops the events read so far with ``step >=
    p``, as TensorBoard does. Values are float32 (TensorBoard's ``simple_value``).
    """
    from tensorboardX.proto import event_pb2

    def created(path):  # events.out.tfevents.<seconds>.<host>[.<counter>]
        parts = os.path.basename(path).split(".")
        seconds = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
        return seconds, int(parts[-1]) if parts[-1].isdigit() else -1, path

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(directory, EVENTS_GLOB)), key=created):
        for data in _records(path):
            event = event_pb2.Event.FromString(data)
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                for tag in scalars:
                    scalars[tag] = [(s, v) for s, v in scalars[tag] if s < event.step]
            if event.HasField("summary"):
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        scalars.setdefault(value.tag, []).append(
                            (int(event.step), value.simple_value)
                        )
    return scalars
