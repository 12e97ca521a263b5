"""Units of memory, written once: :data:`MIB` and :data:`GIB`, and sizes as people write them
(:func:`parse_bytes`)."""

from __future__ import annotations

import re

__all__ = ["KIB", "MIB", "GIB", "parse_bytes"]

KIB = 2**10
MIB = 2**20
GIB = 2**30

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": KIB, "mib": MIB,
          "gib": GIB}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"48MiB"``, ``"1.5 GiB"``, ``"500MB"``, ``"1024"`` (bytes) -> bytes.

    Raises:
      ValueError: anything else, naming the units allowed.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"budget {text!r} is not a positive size; give a number and a unit, one of "
            "B, KiB, MiB, GiB, KB, MB, GB (e.g. 48MiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])
