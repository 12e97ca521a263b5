"""Did each technique of a plan take effect? One :class:`~lowmem_jax.core.technique.Verdict` per
technique the plan turns on, from the step's jaxpr and state (compile-free).

>>> for v in lm.verdicts(step, state, batch, plan=plan, tx=tx):
...     print(v.technique, v.took_effect, v.evidence)

A setting that is on but changed nothing (an int8 state whose every array is under the size
that gets quantized; remat without a checkpointed region) comes back with ``took_effect`` False,
and :func:`lowmem_jax.analysis.memory.analyze` callers (``lowmem analyze``) print it as a warning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import optax

from lowmem_jax.analysis.analytic import microbatch_args, microbatch_residuals
from lowmem_jax.analysis.state import StateView, state_view
from lowmem_jax.core.base import Optimizer, PyTree, as_optimizer
from lowmem_jax.core.jaxprs import traced_equations, without_checkpoints
from lowmem_jax.core.technique import Evidence, Verdict
from lowmem_jax.techniques import TECHNIQUES

__all__ = ["verdicts"]


def verdicts(
    train_step: Callable,
    state: PyTree,
    batch: PyTree,
    *,
    plan,
    tx: optax.GradientTransformation | Optimizer,
    loss_fn: Callable | None = None,
) -> list[Verdict]:
    """Each registered technique's verdict
    (:attr:`~lowmem_jax.core.technique_hooks.ReportHooks.verdict`) on the step
    ``train_step(state, batch)`` (traced, not compiled or run) of ``plan`` with optimizer
    ``tx``, in the registry's order; techniques the plan leaves off give none. ``loss_fn``: the
    loss the step was made from (``make_train_step``'s); with it, remat's verdict weighs the
    residuals saved with and without its checkpoints."""
    jaxpr = jax.make_jaxpr(getattr(train_step, "__wrapped__", train_step))(state, batch).jaxpr
    opt = as_optimizer(tx)
    if not all(hasattr(state, part) for part in StateView._fields):
        state = state_view(state)  # a dict or flax's TrainState: the parts the hooks read
    saved = None
    if loss_fn is not None:
        saved = functools.partial(
            _saved_residuals, plan.model_loss(loss_fn), state, batch, plan.microbatches, opt
        )
    evidence = Evidence(state=state, batch=batch, tx=opt, jaxpr=jaxpr, saved_residuals=saved)
    found = []
    for technique in TECHNIQUES:
        if technique.report.verdict is not None:
            verdict = technique.report.verdict(evidence, plan)
            if verdict is not None:
                found.append(verdict)
    return found


def _saved_residuals(loss_fn, state, batch, microbatches, tx, checkpoints: bool) -> int | None:
    """:attr:`Evidence.saved_residuals`: :func:`microbatch_residuals` of ``loss_fn``, or of it
    with its checkpoints inlined (``None`` where one cannot be: inside a custom derivative)."""
    if not checkpoints:
        loss_fn = without_checkpoints(loss_fn)
        args = microbatch_args(state, batch, microbatches, tx=tx)
        if {e.primitive.name for e in traced_equations(loss_fn, *args)} & {"checkpoint", "remat2"}:
            return None
    return microbatch_residuals(loss_fn, state, batch, microbatches, tx=tx)["bytes"]
