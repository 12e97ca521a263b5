"""The measured wall time of a compiled train step on the backend JAX has.

One warm-up call (its time is not kept: it can include the first transfer and allocation),
then ``repeats`` calls, each timed to ``jax.block_until_ready`` of its outputs; each call gets
the state the last returned, as training would (a step that donates its state cannot be
called twice on the same one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = ["StepTimes", "time_step"]


class StepTimes(NamedTuple):
    """Every timed call's seconds, then the last call's outputs."""

    seconds: list[float]
    state: Any
    metrics: Any

    @property
    def median(self) -> float:
        """The figure to compare (robust to one slow call)."""
        return statistics.median(self.seconds)


def time_step(step: Callable, state: Any, batch: Any, repeats: int = 3) -> StepTimes:
    """Times ``step(state, batch) -> (state, metrics)``: a warm-up call, then ``repeats``.

    Raises:
      ValueError: ``repeats`` below 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    state, metrics = jax.block_until_ready(step(state, batch))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(step(state, batch))
        seconds.append(time.perf_counter() - start)
    return StepTimes(seconds, state, metrics)
