"""Computation run by the host: a function under JAX's host compute, its results in host memory
(the optimizer's update next to a state kept there, a streamed parameter's gradient summed
there). On XLA:CPU host and device are one memory and one processor: the same values."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.experimental import compute_on as compute_on_lib

__all__ = ["on_host"]

# The function transform: ``compute_on2`` in JAX 0.10, renamed ``compute_on`` in 0.11 (whose
# ``compute_on`` of 0.10, a context manager taking the type alone, is gone).
_COMPUTE_ON = getattr(compute_on_lib, "compute_on2", compute_on_lib.compute_on)


def on_host(fn: Callable) -> Callable:
    """``fn`` run by the host's processor, its results in host memory (``Space.Host``)."""
    return _COMPUTE_ON(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
