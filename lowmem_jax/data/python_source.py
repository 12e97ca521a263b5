"""A real text corpus that is on every machine with Python: the standard library's own ``.py``
sources, as bytes (nothing is downloaded).

Why this corpus: language-model accuracy needs real text, and the tests and the default
commands may download nothing. The interpreter's standard library is several megabytes of
natural-language-heavy text (code, comments, docstrings) on any machine that runs this library;
its size and content depend on the Python version, so :func:`load_python_source` reports the
root, the file counts, the bytes and a checksum of each split, which a result records.

Tokens are bytes (ids ``0 .. 255``, :data:`VOCAB_SIZE`): no tokenizer to train or ship, every
file represented exactly; a loss in nats per byte reads as bits per byte after ``/ ln 2``.
Files are read in sorted relative-path order and joined with a NUL byte (:data:`SEPARATOR`);
a file is held out when ``crc32(relative path) % held_out_every == 0``, so the split of a file
does not depend on which other files exist. ``site-packages`` / ``dist-packages`` (installed
packages, not the standard library) and ``__pycache__`` are left out.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VOCAB_SIZE", "SEPARATOR", "source_files", "load_python_source", "windows"]

VOCAB_SIZE = 256
SEPARATOR = b"\0"
_SKIPPED = ("site-packages", "dist-packages", "__pycache__")


def source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The ``.py`` files under ``root`` (default: this interpreter's standard library), sorted
    by path relative to ``root``, without installed packages and caches.

    Raises:
      ValueError: ``root`` is not a directory, or holds no ``.py`` file.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"data_dir={str(root)!r} is not a directory")
    files = sorted(
        (p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(_SKIPPED)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(f"data_dir={str(root)!r} holds no .py file")
    return files


def load_python_source(
    root: str | os.PathLike | None = None, held_out_every: int = 20
) -> dict[str, Any]:
    """The corpus of ``root``'s ``.py`` files (module docstring), split by path.

    Returns:
      ``{"train": uint8 [N], "test": uint8 [M], "info": {...}}``: each split's bytes, its files
      joined by :data:`SEPARATOR`; ``info`` the root, ``held_out_every``, and per split the
      number of files, of bytes and the sha256 of the bytes.

    Raises:
      ValueError: a ``held_out_every`` below 2, a root without ``.py`` files, or a split left
        empty.
    """
    if held_out_every < 2:
        raise ValueError(f"held_out_every must be >= 2, got {held_out_every}")
    root_path = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[bytes]] = {"train": [], "test": []}
    for path in source_files(root_path):
        name = path.relative_to(root_path).as_posix()
        split = "test" if zlib.crc32(name.encode()) % held_out_every == 0 else "train"
        parts[split].append(path.read_bytes())
    out: dict[str, Any] = {"info": {"root": str(root_path), "held_out_every": held_out_every}}
    for split, texts in parts.items():
        if not texts:
            raise ValueError(
                f"data_dir={str(root_path)!r}: no file falls in the {split} split (1 in "
                f"{held_out_every} files is held out)"
            )
        joined = SEPARATOR.join(texts)
        out[split] = np.frombuffer(joined, np.uint8)
        out["info"][split] = {
            "files": len(texts),
            "bytes": len(joined),
            "sha256": hashlib.sha256(joined).hexdigest(),
        }
    return out


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """The stream's non-overlapping training windows, ``[K, seq_len + 1]`` (a view): window
    ``k`` is ``stream[k * seq_len : (k + 1) * seq_len + 1]``, its first ``seq_len`` bytes the
    inputs and its last ``seq_len`` the targets (each window shares one byte with the next).

    Raises:
      ValueError: ``seq_len`` below 1, or a stream shorter than one window.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    count = (len(stream) - 1) // seq_len
    if count < 1:
        raise ValueError(f"a stream of {len(stream)} bytes holds no window of {seq_len + 1}")
    step = stream.strides[0]
    return np.lib.stride_tricks.as_strided(
        stream, (count, seq_len + 1), (seq_len * step, step), writeable=False
    )
