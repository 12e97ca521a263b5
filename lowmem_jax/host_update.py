"""The optimizer's update computed where its state lives: in host memory (ZeRO-Offload).

ZeRO-Offload (Ren et al. 2021) keeps the optimizer state in CPU memory and runs the update
there: each step the gradient goes to the host, the update is computed next to the state, and
only the parameter updates come back. :class:`HostUpdate` does this inside the jitted step
with JAX's memory spaces and host compute: the gradient and the parameters are moved to host
memory (``jax.memory.Space.Host``), the inner optimizer's ``update`` runs as one nested
``jit`` under JAX's host compute (``compute_type="device_host"``: XLA marks its operations
``_xla_compute_type = "host"``) with its results in host memory, and the updates are moved
back to the device; the state never leaves the host (the step's layout keeps it in
``pinned_host``).

The step's skip rule is applied on the host too: the new state is kept only where the
gradient, the updates and the new parameters are all finite (the rule of
:func:`lowmem_jax.make_train_step`, which then leaves the state as it comes back:
:attr:`HostUpdate.selects_state`), so the device never reads the state.

On XLA:CPU host and device are one memory and one processor: the step computes the same
values (tested), the program carries the host annotations, and no byte figure changes. On a
GPU the state's bytes leave the device and the update's arithmetic runs on the CPU.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from jax.experimental import compute_on as compute_on_lib

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax.base import Optimizer, PyTree, Wrapper

__all__ = ["HOST_UPDATE", "HostUpdateState", "HostUpdate", "on_host"]

#: The name of the nested ``jit`` that runs on the host (what a verdict counts).
HOST_UPDATE = "host_update"


# The function transform: ``compute_on2`` in JAX 0.10, renamed ``compute_on`` in 0.11 (whose
# ``compute_on`` of 0.10, a context manager taking the type alone, is gone).
_COMPUTE_ON = getattr(compute_on_lib, "compute_on2", compute_on_lib.compute_on)


def on_host(fn):
    """``fn`` run by the host's processor, its results in host memory (``Space.Host``)."""
    return _COMPUTE_ON(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


class HostUpdateState(NamedTuple):
    """The inner optimizer's state (``inner_state``), in host memory between steps."""

    inner_state: Any


class HostUpdate(Wrapper):
    """``inner``'s update computed on the host, its state kept there (module docstring).

    ``update(grads, state, params)``: ``grads`` and ``params`` on the device in, the updates on
    the device and the new :class:`HostUpdateState` (on the host) out; where any gradient,
    update or new parameter is non-finite, the old state comes back.
    """

    #: The step leaves the returned state as it is on a skipped step: chosen here, on the host.
    selects_state = True

    def __init__(self, inner: Optimizer):
        self.inner = inner

    def init(self, params: PyTree) -> HostUpdateState:
        return HostUpdateState(self.inner.init(params))

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, Any]:
        stored, inner_state = self.inner.store(params, grads)
        return stored, HostUpdateState(inner_state)

    def update(self, grads, state: HostUpdateState, params=None):
        inner = self.inner

        @on_host
        @jax.jit
        def host_update(grads, inner_state, params):  # named HOST_UPDATE in the program
            updates, new_state = inner.update(grads, inner_state, params)
            finite = loss_scale_lib.all_finite((grads, updates))
            if params is not None:
                finite &= loss_scale_lib.all_finite(optax.apply_updates(params, updates))
            return updates, loss_scale_lib.select_tree(finite, new_state, inner_state)

        to_host = jax.memory.Space.Host
        updates, inner_state = host_update(
            jax.device_put(grads, to_host),
            state.inner_state,
            None if params is None else jax.device_put(params, to_host),
        )
        return jax.device_put(updates, jax.memory.Space.Device), HostUpdateState(inner_state)

    def __repr__(self) -> str:
        return f"HostUpdate({self.inner!r})"
