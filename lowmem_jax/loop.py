"""The one training loop: any registered model, any task, any plan.

Written like the Flax examples: a :class:`TrainConfig` per run, then :func:`train_and_evaluate`,
which reads top to bottom: the task's data, the step and state from the one builder
(:func:`lowmem_jax.workloads.build`), resume, the step loop with records and checkpoints,
the summary. A task (:mod:`lowmem_jax.tasks`) supplies data, periodic evaluation and its
summary; the loop does the rest the same way for every task:

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
  streak reaches ``max_consecutive_skips`` (:mod:`lowmem_jax.skip_guard`);
* bad paths fail before anything is loaded or compiled
  (:func:`~lowmem_jax.checkpointing.check_directory`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import jax

from lowmem_jax import tasks as tasks_lib
from lowmem_jax.checkpointing import (
    check_directory,
    checkpoint_steps,
    param_checksum,
    restore_model,
    resume_or_start,
)
from lowmem_jax.factorization import decompose_params, select_ranks
from lowmem_jax.plan import Plan
from lowmem_jax.planner import plan_for_budget
from lowmem_jax.recipes import Recipe
from lowmem_jax.run_identity import check_run
from lowmem_jax.setup import variable_shapes
from lowmem_jax.skip_guard import NoProgressError, SkipGuard
from lowmem_jax.train import model_params
from lowmem_jax.workloads import build, workload

__all__ = ["TrainConfig", "train_and_evaluate", "DEFAULT_PLAN", "NoProgressError"]

#: The embedded default job's plan (``lowmem train``): the report's four step techniques.
DEFAULT_PLAN = Plan(precision="mixed_fp16", microbatches=4, remat="full")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. ``None`` means the dataset's or the model's default.

    The defaults are the embedded default job: WideResNet-16-2 on the digits that ship with
    scikit-learn, mixed fp16 with dynamic loss scaling, 4 microbatches, per-block remat.

    Attributes:
      dataset: one of :data:`lowmem_jax.tasks.DATASETS` (its task: classification or
        translation).
      model: a registry name (:data:`lowmem_jax.workloads.MODEL_NAMES`) of the dataset's task;
        ``None``: ``wrn-16-2`` (classification), ``dynamicconv-small`` (translation).
      plan: the techniques (:class:`lowmem_jax.Plan`, sparsity included).
      epochs, steps: the run's length, one of the two (``None`` both: 10 epochs for
        classification, 200 steps for translation).
      batch_size: images per batch (classification).
      max_tokens: padded tokens per batch (translation; fairseq ``--max-tokens``).
      learning_rate, lr_schedule, warmup, weight_decay, momentum, label_smoothing: override the
        model's :class:`~lowmem_jax.recipes.Recipe`.
      seed: parameters, dropout, data split and order.
      data_dir: the TFDS directory (CIFAR-10, IWSLT'14, TED); nothing is downloaded.
      image_size: digits only (8, 16 or 32 pixels; 8 is the original resolution).
      fold, folds: digits only: test on the ``fold``-th of ``folds`` stratified folds shuffled
        by ``seed`` (cross-validation) instead of the 80/20 split.
      dropout, model_overrides, vocab_size, length_multiple, eval_sentences, beam_size,
        length_penalty, max_len_a, max_len_b, average_last: translation
        (:mod:`lowmem_jax.tasks.translation`).
      eval_every: steps between records (``None``: one epoch for classification, 1000 steps
        for translation).
      checkpoint_dir, checkpoint_every, keep_checkpoints, resume: Orbax checkpoints (module
        docstring); ``keep_checkpoints=None`` keeps ``max(3, average_last)``. The directory
        records the run's :meth:`identity` (``run.json``): ``resume`` with another identity is
        refused, and so is a new run in a directory that holds checkpoints, unless
        ``overwrite`` (the old run is moved aside whole to ``<checkpoint_dir>.previous``).
      decompose_from: a checkpoint directory of the same model trained dense: its newest
        parameters are decomposed into the plan's factorized layers
        (:func:`lowmem_jax.factorization.decompose_params`; BatchNorm statistics copied) and
        fine-tuned, instead of starting from scratch. Needs ``plan.factorize``.
      memory_budget: bytes the compiled train step may take: the plan is chosen by
        :func:`lowmem_jax.planner.plan_for_budget` (fewest FLOPs that fits, inside
        ``memory_envelope``: ``report`` or ``any``) and replaces ``plan``, which must be left at
        its default.
      max_consecutive_skips: stop with :class:`NoProgressError` after this many skipped steps
        in a row (``0``: never).
      tensorboard: also write the records as TensorBoard scalars.
      progress: a progress bar on stderr.
    """

    dataset: str = "digits"
    model: str | None = None
    plan: Plan = DEFAULT_PLAN
    epochs: int | None = None
    steps: int | None = None
    batch_size: int = 128
    max_tokens: int = 1024
    learning_rate: float | None = None
    lr_schedule: str | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    label_smoothing: float | None = None
    seed: int = 0
    data_dir: str | None = None
    image_size: int = 32
    fold: int | None = None
    folds: int = 5
    dropout: float | None = None
    model_overrides: dict[str, Any] | None = None
    vocab_size: int = 10000
    length_multiple: int = 8
    eval_sentences: int | None = 1000
    beam_size: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.0
    max_len_b: int = 8
    average_last: int = 1
    eval_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int | None = None
    resume: bool = False
    overwrite: bool = False
    decompose_from: str | None = None
    memory_budget: int | None = None
    memory_envelope: str = "report"
    max_consecutive_skips: int = 100
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self):
        task = tasks_lib.task_of(self.dataset)
        if self.epochs is not None and self.steps is not None:
            raise ValueError(
                f"give epochs or steps, not both (epochs={self.epochs}, steps={self.steps})"
            )
        for name in (
            "epochs", "steps", "batch_size", "max_tokens", "length_multiple", "beam_size",
            "average_last", "eval_every", "checkpoint_every", "keep_checkpoints", "vocab_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2, got {self.folds}")
        if self.fold is not None and not 0 <= self.fold < self.folds:
            raise ValueError(
                f"fold must be in [0, {self.folds}) (folds={self.folds}), got {self.fold}"
            )
        if self.max_consecutive_skips < 0:
            raise ValueError(
                f"max_consecutive_skips must be >= 0 (0: never stop), got "
                f"{self.max_consecutive_skips}"
            )
        if self.eval_sentences is not None and self.eval_sentences < 0:
            raise ValueError(f"eval_sentences must be >= 0 or None, got {self.eval_sentences}")
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty must be >= 0, got {self.length_penalty}")
        if self.decompose_from and self.plan.factorize is None:
            raise ValueError(
                "decompose_from needs a plan with factorized layers (--factorize cp|tucker|lowrank)"
            )
        factorize = self.plan.factorize
        if (
            factorize is not None
            and factorize.rank_rule != "compression"
            and not (self.decompose_from or factorize.ranks)
        ):
            raise ValueError(
                f"rank_rule={factorize.rank_rule!r} chooses ranks from a trained dense model: "
                "it needs decompose_from (--decompose-from DIR)"
            )
        if self.memory_budget is not None and self.plan != DEFAULT_PLAN:
            raise ValueError("memory_budget chooses the plan: leave plan at its default")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs a checkpoint_dir")
        if self.overwrite and (self.resume or not self.checkpoint_dir):
            raise ValueError(
                "overwrite=True starts a new run in a checkpoint_dir: it needs checkpoint_dir "
                "and cannot go with resume"
            )
        if self.average_last > 1 and not self.checkpoint_dir:
            raise ValueError(f"average_last={self.average_last} needs a checkpoint_dir")
        if self.average_last > self.keep:
            raise ValueError(
                f"average_last={self.average_last} needs keep_checkpoints >= average_last, "
                f"got keep_checkpoints={self.keep_checkpoints}"
            )
        work = workload(self.model_name)  # validates the name
        if work.task != task.KIND:
            raise ValueError(
                f"model={self.model_name!r} does not fit dataset={self.dataset!r} "
                f"({task.KIND}); allowed values: {task.MODELS}"
            )
        task.check_config(self)
        self.recipe(work.recipe)  # validates the recipe overrides

    @property
    def model_name(self) -> str:
        """``model``, or the dataset's default."""
        return self.model or tasks_lib.task_of(self.dataset).DEFAULT_MODEL

    def identity(self) -> dict[str, Any]:
        """What decides the trained state's structure and meaning, JSON-able: the dataset and
        its split, the model, the plan (or the budget that chooses it), the recipe's overrides
        and the seed. Not the run's length, evaluation, checkpointing or output settings: a
        resumed run may change those."""
        out = {name: getattr(self, name) for name in _IDENTITY}
        out["model"] = self.model_name
        out["plan"] = self.plan.to_dict()
        return out

    @property
    def keep(self) -> int:
        """``keep_checkpoints``, or ``max(3, average_last)``."""
        return self.keep_checkpoints or max(3, self.average_last)

    def recipe(self, base: Recipe) -> Recipe:
        """``base`` (the model's recipe) with this config's overrides."""
        overrides = {
            "learning_rate": self.learning_rate,
            "schedule": self.lr_schedule,
            "warmup": self.warmup,
            "weight_decay": self.weight_decay,
            "momentum": self.momentum,
            "label_smoothing": self.label_smoothing,
        }
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


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


#: The TrainConfig fields of a run's identity (:meth:`TrainConfig.identity`), besides the model
#: and the plan.
_IDENTITY = (
    "dataset", "batch_size", "max_tokens", "learning_rate", "lr_schedule", "warmup",
    "weight_decay", "momentum", "label_smoothing", "seed", "image_size", "fold", "folds",
    "dropout", "model_overrides", "vocab_size", "length_multiple", "decompose_from",
    "memory_budget", "memory_envelope",
)  # fmt: skip


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
    plan, dense = config.plan, None
    if config.memory_budget is not None:
        chosen = plan_for_budget(
            work, config.memory_budget, envelope=config.memory_envelope, recipe=recipe
        )
        plan = chosen.plan
        if log:
            log(
                f"memory budget {config.memory_budget / 2**20:.1f} MiB: "
                f"{' '.join(chosen.argv[4:]) or 'no technique'} "
                f"({chosen.xla['source']} {chosen.xla['total_bytes'] / 2**20:.1f} MiB, FLOPs "
                f"{chosen.flops_overhead:.3f} of the fp32 step)"
            )
    if config.decompose_from:  # ranks from its weights are needed on resume too (the shapes)
        dense = restore_model(config.decompose_from)
        plan = _plan_with_ranks(work, plan, dense[0])
    setup = build(work, plan, recipe=recipe, total_steps=total_steps)
    rng = jax.random.PRNGKey(config.seed)
    first_batch = next(task.train_batches(0, 1))[1]  # SNIP's gradient is taken on it
    variables = None
    if dense is not None and not config.resume:
        variables = _decomposed_variables(setup, dense, config.decompose_from, log)
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


def _plan_with_ranks(work, plan: Plan, dense_params) -> Plan:
    """``plan`` with the ranks its ``rank_rule`` chooses from ``dense_params`` (unchanged for
    ``compression``); where the factorized layers are comes from the model at compression
    ranks."""
    factorize = plan.factorize
    if factorize.rank_rule == "compression":
        return plan
    placeholder = dataclasses.replace(factorize, rank_rule="compression")
    model = dataclasses.replace(plan, factorize=placeholder).configure_model(work.model)
    shapes = variable_shapes(model, work)["params"]
    try:
        factorize = select_ranks(dense_params, shapes, factorize)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"decompose_from: not a dense {work.name}: {err}") from None
    return dataclasses.replace(plan, factorize=factorize)


def _decomposed_variables(setup, dense, directory: str, log) -> dict[str, Any]:
    """The factorized model's variables from ``dense`` (``restore_model`` of ``directory``)."""
    dense_params, dense_state, step = dense
    shapes = setup.abstract_variables()
    try:
        variables = {
            "params": decompose_params(dense_params, shapes["params"], setup.plan.factorize),
            **decompose_params(
                dense_state, {k: v for k, v in shapes.items() if k != "params"}, None
            ),
        }
    except ValueError as err:
        raise ValueError(
            f"decompose_from: step {step} in {directory} is not a dense {setup.workload.name}: "
            f"{err}"
        ) from None
    if log:
        factorize = setup.plan.factorize
        ranks = "" if factorize.rank_rule == "compression" else f", ranks by {factorize.rank_rule}"
        log(f"decomposed step {step} of {directory} ({factorize.method}{ranks})")
    return variables


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
