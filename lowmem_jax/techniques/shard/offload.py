"""The optimizer state in host memory between steps: its update computed there (ZeRO-Offload),
or on the device once the gradient exists.

ZeRO-Offload (Ren et al. 2021) keeps the optimizer state in CPU memory and runs the update
there: each step the gradient goes to the host, the update is computed next to the state, and
only the parameter updates come back. :class:`HostUpdate` does this inside the jitted step
with JAX's memory spaces and host compute: the gradient and the parameters are moved to host
memory (``jax.memory.Space.Host``), the inner optimizer's ``update`` runs as one nested
``jit`` under JAX's host compute (``compute_type="device_host"``: XLA marks its operations
``_xla_compute_type = "host"``) with its results in host memory, the updates are applied
there too (:meth:`HostUpdate.apply`), and the new parameters are moved back to the device (those
of a block streamed from host memory stay there: weight streaming); the state never leaves the
host (the step's layout keeps it in ``pinned_host``).

The step's skip rule is applied on the host too: the new parameters and state are kept only
where the gradient, the updates and the new parameters are all finite (the rule of
:func:`lowmem_jax.make_train_step`, which then takes them as they come back:
:attr:`~lowmem_jax.core.base.Optimizer.applies_updates`), so the device never reads the state.

:class:`DeviceUpdate` keeps the state in host memory the same way but runs the update on the
device: the state comes to the device only once the gradient exists (an optimization barrier
joins the two, so XLA cannot schedule the copy earlier, where the state would sit on the device
through the forward and backward passes), and the new state goes back. Moved at the start of
the step instead, a GPU's compiled step grew by more than the state
(benchmarks/results/validate_gpu_offload_b8fa9e8.md; after the gradient:
benchmarks/results/validate_gpu_offload.md).

On XLA:CPU host and device are one memory and one processor: the step computes the same
values (tested), the program carries the host annotations, and no byte figure changes. On a
GPU the state's bytes leave the device (and, with :class:`HostUpdate`, the update's arithmetic
runs on the CPU).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from lowmem_jax.core.base import Optimizer, PyTree, Wrapper
from lowmem_jax.core.finite import all_finite, select_tree
from lowmem_jax.core.host import on_host

__all__ = ["HOST_UPDATE", "HostUpdateState", "HostUpdate", "DeviceUpdate"]

#: The name of the nested ``jit`` that runs on the host (what a verdict counts).
HOST_UPDATE = "host_update"


class HostUpdateState(NamedTuple):
    """The inner optimizer's state (``inner_state``), in host memory between steps."""

    inner_state: Any


class _StateInHostMemory(Wrapper):
    """``inner``'s state kept in host memory (:class:`HostUpdateState`)."""

    #: The step leaves the returned state as it is on a skipped step: chosen by the update.
    selects_state = True

    def __init__(self, inner: Optimizer):
        self.inner = inner

    def init(self, params: PyTree) -> HostUpdateState:
        return HostUpdateState(self.inner.init(params))

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, Any]:
        stored, inner_state = self.inner.store(params, grads)
        return stored, HostUpdateState(inner_state)

    def materialize(self, params: PyTree, state: Any, blockwise: bool = False) -> PyTree:
        # What the model reads of the state (a sparse layer's positions) comes to the device.
        inner_state = jax.device_put(state.inner_state, jax.memory.Space.Device)
        return self.inner.materialize(params, inner_state, blockwise)


class HostUpdate(_StateInHostMemory):
    """``inner``'s update computed on the host, its state kept there (module docstring).

    ``update(grads, state, params)`` (the optax protocol): the updates on the device and the new
    :class:`HostUpdateState` (on the host) out; where any gradient, update or new parameter is
    non-finite, the old state comes back. The step calls :meth:`apply` instead.
    """

    #: The step calls :meth:`apply`: the parameters are updated on the host too.
    applies_updates = True

    def apply(self, grads, state: HostUpdateState, params):
        """``(params, state, grads_finite, update_finite)``: ``inner``'s update and the new
        parameters computed on the host, kept only where every gradient, update and new
        parameter is finite (the step's skip rule, decided there); each parameter back where
        its old value lives (a block streamed from host memory stays there), the flags (bool
        scalars) on the device."""
        inner = self.inner

        @on_host
        @jax.jit
        def host_update(grads, inner_state, params):  # named HOST_UPDATE in the program
            updates, new_state = inner.update(grads, inner_state, params)
            new_params = optax.apply_updates(params, updates)
            grads_finite = all_finite(grads)
            update_finite = all_finite((updates, new_params))
            kept = select_tree(
                grads_finite & update_finite, (new_params, new_state), (params, inner_state)
            )
            return *kept, grads_finite, update_finite

        to_host = jax.memory.Space.Host
        new_params, inner_state, *flags = host_update(
            jax.device_put(grads, to_host), state.inner_state, jax.device_put(params, to_host)
        )
        new_params = jax.tree.map(
            lambda new, old: jax.device_put(new, jax.typeof(old).memory_space), new_params, params
        )
        grads_finite, update_finite = jax.device_put(flags, jax.memory.Space.Device)
        return new_params, HostUpdateState(inner_state), grads_finite, update_finite

    def update(self, grads, state: HostUpdateState, params=None):
        inner = self.inner

        @on_host
        @jax.jit
        def host_update(grads, inner_state, params):  # named HOST_UPDATE in the program
            return _kept_if_finite(inner, grads, inner_state, params)

        to_host = jax.memory.Space.Host
        updates, inner_state = host_update(
            jax.device_put(grads, to_host),
            state.inner_state,
            None if params is None else jax.device_put(params, to_host),
        )
        return jax.device_put(updates, jax.memory.Space.Device), HostUpdateState(inner_state)

    def __repr__(self) -> str:
        return f"HostUpdate({self.inner!r})"


class DeviceUpdate(_StateInHostMemory):
    """``inner``'s state kept in host memory, its update computed on the device (module
    docstring): the state moved to the device after the gradient, the new one back.

    ``update(grads, state, params)``: the updates on the device and the new
    :class:`HostUpdateState` (in host memory) out; where any gradient, update or new parameter
    is non-finite, the old state comes back.
    """

    def update(self, grads, state: HostUpdateState, params=None):
        # Tied to the gradient, the state cannot come to the device before the backward pass ends.
        grads, inner_state = jax.lax.optimization_barrier((grads, state.inner_state))
        inner_state = jax.device_put(inner_state, jax.memory.Space.Device)
        updates, inner_state = _kept_if_finite(self.inner, grads, inner_state, params)
        return updates, HostUpdateState(jax.device_put(inner_state, jax.memory.Space.Host))

    def __repr__(self) -> str:
        return f"DeviceUpdate({self.inner!r})"


def _kept_if_finite(inner: Optimizer, grads, inner_state, params):
    """``inner.update``'s updates and new state, the old state where any gradient, update or new
    parameter is non-finite (:func:`lowmem_jax.make_train_step`'s skip rule)."""
    updates, new_state = inner.update(grads, inner_state, params)
    ok = all_finite((grads, updates))
    if params is not None:
        ok &= all_finite(optax.apply_updates(params, updates))
    return updates, select_tree(ok, new_state, inner_state)
