"""Walking a traced step: every equation of a jaxpr, those nested in calls, loops,
conditionals, checkpoints and custom derivatives included (nothing is compiled or run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["equations", "traced_equations"]


def equations(jaxpr: Any, depth: int = 0) -> Iterator[tuple[Any, int]]:
    """``(eqn, loops)`` for every equation of ``jaxpr`` and of the jaxprs in its equations'
    parameters, depth first; ``loops``: the ``scan`` / ``while`` equations around it."""
    for eqn in jaxpr.eqns:
        yield eqn, depth
        inner = depth + (eqn.primitive.name in ("scan", "while"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from equations(sub, inner)


def traced_equations(fn: Callable[..., Any], *args: Any) -> Iterator[Any]:
    """Every equation of ``fn(*args)``'s jaxpr, nested ones included (traced; ``args`` may be
    ``jax.ShapeDtypeStruct``)."""
    return (eqn for eqn, _ in equations(jax.make_jaxpr(fn)(*args).jaxpr))
