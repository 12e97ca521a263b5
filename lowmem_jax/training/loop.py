"""The one training loop: any registered model, any task, any plan.

Written like the Flax examples: a :class:`TrainConfig` per run (:mod:`lowmem_jax.training.config`),
then :func:`train_and_evaluate`, which reads top to bottom: the task's data, the step and state
from the one builder (:func:`lowmem_jax.workloads.build`), resume, the step loop with records
and checkpoints, the summary. A task (:mod:`lowmem_jax.training.tasks`) supplies data, periodic
evaluation and its summary; the loop does the rest the same way for every task:

* records: every ``eval_every`` steps and at the last step, ``{step, epoch, train_loss,
  train_accuracy, <the task's test metrics>, skipped_steps, loss_scale, learning_rate,
  seconds}`` appended to ``history``, to ``<checkpoint_dir>/metrics.jsonl`` and TensorBoard;
* checkpoints: every ``checkpoint_every`` steps and at the end; a step's record is written
  before that step's checkpoint, so a resumed run (``resume``) loses and repeats nothing; a
  save that falls on a skipped step waits for the next applied one, so every checkpoint is
  one a streak of skipped steps has not reached;
* data order is a function of ``(seed, step)``, so a resumed run continues exactly;
* skipped steps: a warning when a streak reaches a quarter of ``max_consecutive_skips`` or
  when most steps between two records were skipped, and :class:`NoProgressError` when the
  streak reaches ``max_consecutive_skips`` (:mod:`lowmem_jax.training.skip_guard`);
* bad paths fail before anything is loaded or compiled
  (:func:`~lowmem_jax.training.checkpointing.check_directory`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import jax

from lowmem_jax.compose.plan import Plan
from lowmem_jax.compose.step import model_params
from lowmem_jax.core.units import MIB
from lowmem_jax.planning.planner import plan_for_budget
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.training import tasks as tasks_lib
from lowmem_jax.training.checkpointing import (
    check_directory,
    checkpoint_steps,
    param_checksum,
    restore_model,
    resume_or_start,
)
from lowmem_jax.training.config import DEFAULT_PLAN, TrainConfig
from lowmem_jax.training.run_identity import check_run
from lowmem_jax.training.skip_guard import NoProgressError, SkipGuard
from lowmem_jax.workloads.builder import build

__all__ = ["TrainConfig", "train_and_evaluate", "DEFAULT_PLAN", "NoProgressError"]


class _Meter:
    """Means of the training loss and accuracy since the last record."""

    def __init__(self):
        self.sums, self.count = {"loss": 0.0, "accuracy": 0.0}, 0

    def add(self, metrics) -> None:
        self.count += 1
        for k in self.sums:
            self.sums[k] += float(metrics[k])

    def flush(self) -> dict[str, float]:
        out = {f"train_{k}": v / max(self.count, 1) for k, v in self.sums.items()}
        self.sums, self.count = {k: 0.0 for k in self.sums}, 0
        return out


def train_and_evaluate(config: TrainConfig, log=print) -> dict[str, Any]:
    """Trains ``config.model`` on ``config.dataset``; returns the summary with the history.

    ``log`` receives one line per record (``None`` to stay quiet).
    """
    from tqdm.auto import tqdm

    if config.checkpoint_dir:  # a bad path fails now, not after the data and the compile
        check_directory(config.checkpoint_dir, resume=config.resume)
        moved = check_run(
            config.checkpoint_dir,
            config.identity(),
            resume=config.resume,
            overwrite=config.overwrite,
        )
        if moved and log:
            log(f"moved the run that was in {config.checkpoint_dir} to {moved}")
    if config.data_dir and not os.path.isdir(config.data_dir):  # TFDS would blame the dataset
        what = "is a file, not a directory" if os.path.exists(config.data_dir) else "does not exist"
        raise FileNotFoundError(f"data_dir={config.data_dir} {what}")
    if config.decompose_from and not checkpoint_steps(config.decompose_from):
        raise FileNotFoundError(
            f"decompose_from: no checkpoint in {os.path.abspath(config.decompose_from)}"
        )

    # Data, the step and the state.
    task = tasks_lib.make_task(config)
    total_steps = task.total_steps
    if config.resume and checkpoint_steps(config.checkpoint_dir)[-1] > total_steps:
        raise ValueError(
            f"the run in checkpoint_dir={config.checkpoint_dir} is at step "
            f"{checkpoint_steps(config.checkpoint_dir)[-1]}, past the {total_steps} steps this "
            "command trains (epochs / steps): give more to continue it"
        )
    work = task.workload(config)
    recipe = config.recipe(work.recipe)
    plan, warm_start = config.plan, None
    if config.memory_budget is not None:
        chosen = plan_for_budget(
            work, config.memory_budget, envelope=config.memory_envelope, recipe=recipe,
            devices=config.memory_devices,
        )  # fmt: skip
        plan = chosen.plan
        if log:
            each = " per device" if config.memory_devices > 1 else ""
            log(
                f"memory budget {config.memory_budget / MIB:.1f} MiB{each}: "
                f"{' '.join(chosen.argv[4:]) or 'no technique'} "
                f"({chosen.xla['source']} {chosen.xla['total_bytes'] / MIB:.1f} MiB, FLOPs "
                f"{chosen.flops_overhead:.3f} of the fp32 step)"
            )
    if config.decompose_from:  # ranks from its weights are needed on resume too (the shapes)
        plan, warm_start = _warm_started(work, plan, config.decompose_from, log)
    setup = build(work, plan, recipe=recipe, total_steps=total_steps)
    rng = jax.random.PRNGKey(config.seed)
    first_batch = next(task.train_batches(0, 1))[1]  # SNIP's gradient is taken on it
    variables = None
    if warm_start is not None and not config.resume:
        variables = warm_start(setup)
    state = setup.init_state(first_batch, rng, jit=task.jit_init, variables=variables)
    checkpointer, state, metrics_writer = resume_or_start(
        state,
        config.checkpoint_dir,
        every=config.checkpoint_every,
        keep=config.keep,
        resume=config.resume,
        tensorboard=config.tensorboard,
    )
    start_step = int(state.step)
    if log and start_step:
        log(f"resumed from step {start_step} in {config.checkpoint_dir}")
    materialize = jax.jit(lambda s: model_params(s, setup.tx))
    evaluator = task.evaluator(setup)
    learning_rate = recipe.learning_rate_fn(total_steps)
    guard = SkipGuard(
        config.max_consecutive_skips,
        min_loss_scale=getattr(state.loss_scale, "min_loss_scale", None),
    )

    # The step loop.
    # A resumed run's history is the whole run's: the records written before the resume first.
    history, meter = list(metrics_writer.kept) if metrics_writer else [], _Meter()
    start = last = time.perf_counter()
    start_skipped, save_due = int(state.skipped_steps), False
    bar = tqdm(total=total_steps, initial=start_step, disable=not config.progress, leave=False)
    try:
        for epoch, batch in task.train_batches(start_step, total_steps):
            state, metrics = setup.step(state, batch)
            step = int(state.step)
            warning = guard.observe(step, metrics)  # raises NoProgressError
            if warning:
                warnings.warn(warning, RuntimeWarning, stacklevel=2)
            meter.add(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
            if step % task.eval_every == 0 or step == total_steps:
                record = {
                    "step": step,
                    "epoch": epoch,
                    **meter.flush(),
                    **evaluator.evaluate(materialize(state), state.model_state),
                    "skipped_steps": int(state.skipped_steps),
                    "loss_scale": float(state.loss_scale.loss_scale),
                    "learning_rate": float(learning_rate(step - 1)),  # of this step's update
                    "seconds": time.perf_counter() - start,
                }
                history.append(record)
                if metrics_writer:  # the record first, then the checkpoint of its step
                    metrics_writer.write(record)
                if log:
                    now = time.perf_counter()
                    log(_record_line(record, now - last))
                    last = now
                _warn_if_mostly_skipped(
                    history, {"step": start_step, "skipped_steps": start_skipped}
                )
            if checkpointer:
                save_due |= step % config.checkpoint_every == 0
                if save_due and guard.streak == 0:
                    checkpointer.save(step, state, force=True)
                    save_due = False
    except NoProgressError as err:
        if checkpointer:
            err.args = (
                f"{err.args[0]}; the last checkpoint before it is step "
                f"{checkpointer.latest_step()} in {checkpointer.directory}",
            )
        for closable in (checkpointer, metrics_writer):
            if closable:
                closable.close()
        raise
    except KeyboardInterrupt:
        # Ctrl-C: the checkpoint being written finishes (or is left as Orbax's temporary
        # directory) before the process exits, so no background writer dies mid-way.
        for closable in (checkpointer, metrics_writer):
            if closable:
                closable.close()
        raise
    finally:
        bar.close()
    train_seconds = time.perf_counter() - start
    if checkpointer:
        checkpointer.save(int(state.step), state, force=True)

    # The summary.
    params = materialize(state)
    summary = {
        "model": config.model_name,
        "dataset": config.dataset,
        "plan": setup.plan.to_dict(),
        "recipe": dataclasses.asdict(recipe),
        "seed": config.seed,
        "param_count": int(sum(x.size for x in jax.tree.leaves(params))),
        "param_checksum": param_checksum(state.params),
        **setup.tx.describe(state.opt_state),
        "steps": int(state.step),
        "skipped_steps": int(state.skipped_steps),
        "train_seconds": train_seconds,
        "backend": jax.default_backend(),
        **task.summary(evaluator, state, params, history, checkpointer, materialize),
        "history": history,
    }
    if start_step:
        summary["resumed_from_step"] = start_step
    if checkpointer:
        checkpointer.close()
    if metrics_writer:
        metrics_writer.close()
    summary["seconds"] = time.perf_counter() - start
    return summary


def _warm_started(work, plan: Plan, source: str, log):
    """``(plan, start)`` for a run from the trained variables in ``source`` (``decompose_from``):
    each technique's warm start (:class:`~lowmem_jax.core.technique.WarmStart`) reads the plan
    from them, and ``start(setup) -> variables`` gives the built model's first variables."""
    dense_params, dense_state, step = restore_model(source)
    variables = {"params": dense_params, **dense_state}
    starts = [t.workload.warm_start for t in TECHNIQUES if t.workload.warm_start is not None]
    for warm in starts:
        try:
            plan = warm.plan(work, plan, variables)
        except ValueError as err:
            raise ValueError(f"decompose_from: {err}") from None

    def start(setup):
        made = variables
        for warm in starts:
            try:
                made = warm.variables(setup, made)
            except ValueError as err:
                raise ValueError(f"decompose_from: step {step} in {source} is {err}") from None
            if log:
                log(warm.describe(setup.plan, f"step {step} of {source}"))
        return made

    return plan, start


def _warn_if_mostly_skipped(history: list[dict[str, Any]], start: dict[str, int]) -> None:
    """Warns when more than half of the steps since the previous record (or ``start``: the
    run's first ``step`` and ``skipped_steps``) were skipped."""
    record, previous = history[-1], history[-2] if len(history) > 1 else start
    since = record["step"] - previous["step"]
    skipped = record["skipped_steps"] - previous["skipped_steps"]
    if since and skipped > since / 2:
        warnings.warn(
            f"step {record['step']}: {skipped} of the last {since} steps were skipped "
            "(non-finite gradients or updates)",
            RuntimeWarning,
            stacklevel=3,
        )


def _record_line(record: dict[str, Any], seconds: float) -> str:
    tests = "  ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("test_"))
    return (
        f"step {record['step']:6d}  epoch {record['epoch']:3d}  loss {record['train_loss']:.4f}  "
        f"train acc {record['train_accuracy']:.4f}  {tests}  skipped {record['skipped_steps']}  "
        f"scale {record['loss_scale']:.0f}  lr {record['learning_rate']:.2e}  {seconds:.1f}s"
    )
