"""Loss scaling for half-precision training, as pytree state carried in the train state.

float16 represents magnitudes down to ~6e-8 (subnormal); gradients smaller than that flush to 0.
Loss scaling multiplies the loss by ``S`` before differentiation, so every gradient is ``S`` times
larger while it travels through half-precision arithmetic, and divides the (float32) gradients by
``S`` afterwards:  ``g = grad(S * loss) / S``.

Three states share one interface (``scale``, ``unscale``, ``adjust``):

* :class:`NoOpLossScale`: ``S = 1``; the float32/bfloat16 default.
* :class:`StaticLossScale`: a fixed ``S``.
* :class:`DynamicLossScale`: ``S`` starts at 2**15; when a step's gradients are not all finite
  the step is skipped and ``S`` is divided by ``factor`` (never below ``min_loss_scale``); after
  ``period`` consecutive finite steps ``S`` is multiplied by ``factor``.

All are flax ``struct`` dataclasses: the scale and counter are array leaves, and the
configuration (``period``, ``factor``, ``min_loss_scale``) is static metadata in the treedef, so
it survives ``jax.jit``, ``lax.cond`` and checkpoint round trips unchanged (jmp drops its floor
when its state passes through ``jit``; here the floor is part of the tree structure).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lowmem_jax.core.finite import all_finite, select_tree

PyTree = Any

__all__ = [
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "LossScale",
    "make_loss_scale",
    "LOSS_SCALES",
    "all_finite",
    "select_tree",
]


def _scale(tree: PyTree, factor: jax.Array) -> PyTree:
    return jax.tree.map(lambda x: x * factor.astype(x.dtype), tree)


@struct.dataclass
class NoOpLossScale:
    """No scaling: ``scale``/``unscale`` are identities and every step is applied."""

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self


@struct.dataclass
class StaticLossScale:
    """A constant scale ``S`` (float32 scalar)."""

    loss_scale: jax.Array

    def scale(self, tree: PyTree) -> PyTree:
        return _scale(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _scale(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite
        return self


@struct.dataclass
class DynamicLossScale:
    """Dynamic loss scale.

    Attributes:
      loss_scale: float32 scalar, the current ``S``.
      counter: int32 scalar, consecutive finite steps since the last change of ``S``.
      period: finite steps after which ``S`` grows by ``factor`` (static).
      factor: growth and back-off factor (static).
      min_loss_scale: the floor for ``S`` (static; survives ``jit``).
    """

    loss_scale: jax.Array
    counter: jax.Array = struct.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    period: int = struct.field(pytree_node=False, default=2000)
    factor: float = struct.field(pytree_node=False, default=2.0)
    min_loss_scale: float = struct.field(pytree_node=False, default=1.0)

    def scale(self, tree: PyTree) -> PyTree:
        return _scale(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _scale(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """The state after a step whose gradients were (not) all finite. Pure, jit-safe."""
        grow = grads_finite & (self.counter >= self.period - 1)
        new_scale = jnp.where(
            grads_finite,
            jnp.where(grow, self.loss_scale * self.factor, self.loss_scale),
            jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale),
        )
        # Float32 overflow of the scale itself would make every later step non-finite.
        new_scale = jnp.where(jnp.isfinite(new_scale), new_scale, self.loss_scale)
        new_counter = jnp.where(grads_finite & ~grow, self.counter + 1, 0)
        return self.replace(
            loss_scale=new_scale.astype(jnp.float32), counter=new_counter.astype(jnp.int32)
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

LOSS_SCALES = ("none", "static", "dynamic")


def make_loss_scale(
    kind: str,
    *,
    initial_scale: float = 2.0**15,
    period: int = 2000,
    factor: float = 2.0,
    min_loss_scale: float = 1.0,
) -> LossScale:
    """Builds a loss-scale state by name: ``"none"``, ``"static"`` or ``"dynamic"``.

    Raises:
      ValueError: naming the offending parameter and its allowed values.
    """
    if kind not in LOSS_SCALES:
        raise ValueError(f"Unknown loss_scale={kind!r}; allowed values: {list(LOSS_SCALES)}")
    if not initial_scale > 0:
        raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
    if kind == "none":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(jnp.asarray(initial_scale, jnp.float32))
    if int(period) < 1:
        raise ValueError(f"period must be an integer >= 1, got {period}")
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    if not 0 < min_loss_scale <= initial_scale:
        raise ValueError(
            f"min_loss_scale must be in (0, initial_scale={initial_scale}], got {min_loss_scale}"
        )
    return DynamicLossScale(
        loss_scale=jnp.asarray(initial_scale, jnp.float32),
        period=int(period),
        factor=float(factor),
        min_loss_scale=float(min_loss_scale),
    )
