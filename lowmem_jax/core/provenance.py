"""Where a result came from: the commit of the code that made it, the library versions and the
machine (:func:`provenance`), for every result file to record."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import jax

__all__ = ["source_commit", "provenance"]


def source_commit(path: str | os.PathLike | None = None) -> str:
    """The git commit checked out where ``path`` (default: this package) lies, short, with
    ``+changes`` when tracked files differ from it; ``unknown`` outside a git checkout."""
    where = Path(path) if path is not None else Path(__file__).resolve().parents[2]
    run = lambda *cmd: subprocess.run(  # noqa: E731
        ["git", "-C", str(where), *cmd], capture_output=True, text=True
    )
    head = run("rev-parse", "--short", "HEAD")
    if head.returncode:
        return "unknown"
    dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def provenance() -> dict[str, Any]:
    """The commit (:func:`source_commit`), JAX's, Flax's and Optax's versions, the backend, the
    first device's kind and the machine (architecture, cores)."""
    import flax
    import optax

    return {
        "commit": source_commit(),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "optax_version": optax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
