"""The registry of named models, and the one builder of a train step and its state.

Every caller (``lowmem analyze | report | train``, the training loop, the experiments, the
benchmarks) turns a name and a plan into a step the same way, so every figure they print refers
to the same step::

    setup = build(workload("wrn-28-2", batch_size=128), plan)
    state = setup.init_state(batch)            # or setup.abstract_state() for analysis
    state, metrics = setup.step(state, batch)
    report = setup.analyze()                   # compile-only memory analysis

Names (:data:`MODEL_NAMES`):

* ``wrn-D-K``: WideResNet-D-K, 10 classes; batch ``{"image": [B, S, S, 3] float32, "label":
  [B] int32}`` (``S = image_size``, 32; the image uint8 raw pixels under
  ``Plan(input_dtype="uint8")``, normalised by the model with CIFAR-10's statistics unless
  ``pixel_mean`` / ``pixel_std`` are given); default batch 128; the SGD Nesterov recipe.
* ``dynamicconv-iwslt``: fairseq's ``lightconv_iwslt_de_en`` (vocabularies 8,848 / 6,632);
  ``dynamicconv-small``: the CPU-sized preset (C = 64; vocabularies 32). Batch ``{"src",
  "tgt_in", "tgt_out": [B, T] int32}``; default 100 sentences x 40 tokens (the recipe's 4,000
  tokens per batch); fairseq's Adam / inverse-sqrt recipe (warmup 4,000 for the IWSLT preset,
  50 for the small one), label smoothing 0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import models
from lowmem_jax.analysis import memory
from lowmem_jax.blocks import remat
from lowmem_jax.compose.plan import Plan
from lowmem_jax.compose.step import make_plain_train_step, make_train_step
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.base import LossFn, PyTree, as_optimizer
from lowmem_jax.data import cifar10
from lowmem_jax.techniques import sparsity
from lowmem_jax.workloads import losses
from lowmem_jax.workloads.recipes import Recipe
from lowmem_jax.workloads.setup import Setup, variable_shapes

__all__ = [
    "Workload",
    "Setup",
    "workload",
    "build",
    "build_plain",
    "variable_shapes",
    "analyze_model",
    "translation_is_sparse",
    "MODEL_NAMES",
]

MODEL_NAMES = (
    "wrn-D-K (e.g. wrn-28-2), dynamicconv-small, dynamicconv-iwslt, or module:function (your "
    "model: a function returning lowmem_jax.custom_workload(...))"
)
TASKS = ("classification", "translation")

CIFAR10_PIXEL_STATS = {"pixel_mean": cifar10.PIXEL_MEAN, "pixel_std": cifar10.PIXEL_STD}
WRN_RECIPE = Recipe("sgd_nesterov", 0.1, "cosine", weight_decay=5e-4, momentum=0.9)
DYNAMICCONV_RECIPES = {
    "dynamicconv-iwslt": Recipe(
        "adamw", 5e-4, "inverse_sqrt", warmup=4000, weight_decay=1e-4, label_smoothing=0.1
    ),
    "dynamicconv-small": Recipe(
        "adamw", 2e-3, "inverse_sqrt", warmup=50, weight_decay=1e-4, label_smoothing=0.1
    ),
}


def translation_is_sparse(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """The DynamicConv Transformer's sparse leaves: its dense (``Linear``) kernels.

    :func:`~lowmem_jax.techniques.sparsity.default_is_sparse` (kernels with ndim >= 2: the
    input/output projections around each convolution, the attention projections, the FFN layers),
    minus the DynamicConv's weight-predicting ``weight_linear`` (``C -> H * K``; 2% of the IWSLT
    model's parameters), which stays dense: each of its outputs is a kernel tap fed to a softmax, so
    zeroing its inputs changes every position's convolution kernel, for little memory. The
    embeddings (``embedding``) and the output projection (``embed_out``) are not kernels and
    stay dense, as the classifier's last layer does.
    """
    return sparsity.default_is_sparse(path, shape) and "weight_linear" not in path


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named model with its task, batch shapes and recipe.

    Attributes:
      name: the registry name.
      task: ``classification`` or ``translation``.
      model: the (unconfigured) Flax module; ``Plan.configure_model`` sets remat and dtype.
      batch: ``jax.ShapeDtypeStruct`` leaves of one batch.
      init_inputs: the batch leaves ``model.init`` takes, in order, after the rng.
      recipe: the model's training :class:`~lowmem_jax.workloads.recipes.Recipe` (``None``: a user's
        model, whose ``optimizer`` is given).
      is_sparse: which parameter leaves sparse training sparsifies by default.
      init, loss, optimizer: a user's model (:func:`lowmem_jax.workloads.custom.custom_workload`):
        ``init(model, rng, batch) -> variables`` and ``loss(model) -> loss_fn`` of the model
        configured by a plan, and the optax transformation it trains with; ``None``: the
        registered model's (``model.init`` on ``init_inputs``, the task's loss, the recipe's).
    """

    name: str
    task: str
    model: Any
    batch: dict[str, jax.ShapeDtypeStruct]
    init_inputs: tuple[str, ...]
    recipe: Recipe | None
    is_sparse: Callable[[tuple[str, ...], tuple[int, ...]], bool] = sparsity.default_is_sparse
    init: Callable[[Any, jax.Array, PyTree], PyTree] | None = None
    loss: Callable[[Any], LossFn] | None = None
    optimizer: optax.GradientTransformation | None = None

    @property
    def batch_size(self) -> int:
        return next(iter(self.batch.values())).shape[0]

    def with_batch(self, batch: PyTree, batch_size: int | None = None) -> Workload:
        """This workload with the shapes and dtypes of ``batch`` (e.g. real data), the leading
        axis set to ``batch_size`` (default: ``batch``'s)."""

        def shape(x):
            size = x.shape[0] if batch_size is None else batch_size
            return jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype)

        return dataclasses.replace(self, batch={k: shape(v) for k, v in batch.items()})

    def with_input_dtype(self, input_dtype: str) -> Workload:
        """This workload with its images stored as ``input_dtype`` (``Plan.input_dtype``:
        ``float32`` normalised, ``uint8`` raw pixels the model normalises).

        Raises:
          ValueError: ``uint8`` for a workload without images.
        """
        dtype = jnp.dtype(input_dtype)
        if "image" not in self.batch:
            if input_dtype != "float32":
                raise ValueError(
                    f"input_dtype={input_dtype!r} applies to image batches; {self.name}'s batch "
                    f"has {sorted(self.batch)} (allowed here: 'float32')"
                )
            return self
        image = self.batch["image"]
        if image.dtype == dtype:
            return self
        batch = {**self.batch, "image": jax.ShapeDtypeStruct(image.shape, dtype)}
        return dataclasses.replace(self, batch=batch)

    def loss_fn(self, model: Any, label_smoothing: float) -> LossFn:
        """The task's loss for ``model`` (configured by a plan); a user's model's own."""
        if self.loss is not None:
            return self.loss(model)
        if self.task == "translation":
            return losses.translation_loss_fn(model, label_smoothing=label_smoothing)
        return losses.classifier_loss_fn(model, label_smoothing=label_smoothing)


def workload(
    name: str,
    batch_size: int | None = None,
    *,
    seq_len: int = 40,
    image_size: int = 32,
    **model_overrides: Any,
) -> Workload:
    """The named workload (module docstring) at ``batch_size`` (None: the model's default).

    ``model_overrides``: fields of the model (e.g. ``src_vocab_size``, ``dropout``).
    ``name`` ``"package.module:function"``: a user's model, ``function()`` returning its
    :func:`lowmem_jax.custom_workload` (``batch_size`` then resizes its batch).

    Raises:
      ValueError: for an unknown name or a batch size / sequence length / image size below 1.
    """
    if ":" in (name or ""):
        return _imported_workload(name, batch_size)
    for label, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if name in DYNAMICCONV_RECIPES:
        if name == "dynamicconv-iwslt":
            model = models.DynamicConvTransformer.iwslt_de_en(**model_overrides)
        else:
            model = models.DynamicConvTransformer.small(**model_overrides)
        tokens = jax.ShapeDtypeStruct((batch_size or 100, seq_len), jnp.int32)
        batch = {"src": tokens, "tgt_in": tokens, "tgt_out": tokens}
        return Workload(
            name,
            "translation",
            model,
            batch,
            ("src", "tgt_in"),
            DYNAMICCONV_RECIPES[name],
            translation_is_sparse,
        )
    match = re.fullmatch(r"wrn-(\d+)-(\d+)", name or "")
    if not match:
        raise ValueError(f"Unknown model={name!r}; allowed values: {MODEL_NAMES}")
    depth, width = map(int, match.groups())
    # CIFAR-10's statistics in pixel units, for uint8 batches (Plan.input_dtype).
    overrides = {"num_classes": 10, **CIFAR10_PIXEL_STATS, **model_overrides}
    model = models.WideResNet(depth=depth, width=width, **overrides)
    b = batch_size or 128
    batch = {
        "image": jax.ShapeDtypeStruct((b, image_size, image_size, 3), jnp.float32),
        "label": jax.ShapeDtypeStruct((b,), jnp.int32),
    }
    return Workload(name, "classification", model, batch, ("image",), WRN_RECIPE)


def _imported_workload(name: str, batch_size: int | None) -> Workload:
    """``module:function``'s workload (``function()``), its batch resized to ``batch_size``."""
    module_name, _, function = name.partition(":")
    try:
        made = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"model {name!r}: cannot call {function}() of {module_name}: {err}"
        ) from None
    if not isinstance(made, Workload):
        raise ValueError(
            f"model {name!r}: {function}() returned {type(made).__name__}, not a Workload "
            "(lowmem_jax.custom_workload(...))"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return made if batch_size is None else made.with_batch(made.batch, batch_size)


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
    the default gets the workload's (e.g. :func:`translation_is_sparse`).

    Raises:
      ValueError: a batch size the plan's microbatches do not divide, or a ``save:`` remat
        policy naming a tag the model does not have.
    """
    if work.batch_size % plan.microbatches:
        raise ValueError(
            f"batch_size={work.batch_size} is not divisible by microbatches={plan.microbatches}"
        )
    devices = sharding_lib.data_devices(plan.mesh())
    if work.batch_size % (plan.microbatches * devices):
        raise ValueError(
            f"batch_size={work.batch_size} is not divisible by microbatches={plan.microbatches}"
            f" x devices={devices} (the plan's device mesh: each device takes its share of "
            "every microbatch)"
        )
    work = work.with_input_dtype(plan.input_dtype)
    config = {"model": work.name, "batch_size": work.batch_size, **plan.to_dict()}
    sparse = plan.sparsity
    if sparse is not None:
        if sparse.is_sparse is sparsity.default_is_sparse:
            sparse = dataclasses.replace(sparse, is_sparse=work.is_sparse)
        if sparse.end_step is None and total_steps is not None:
            sparse = dataclasses.replace(sparse, end_step=int(0.75 * total_steps))
        plan = dataclasses.replace(plan, sparsity=sparse)
    recipe = recipe or work.recipe
    model = plan.configure_model(work.model)
    params = variable_shapes(model, work)
    tx = plan.wrap_optimizer(_optimizer(work, recipe, total_steps or 1), params["params"])
    loss_fn = work.loss_fn(model, recipe.label_smoothing if recipe else 0.0)
    if remat.parse_policy(plan.remat).saved_names:
        model_state = {k: v for k, v in params.items() if k != "params"}
        tagged = remat.tagged_names(
            loss_fn, params["params"], model_state, work.batch, jax.random.PRNGKey(0)
        )
        remat.check_saved_names(plan.remat, tagged)
    step = make_train_step(loss_fn, tx, plan)
    return Setup(step, tx, loss_fn, model, plan, work, recipe, config)


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
    seq_len: int = 40,
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
