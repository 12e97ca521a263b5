"""The registry: every technique the library composes, in order
(:class:`~lowmem_jax.core.technique.Technique`).

Each module of this package declares one technique as ``TECHNIQUE``; :data:`TECHNIQUES` holds
them all, sorted by :attr:`Technique.order`. The order is meaning: layers are replaced before
anything else configures them, the precision cast comes
before loss scaling, loss scaling before the microbatch loop, sparse training inside the
optimizer-state format; ``Plan``'s fields, a plan's label, the envelope's limits and the CLI's
flags read in this order. Generic code (``Plan``, the step, the CLI flags, the envelopes, the
planner's axes) iterates :data:`TECHNIQUES`; adding a technique is adding a module here.

Each declaration's ``order`` line says what its technique acts on;
``[(t.order, t.name) for t in TECHNIQUES]`` lists them.
"""

from __future__ import annotations

import importlib
import pkgutil

from lowmem_jax.core.technique import Technique

__all__ = ["TECHNIQUES", "technique", "report_sections"]


def _discover() -> tuple[Technique, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.append(module.TECHNIQUE)
    orders = [t.order for t in found]
    if len(set(orders)) != len(orders):
        raise ImportError(f"two techniques share an order: {sorted(orders)}")
    return tuple(sorted(found, key=lambda t: t.order))


TECHNIQUES: tuple[Technique, ...] = _discover()


def technique(name: str) -> Technique:
    """The registered technique ``name``.

    Raises:
      ValueError: an unknown name, listing the registered ones.
    """
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise ValueError(f"Unknown technique {name!r}; registered: {[t.name for t in TECHNIQUES]}")


def report_sections() -> dict:
    """The ``lowmem report`` sections the techniques declare
    (:class:`~lowmem_jax.core.report_hooks.ReportSection`), by key, in the registry's order."""
    return {t.report_section.key: t.report_section for t in TECHNIQUES if t.report_section}
