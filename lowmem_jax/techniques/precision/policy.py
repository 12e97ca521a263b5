"""Precision policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is three dtypes, as in jmp:

* ``param_dtype``: the dtype the train state stores parameters (and so optimizer slots) in;
* ``compute_dtype``: the dtype the forward and backward passes run in;
* ``output_dtype``: the dtype of the loss and of the returned metrics (always float32 here).

Named policies:

==============  ===========  =============  ==========================================
name            param dtype  compute dtype  meaning
==============  ===========  =============  ==========================================
``fp32``        float32      float32        the baseline
``bf16``        bfloat16     bfloat16       everything half, no master copy
``fp16``        float16      float16        everything half, no master copy
``mixed_bf16``  float32      bfloat16       fp32 master weights, bf16 compute
``mixed_fp16``  float32      float16        fp32 master weights, fp16 compute (the report's
                                            "FP16 training"; pair it with loss scaling)
==============  ===========  =============  ==========================================

Only floating-point leaves are cast: integer and boolean leaves (labels, token ids, masks, step
counters) pass through untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.core.base import PyTree, cast_floating, in_host_memory

__all__ = ["Policy", "POLICIES", "get_policy", "cast_floating", "cast_loss_fn"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """Three dtypes: storage of parameters, computation, and outputs (loss, metrics)."""

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any = jnp.float32

    def cast_to_param(self, tree: PyTree) -> PyTree:
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        return cast_floating(tree, self.output_dtype)

    @property
    def is_half(self) -> bool:
        """True when any computation runs in a 16-bit float type."""
        return jnp.dtype(self.compute_dtype).itemsize < 4

    @property
    def needs_loss_scale(self) -> bool:
        """float16 has a 5-bit exponent: small gradients underflow without loss scaling."""
        return jnp.dtype(self.compute_dtype) == jnp.float16


POLICIES: dict[str, Policy] = {
    "fp32": Policy(jnp.float32, jnp.float32),
    "bf16": Policy(jnp.bfloat16, jnp.bfloat16),
    "fp16": Policy(jnp.float16, jnp.float16),
    "mixed_bf16": Policy(jnp.float32, jnp.bfloat16),
    "mixed_fp16": Policy(jnp.float32, jnp.float16),
}


def get_policy(name: str | Policy) -> Policy:
    """Returns the named policy; a :class:`Policy` passes through.

    Raises:
      ValueError: naming ``precision`` and the allowed names, for an unknown name.
    """
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown precision={name!r}; allowed values: {sorted(POLICIES)}"
        ) from None


def cast_loss_fn(loss_fn: Callable[..., Any], policy: Policy | str) -> Callable[..., Any]:
    """Runs ``loss_fn`` in the policy's compute dtype and returns its outputs in float32.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``. The wrapped
    function casts ``params`` and the floating leaves of ``batch`` to ``compute_dtype`` before the
    call and casts ``loss`` and ``metrics`` to ``output_dtype`` after it. ``model_state`` (e.g.
    BatchNorm running statistics) is neither cast in nor out: it keeps its stored dtype, float32.

    Because the cast of ``params`` happens inside the differentiated function, ``jax.grad`` of the
    wrapped loss returns gradients in ``param_dtype``: with ``mixed_*`` policies that is float32,
    the master-weight dtype.
    """
    policy = get_policy(policy)

    def wrapped(params, model_state, batch, rng):
        # A parameter in host memory (weight streaming) is cast where the model uses it, on the
        # device: cast here, the whole of it would be read in host memory.
        params = jax.tree.map(
            lambda x: x if in_host_memory(x) else policy.cast_to_compute(x), params
        )
        loss, (new_model_state, metrics) = loss_fn(
            params, model_state, policy.cast_to_compute(batch), rng
        )
        return policy.cast_to_output(loss), (new_model_state, policy.cast_to_output(metrics))

    return wrapped
