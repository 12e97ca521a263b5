"""Training recipes: a model's optimizer, learning-rate schedule and loss settings.

A :class:`Recipe` is plain data; :meth:`Recipe.optimizer` builds the optax transformation for a
run of ``total_steps`` updates. The two benchmark recipes (BRIEF section 2):

* WideResNet (Zagoruyko & Komodakis / the DSR code): SGD with Nesterov momentum 0.9, weight
  decay 5e-4 on the conv and dense kernels only (:func:`sgd_nesterov`), learning rate 0.1.
* DynamicConv Transformer (fairseq ``lightconv_iwslt_de_en``): Adam (0.9, 0.98), eps 1e-8,
  decoupled weight decay 1e-4, the inverse-square-root schedule with linear warmup from 1e-7
  (:func:`inverse_sqrt_schedule`), label smoothing 0.1.

Schedules (:data:`SCHEDULES`): ``constant``; ``cosine`` decay to 0 over the run; ``step``
(x0.2 at 30%, 60% and 80% of the run: epochs 60/120/160 of 200, the WRN recipe);
``inverse_sqrt`` (fairseq's, with ``warmup``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "Recipe",
    "OPTIMIZERS",
    "SCHEDULES",
    "sgd_nesterov",
    "inverse_sqrt_schedule",
    "make_schedule",
]

OPTIMIZERS = ("sgd_nesterov", "adamw")
SCHEDULES = ("constant", "cosine", "step", "inverse_sqrt")


def inverse_sqrt_schedule(
    learning_rate: float, warmup: int, init_learning_rate: float = 1e-7
) -> optax.Schedule:
    """fairseq's ``inverse_sqrt``: linear warmup, then decay with ``1 / sqrt(step)``.

    ``lr(s) = init + (learning_rate - init) * s / warmup`` for ``s < warmup``, else
    ``learning_rate * sqrt(warmup / s)``; ``s`` is the number of updates already applied, so
    the first update uses ``init`` (as fairseq, which sets the rate after each update).
    """
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = init_learning_rate + (learning_rate - init_learning_rate) * s / warmup
        decay = learning_rate * jnp.sqrt(warmup / jnp.maximum(s, 1.0))
        return jnp.where(s < warmup, warm, decay)

    return schedule


def make_schedule(
    kind: str, learning_rate: float, total_steps: int, warmup: int = 0
) -> optax.Schedule | float:
    """The schedule ``kind`` (module docstring) for a run of ``total_steps`` updates.

    Raises:
      ValueError: for an unknown ``kind``, or ``warmup < 1`` with ``inverse_sqrt``.
    """
    total_steps = max(int(total_steps), 1)
    if kind == "constant":
        return learning_rate
    if kind == "cosine":
        return optax.cosine_decay_schedule(learning_rate, total_steps)
    if kind == "step":
        bounds = {int(total_steps * f): 0.2 for f in (0.3, 0.6, 0.8)}
        return optax.piecewise_constant_schedule(learning_rate, bounds)
    if kind == "inverse_sqrt":
        return inverse_sqrt_schedule(learning_rate, warmup)
    raise ValueError(f"Unknown lr_schedule={kind!r}; allowed values: {list(SCHEDULES)}")


def sgd_nesterov(
    learning_rate: float | optax.Schedule = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4
) -> optax.GradientTransformation:
    """The WRN recipe: SGD + Nesterov momentum, weight decay on conv/dense kernels only."""

    def kernels_only(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", None) == "kernel", params
        )

    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=kernels_only),
        optax.sgd(learning_rate, momentum=momentum, nesterov=True),
    )


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Optimizer, schedule and loss settings. Validated on construction.

    Attributes:
      optimizer: ``sgd_nesterov`` (:func:`sgd_nesterov`) or ``adamw`` (Adam 0.9 / 0.98,
        eps 1e-8, decoupled weight decay on every parameter, as fairseq's Adam).
      learning_rate: the peak rate, ``> 0``.
      schedule: one of :data:`SCHEDULES`.
      warmup: warmup updates of ``inverse_sqrt`` (``>= 1`` there, ``>= 0`` always).
      weight_decay: ``>= 0``.
      momentum: SGD's momentum, in ``[0, 1)``.
      label_smoothing: of the cross-entropy, in ``[0, 1)``.
    """

    optimizer: str
    learning_rate: float
    schedule: str
    warmup: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.9
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"Unknown optimizer={self.optimizer!r}; allowed values: {list(OPTIMIZERS)}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown lr_schedule={self.schedule!r}; allowed values: {list(SCHEDULES)}"
            )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if self.warmup < 0 or (self.schedule == "inverse_sqrt" and self.warmup < 1):
            low = 1 if self.schedule == "inverse_sqrt" else 0
            raise ValueError(f"warmup must be >= {low}, got {self.warmup}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def learning_rate_fn(self, total_steps: int) -> optax.Schedule:
        """The learning rate of update ``count`` (0-based) in a run of ``total_steps``."""
        schedule = make_schedule(self.schedule, self.learning_rate, total_steps, self.warmup)
        return schedule if callable(schedule) else (lambda count: schedule)

    def optimizer_for(self, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation for a run of ``total_steps`` updates."""
        lr = make_schedule(self.schedule, self.learning_rate, total_steps, self.warmup)
        if self.optimizer == "sgd_nesterov":
            return sgd_nesterov(lr, self.momentum, self.weight_decay)
        return optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-8, weight_decay=self.weight_decay)
