"""One training run's settings: :class:`TrainConfig`, what
:func:`lowmem_jax.training.loop.train_and_evaluate` trains, validated when it is made, and the part
of it that is the run's identity (:meth:`TrainConfig.identity`, kept in the checkpoint directory by
:mod:`lowmem_jax.training.run_identity`).

Import both from :mod:`lowmem_jax.training.loop`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowmem_jax.compose.plan import Plan
from lowmem_jax.core import base
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.training import tasks as tasks_lib
from lowmem_jax.workloads.recipes import Recipe
from lowmem_jax.workloads.registry import workload

__all__ = ["TrainConfig", "DEFAULT_PLAN"]

#: The embedded default job's plan (``lowmem train``): the report's four step techniques.
DEFAULT_PLAN = Plan(precision="mixed_fp16", microbatches=4, remat="full")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. ``None`` means the dataset's or the model's default.

    The defaults are the embedded default job: WideResNet-16-2 on the digits that ship with
    scikit-learn, mixed fp16 with dynamic loss scaling, 4 microbatches, per-block remat.

    Attributes:
      dataset: one of :data:`lowmem_jax.training.tasks.DATASETS` (its task: classification,
        translation or language modelling).
      model: a registry name (:data:`lowmem_jax.workloads.MODEL_NAMES`) of the dataset's task;
        ``None``: ``wrn-16-2`` (classification), ``dynamicconv-small`` (translation),
        ``llama-18m`` (language modelling).
      plan: the techniques (:class:`lowmem_jax.Plan`, sparsity included).
      epochs, steps: the run's length, one of the two (``None`` both: 10 epochs for
        classification, 200 steps for translation).
      batch_size: images per batch (classification).
      max_tokens: padded tokens per batch (translation; fairseq ``--max-tokens``), tokens per
        batch (language modelling: ``max_tokens // seq_len`` sequences).
      seq_len, eval_windows: language modelling: tokens per sequence, and the held-out windows
        each evaluation reads (``None``: all;
        :mod:`lowmem_jax.training.tasks.language_model`).
      learning_rate, lr_schedule, warmup, weight_decay, momentum, label_smoothing: override the
        model's :class:`~lowmem_jax.workloads.recipes.Recipe`.
      seed: parameters, dropout, data split and order.
      data_dir: the TFDS directory (CIFAR-10, IWSLT'14, TED); nothing is downloaded.
      image_size: digits only (8, 16 or 32 pixels; 8 is the original resolution).
      fold, folds: digits only: test on the ``fold``-th of ``folds`` stratified folds shuffled
        by ``seed`` (cross-validation) instead of the 80/20 split.
      dropout, model_overrides, vocab_size, length_multiple, eval_sentences, beam_size,
        length_penalty, max_len_a, max_len_b, average_last: translation
        (:mod:`lowmem_jax.training.tasks.translation`).
      eval_every: steps between records (``None``: one epoch for classification, 1000 steps
        for translation).
      checkpoint_dir, checkpoint_every, keep_checkpoints, resume: Orbax checkpoints
        (:mod:`lowmem_jax.training.loop`); ``keep_checkpoints=None`` keeps ``max(3, average_last)``.
        The directory records the run's :meth:`identity` (``run.json``): ``resume`` with another
        identity is refused, and so is a new run in a directory that holds checkpoints, unless
        ``overwrite`` (the old run is moved aside whole to ``<checkpoint_dir>.previous``).
      decompose_from: a checkpoint directory of the same model trained dense: its newest
        parameters are decomposed into the plan's factorized layers
        (:func:`lowmem_jax.techniques.factorize.decompose_params`; BatchNorm statistics copied) and
        fine-tuned, instead of starting from scratch. Needs ``plan.factorize``.
      memory_budget: bytes the compiled train step may take: the plan is chosen by
        :func:`lowmem_jax.planning.planner.plan_for_budget` (fewest FLOPs that fits, inside
        ``memory_envelope``: ``report`` or ``any``) and replaces ``plan``, which must be left at
        its default.
      memory_devices: the devices ``memory_budget`` plans over (``> 1``: the budget is per
        device, ZeRO's and a pipeline's stages are searched too, and the run uses every one of
        them; JAX must see exactly that many).
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
    seq_len: int = 128
    eval_windows: int | None = 256
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
    memory_devices: int = 1
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
            "seq_len", "eval_windows",
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
        for technique in TECHNIQUES:  # a run from trained variables (decompose_from)
            if technique.workload.warm_start is not None:
                technique.workload.warm_start.check(self.plan, self.decompose_from)
        if self.memory_budget is not None and self.plan != DEFAULT_PLAN:
            raise ValueError("memory_budget chooses the plan: leave plan at its default")
        if base.check_int(self.memory_devices, "memory_devices", 1) > 1 and (
            self.memory_budget is None
        ):
            raise ValueError("memory_devices plans over several devices: it needs memory_budget")
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
        if self.memory_devices > 1:  # left out at its default: runs recorded before it resume
            out["memory_devices"] = self.memory_devices
        if tasks_lib.task_of(self.dataset).KIND == "lm":  # the only task it shapes
            out["seq_len"] = self.seq_len
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


#: The TrainConfig fields of a run's identity (:meth:`TrainConfig.identity`), besides the model
#: and the plan.
_IDENTITY = (
    "dataset", "batch_size", "max_tokens", "learning_rate", "lr_schedule", "warmup",
    "weight_decay", "momentum", "label_smoothing", "seed", "image_size", "fold", "folds",
    "dropout", "model_overrides", "vocab_size", "length_multiple", "decompose_from",
    "memory_budget", "memory_envelope",
)  # fmt: skip
