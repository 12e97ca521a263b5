"""The one builder of a train step and its state: a workload and a plan to a
:class:`~lowmem_jax.workloads.setup.Setup`.

Every caller (``lowmem analyze | report | train``, the training loop, the experiments, the
benchmarks) turns a name and a plan into a step the same way, so every figure they print refers
to the same step::

    setup = build(workload("wrn-28-2", batch_size=128), plan)
    state = setup.init_state(batch)            # or setup.abstract_state() for analysis
    state, metrics = setup.step(state, batch)
    report = setup.analyze()                   # compile-only memory analysis
"""

from __future__ import annotations

import contextlib
import dataclasses

import optax

from lowmem_jax.analysis import memory
from lowmem_jax.compose.plan import Plan
from lowmem_jax.compose.step import make_plain_train_step, make_train_step
from lowmem_jax.core.base import as_optimizer
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.recipes import Recipe
from lowmem_jax.workloads.registry import workload
from lowmem_jax.workloads.setup import Setup, variable_shapes

__all__ = ["build", "build_plain", "analyze_model", "PLAIN_MODEL_FIELDS"]


def build(
    work: Workload,
    plan: Plan,
    *,
    recipe: Recipe | None = None,
    total_steps: int | None = None,
) -> Setup:
    """The train step of ``work`` under ``plan``, with the recipe's optimizer.

    ``recipe``: overrides the workload's. ``total_steps``: the run's length, for the schedule
    (``None``: a one-step schedule, enough for analysis) and for sparsity's default
    ``end_step`` (75% of the run; ``None``: never stop). A sparse plan whose ``is_sparse`` is
    the default gets the workload's (e.g.
    :func:`~lowmem_jax.workloads.registry.translation_is_sparse`).

    The techniques meet the workload through their hooks, in the registry's order: each
    ``workload.bind`` (the batch's stored dtype, sparse training's leaves and end, the batch's
    split into microbatches), then each ``workload.check`` on the built step.

    Raises:
      ValueError: in one line, a plan that cannot apply to ``work`` (a batch size the plan's
        microbatches do not divide, a ``save:`` remat policy naming a tag the model does not
        have, ...).
    """
    config = {"model": work.name, "batch_size": work.batch_size, **plan.to_dict()}
    work, plan = plan.bind(work, total_steps)
    recipe = recipe or work.recipe
    model = plan.configure_model(work.model)
    params = variable_shapes(model, work)["params"]
    tx = plan.wrap_optimizer(_optimizer(work, recipe, total_steps or 1), params)
    loss_fn = work.loss_fn(model, recipe.label_smoothing if recipe else 0.0)
    setup = Setup(None, tx, loss_fn, model, plan, work, recipe, config)
    for technique in TECHNIQUES:  # before the step exists: a refusal builds nothing
        if technique.workload.check is not None:
            technique.workload.check(setup)
    return dataclasses.replace(setup, step=make_train_step(loss_fn, tx, plan))


# What a model's author runs: straight-line blocks, XLA's own convolution.
PLAIN_MODEL_FIELDS = {"unroll": True, "conv_impl": "xla"}


def _optimizer(work: Workload, recipe: Recipe | None, steps: int) -> optax.GradientTransformation:
    """The user's optax transformation, else the recipe's for a run of ``steps``."""
    return work.optimizer if work.optimizer is not None else recipe.optimizer_for(steps)


def build_plain(work: Workload, *, recipe: Recipe | None = None) -> Setup:
    """The plain baseline of ``work``: :func:`lowmem_jax.make_plain_train_step` (``jax.grad`` +
    the recipe's optax ``update``, float32, one batch, no lowmem transform) on the model with
    :data:`PLAIN_MODEL_FIELDS` where it has them. ``config["plain"]`` is True; ``plan`` is
    ``Plan()`` (what the analysis reads: float32, one microbatch)."""
    recipe = recipe or work.recipe
    fields = {k: v for k, v in PLAIN_MODEL_FIELDS.items() if hasattr(work.model, k)}
    model = work.model.clone(**fields) if fields else work.model
    work = dataclasses.replace(work, model=model)
    tx = _optimizer(work, recipe, 1)
    loss_fn = work.loss_fn(model, recipe.label_smoothing if recipe else 0.0)
    config = {"model": work.name, "batch_size": work.batch_size, "plain": True}
    return Setup(
        make_plain_train_step(loss_fn, tx), as_optimizer(tx), loss_fn, model, Plan(), work,
        recipe, config,
    )  # fmt: skip


def analyze_model(
    model: str,
    batch_size: int | None,
    plan: Plan | None,
    *,
    seq_len: int | None = None,
    image_size: int = 32,
    compiling: contextlib.AbstractContextManager | None = None,
) -> memory.MemoryReport:
    """Memory analysis of one train step of a named model: compile-only, no data, no step run.

    ``plan=None``: the plain baseline (:func:`build_plain`). ``compiling``: see
    :func:`lowmem_jax.analysis.memory.analyze`.

    Raises:
      ValueError: for an unknown model, a bad plan, or a batch size the microbatches don't divide.
    """
    work = workload(model, batch_size, seq_len=seq_len, image_size=image_size)
    return (build_plain(work) if plan is None else build(work, plan)).analyze(compiling)
