"""The parts of a training state the analyses read, from any state a user's step takes: a
:class:`~lowmem_jax.TrainState`, ``flax.training.train_state.TrainState`` (no ``model_state``, no
``rng``), a dict, or any object with a ``params`` attribute; arrays or ``jax.eval_shape``'s
shapes alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["StateView", "state_view"]

#: The key a state without one is analysed with (the loss is traced, never run: a dropout mask
#: drawn from it has the shapes the step's has).
FIXED_RNG = jax.ShapeDtypeStruct((2,), jnp.uint32)


class StateView(NamedTuple):
    """``params`` (required), ``opt_state`` (``()`` when absent), ``model_state`` (``{}``),
    ``rng`` (:data:`FIXED_RNG`'s shape), ``loss_scale`` (``None``)."""

    params: Any
    opt_state: Any = ()
    model_state: Any = {}
    rng: Any = FIXED_RNG
    loss_scale: Any = None


def state_view(state: Any) -> StateView:
    """``state``'s parts by attribute or, for a mapping, by key.

    Raises:
      ValueError: a state with no ``params``, in one line naming what it has.
    """
    if isinstance(state, StateView):
        return state
    if isinstance(state, Mapping):
        fields, get = sorted(map(str, state)), state.get
    else:
        fields = sorted(k for k in dir(state) if not k.startswith("_"))

        def get(name, default=None):
            return getattr(state, name, default)

    if get("params") is None:
        raise ValueError(
            f"state: the analyses read the parameters from `params` (an attribute or a dict "
            f"key); this {type(state).__name__} has none "
            f"(it has: {', '.join(fields[:12]) or 'nothing'})"
        )
    rng = get("rng")
    return StateView(
        params=get("params"),
        opt_state=get("opt_state", ()),
        model_state=get("model_state") or {},
        rng=FIXED_RNG if rng is None else rng,
        loss_scale=get("loss_scale"),
    )
