"""One writer for the benchmarks' results: a run's metadata, its ``--configs`` selection, and
the JSON + markdown + PNG files (``<stem>.json``, ``.md``, ``.png``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from lowmem_jax.core.provenance import provenance

__all__ = ["metadata", "selected_configs", "write"]


def metadata(script: str, argv: list[str] | None) -> dict[str, Any]:
    """Where and how a run was made (:func:`lowmem_jax.core.provenance.provenance`: the commit,
    library versions, backend, device and machine) and the command line (``script`` relative
    to the working directory, then ``argv`` or the process' arguments)."""
    return {
        **provenance(),
        "command": "python " + " ".join([os.path.relpath(script)] + (argv or sys.argv[1:])),
    }


def selected_configs(
    parser: argparse.ArgumentParser, given: str, allowed: Iterable[str], baseline: str
) -> list[str]:
    """The comma-separated ``--configs`` ``given``, ``baseline`` first (every ratio is taken
    against it); an unknown name is a one-line error of ``parser`` listing the allowed ones."""
    allowed = list(allowed)
    names = [n for n in given.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; allowed values: {allowed}")
    return names if baseline in names else [baseline, *names]


def write(
    stem: str,
    result: dict[str, Any],
    to_markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], str], None],
) -> None:
    """``result`` as ``<stem>.json``, its table as ``<stem>.md``, its figure as ``<stem>.png``."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(result))
    plot(result, stem + ".png")
