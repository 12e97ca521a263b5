"""Stop a run that makes no progress: a streak of skipped steps, with its likely cause.

The train step skips an update whose gradients or updates are non-finite
(:func:`lowmem_jax.make_train_step`: metrics ``grads_finite`` and ``update_finite``). A few skips
are normal under dynamic loss scaling (an overflow halves the scale); a run where every step is
skipped (a non-finite input, a diverged learning rate, a loss scale stuck at its floor) would
otherwise carry on to the end unchanged. :class:`SkipGuard` watches the per-step metrics:

* after ``warn_after`` consecutive skipped steps it returns a warning naming the cause;
* after ``max_consecutive`` it raises :class:`NoProgressError` (the loop then keeps the last
  checkpoint written before the streak and saves nothing after it).

Causes, from the step's metrics: gradients non-finite with the loss scale at its floor (or no
loss scaling): the loss itself is non-finite (inputs, a diverged model, a too large learning
rate); updates non-finite from finite gradients: the optimizer produced them (a NaN/Inf
learning rate or hyperparameter, or an overflow in low-precision optimizer state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["SkipGuard", "NoProgressError", "skip_cause"]


class NoProgressError(RuntimeError):
    """Training skipped ``max_consecutive`` steps in a row; the message names the likely cause.

    Attributes:
      step: the step at which the run stopped.
      streak: the consecutive skipped steps.
      cause: the likely cause (:func:`skip_cause`).
    """

    def __init__(self, message: str, *, step: int, streak: int, cause: str):
        super().__init__(message)
        self.step, self.streak, self.cause = step, streak, cause


def skip_cause(metrics: Mapping[str, Any], min_loss_scale: float | None = None) -> str:
    """Why a step was skipped, from its metrics (``grads_finite``, ``update_finite``,
    ``loss_scale``); ``min_loss_scale``: the dynamic scale's floor (``None``: no dynamic
    scaling)."""
    if not bool(metrics["grads_finite"]):
        scale = float(metrics["loss_scale"])
        if min_loss_scale is not None and scale > min_loss_scale:
            return (
                f"gradients non-finite at loss scale {scale:g}, still falling towards its "
                f"floor {min_loss_scale:g}"
            )
        floor = " (its floor)" if min_loss_scale is not None else ""
        return (
            f"gradients non-finite at loss scale {scale:g}{floor}: the loss is non-finite "
            "(non-finite inputs, or a diverged model: lower the learning rate)"
        )
    return (
        "updates non-finite from finite gradients: the optimizer produced them (a NaN/Inf or "
        "too large learning rate or hyperparameter, or an overflow in low-precision optimizer "
        "state)"
    )


@dataclasses.dataclass
class SkipGuard:
    """Counts consecutive skipped steps; warns, then stops (module docstring).

    Attributes:
      max_consecutive: stop after this many skipped steps in a row (``0``: never).
      min_loss_scale: the dynamic loss scale's floor (``None``: no dynamic scaling).
      warn_after: warn when a streak reaches this many (default ``max(1, max_consecutive // 4)``,
        or 25 when ``max_consecutive`` is 0).
    """

    max_consecutive: int = 100
    min_loss_scale: float | None = None
    warn_after: int | None = None
    streak: int = 0

    def __post_init__(self):
        if self.max_consecutive < 0:
            raise ValueError(f"max_consecutive_skips must be >= 0, got {self.max_consecutive}")
        if self.warn_after is None:
            self.warn_after = max(1, self.max_consecutive // 4) if self.max_consecutive else 25

    def observe(self, step: int, metrics: Mapping[str, Any]) -> str | None:
        """Updates the streak with step ``step``'s metrics (their ``skip_streak`` when the step
        counts it, as :func:`lowmem_jax.make_train_step`'s does; else one more or none from
        ``grads_finite`` / ``update_finite``); returns a warning line when a streak reaches
        ``warn_after``.

        Raises:
          NoProgressError: when the streak reaches ``max_consecutive``.
        """
        if "skip_streak" in metrics:  # the step's own count: right when steps are observed sparsely
            streak = int(metrics["skip_streak"])
        elif bool(metrics["grads_finite"]) and bool(metrics["update_finite"]):
            streak = 0
        else:
            streak = self.streak + 1
        previous, self.streak = self.streak, streak
        if not streak:
            return None
        if self.max_consecutive and self.streak >= self.max_consecutive:
            cause = skip_cause(metrics, self.min_loss_scale)
            raise NoProgressError(
                f"training stopped at step {step}: the last {self.streak} steps were all "
                f"skipped ({cause}); max_consecutive_skips={self.max_consecutive}",
                step=step,
                streak=self.streak,
                cause=cause,
            )
        if previous < self.warn_after <= self.streak:
            return (
                f"step {step}: {self.streak} consecutive skipped steps "
                f"({skip_cause(metrics, self.min_loss_scale)})"
            )
        return None
