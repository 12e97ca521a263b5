"""Layers whose saved activations stay in the computation dtype.

Flax's ``nn.BatchNorm`` normalises in ``promote(x.dtype, float32)``: with float16 inputs the
backward pass then keeps float32 copies of every normalised activation (``x - mean``, ``y *
mul``), so half precision saves far less activation memory than it should. :class:`BatchNorm`
here computes the statistics in float32 but inside ``jax.checkpoint`` (the float32 view of ``x``
is recomputed, not stored), and applies the normalisation as one affine map in the computation
dtype:

    mean, var = E[x], E[x^2] - E[x]^2          (float32, over all axes but the last)
    mul   = scale / sqrt(var + eps)            (float32, per feature)
    y     = x * mul + (bias - mean * mul)      (in dtype: only x and per-feature vectors saved)

Parameters (``scale``, ``bias``) and statistics (``batch_stats/mean``, ``batch_stats/var``,
biased variance, float32) have the names, shapes and update rule of ``nn.BatchNorm``:
``running = momentum * running + (1 - momentum) * batch``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["BatchNorm"]


@jax.checkpoint
def _moments(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    mean = x32.mean(axes)
    # max(., 0): E[x^2] - E[x]^2 can round below zero.
    var = jnp.maximum((x32 * x32).mean(axes) - mean * mean, 0.0)
    return mean, var


class BatchNorm(nn.Module):
    """BatchNorm over all axes but the last; ``[..., C] -> [..., C]`` in ``dtype``.

    Attributes:
      use_running_average: normalise with the running statistics (evaluation) instead of the
        batch's (training, which also updates them when ``batch_stats`` is mutable).
      momentum: running-average decay (0.9 = PyTorch's ``momentum=0.1``).
      epsilon: added to the variance.
      dtype: computation/output dtype (``None``: the input's).
      param_dtype: dtype of ``scale`` and ``bias``.
    """

    use_running_average: bool = False
    momentum: float = 0.9
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        dtype = self.dtype or x.dtype
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, (features,), jnp.float32)

        if self.use_running_average:
            mean, var = ra_mean.value, ra_var.value
        else:
            mean, var = _moments(x)
            if not self.is_initializing():
                m = self.momentum
                ra_mean.value = m * ra_mean.value + (1 - m) * jax.lax.stop_gradient(mean)
                ra_var.value = m * ra_var.value + (1 - m) * jax.lax.stop_gradient(var)

        mul = scale.astype(jnp.float32) * jax.lax.rsqrt(var + self.epsilon)
        shift = bias.astype(jnp.float32) - mean * mul
        return x.astype(dtype) * mul.astype(dtype) + shift.astype(dtype)
