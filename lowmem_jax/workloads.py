"""Named workloads: a model, its input shapes, loss and optimizer recipe, under a :class:`Plan`.

One place that turns ``("wrn-28-2", batch 128, plan)`` or ``("dynamicconv-iwslt", 100 x 40
tokens, plan)`` into the pieces the training loop, the memory analysis, the report and the
benchmarks all need, so that every figure they print refers to the same step.

Models:

* ``wrn-D-K``: WideResNet-D-K on 32x32x3 images, 10 classes; SGD Nesterov recipe; batch =
  ``{"image": [B, 32, 32, 3] float32, "label": [B] int32}``; default batch 128.
* ``dynamicconv-iwslt``: fairseq's ``lightconv_iwslt_de_en`` (vocabularies 8,848 / 6,632); Adam
  (0.9, 0.98) with weight decay 1e-4; batch = ``{"src", "tgt_in", "tgt_out": [B, T] int32}``;
  default 100 sentences x 40 tokens = 4,000 tokens per side, the recipe's token budget.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lowmem_jax import memory, models, precision, sparsity
from lowmem_jax.train import Plan, TrainState, classifier_loss_fn, make_train_step

__all__ = [
    "Workload",
    "make_workload",
    "make_model",
    "sgd_nesterov",
    "analyze_model",
    "build_train_step",
    "StepSetup",
    "MODEL_PATTERN",
]

MODEL_PATTERN = "wrn-D-K (e.g. wrn-28-2) or dynamicconv-iwslt"


def make_model(name: str, num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """``wrn-D-K`` -> ``WideResNet(depth=D, width=K)``; ``dynamicconv-iwslt`` -> the IWSLT preset.

    Raises:
      ValueError: naming ``model`` and the accepted names.
    """
    if name == "dynamicconv-iwslt":
        return models.DynamicConvTransformer.iwslt_de_en(**kwargs)
    match = re.fullmatch(r"wrn-(\d+)-(\d+)", name or "")
    if not match:
        raise ValueError(f"Unknown model={name!r}; allowed values: {MODEL_PATTERN}")
    depth, width = map(int, match.groups())
    return models.WideResNet(depth=depth, width=width, num_classes=num_classes, **kwargs)


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
class Workload:
    """A model with its batch shapes, loss and optimizer.

    Attributes:
      name: the model name it was made from.
      model: the (unconfigured) Flax module; ``Plan.configure_model`` sets remat and dtype.
      batch: ``jax.ShapeDtypeStruct`` leaves of one batch.
      init_inputs: the batch leaves ``model.init`` takes, in order, after the rng.
      loss_fn: ``model -> loss_fn(params, model_state, batch, rng)``.
      tx: the recipe's optimizer.
      is_sparse: which parameter leaves sparse training sparsifies by default
        (``SparseConfig.is_sparse`` when left at :func:`~lowmem_jax.sparsity.default_is_sparse`).
    """

    name: str
    model: nn.Module
    batch: dict[str, jax.ShapeDtypeStruct]
    init_inputs: tuple[str, ...]
    loss_fn: Callable[[nn.Module], Callable]
    tx: optax.GradientTransformation
    is_sparse: Callable = sparsity.default_is_sparse


def make_workload(
    model: str, batch_size: int | None = None, *, seq_len: int = 40, image_size: int = 32
) -> Workload:
    """The named workload at ``batch_size`` (None: the model's default, see the module doc).

    Raises:
      ValueError: for an unknown model or a batch size / sequence length below 1.
    """
    flax_model = make_model(model)
    if model == "dynamicconv-iwslt":
        batch_size = 100 if batch_size is None else batch_size
        tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        batch = {"src": tokens, "tgt_in": tokens, "tgt_out": tokens}
        init_inputs = ("src", "tgt_in")
        loss_fn = models.translation_loss_fn
        tx = optax.adamw(5e-4, b1=0.9, b2=0.98, weight_decay=1e-4)
    else:
        batch_size = 128 if batch_size is None else batch_size
        batch = {
            "image": jax.ShapeDtypeStruct((batch_size, image_size, image_size, 3), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }
        init_inputs = ("image",)
        loss_fn = classifier_loss_fn
        tx = sgd_nesterov()
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    is_sparse = (
        models.translation_is_sparse if model == "dynamicconv-iwslt" else sparsity.default_is_sparse
    )
    return Workload(model, flax_model, batch, init_inputs, loss_fn, tx, is_sparse)


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """One named workload's train step under a plan, ready to analyse or to run.

    Attributes:
      step: the jitted train step ``(state, batch) -> (state, metrics)``.
      init_state: ``(*inputs) -> TrainState`` from the ``init_inputs`` batch leaves (pass
        ``ShapeDtypeStruct`` through ``jax.eval_shape`` for shapes only).
      workload: the :class:`Workload` (batch shapes, model, loss, optimizer).
      loss_fn: the configured model's loss cast to the plan's policy (what the step
        differentiates).
      model_params: with compressed sparse storage, the dense parameters' shapes (the analytic
        count needs them); else ``None``.
      config: a JSON-able description (model, batch size, plan, sparsity).
      grads_in_stored_layout: the step differentiates w.r.t. the stored (compressed) parameters.
    """

    step: Callable
    init_state: Callable[..., TrainState]
    workload: Workload
    loss_fn: Callable
    model_params: Any
    config: dict[str, Any]
    grads_in_stored_layout: bool = False

    def abstract_state(self) -> TrainState:
        inputs = [self.workload.batch[k] for k in self.workload.init_inputs]
        return jax.eval_shape(self.init_state, *inputs)

    def example_batch(self, seed: int = 0) -> dict[str, jax.Array]:
        """A random batch of the workload's shapes: images ~ N(0, 1), labels in [0, 10),
        tokens in [4, 1000) (no padding, no special ids)."""
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.workload.batch))
        out = {}
        for key, (name, leaf) in zip(keys, sorted(self.workload.batch.items()), strict=True):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                out[name] = jax.random.normal(key, leaf.shape, leaf.dtype)
            elif name == "label":
                out[name] = jax.random.randint(key, leaf.shape, 0, 10, leaf.dtype)
            else:
                out[name] = jax.random.randint(key, leaf.shape, 4, 1000, leaf.dtype)
        return out

    def concrete_state(self, batch: dict[str, jax.Array]) -> TrainState:
        """A real initial state (parameters initialised from ``batch``'s first rows)."""
        inputs = [batch[k][:2] for k in self.workload.init_inputs]
        return jax.jit(self.init_state)(*inputs)


def build_train_step(
    model: str,
    batch_size: int | None,
    plan: Plan,
    *,
    sparse: sparsity.SparseConfig | None = None,
    seq_len: int = 40,
    image_size: int = 32,
    tx: optax.GradientTransformation | None = None,
) -> StepSetup:
    """The train step of a named model under ``plan`` (and ``sparse``), with its initial state.

    ``sparse``: train sparsely (the recipe's optimizer wrapped by
    :func:`lowmem_jax.sparsity.sparse_training`); with ``compressed=True`` the state stores only
    the non-zeros and their indices, and the step materialises dense weights transiently.

    Raises:
      ValueError: for an unknown model, a bad plan, or a batch size the microbatches don't divide.
    """
    work = make_workload(model, batch_size, seq_len=seq_len, image_size=image_size)
    size = next(iter(work.batch.values())).shape[0]
    if size % plan.microbatches:
        raise ValueError(f"batch_size={size} is not divisible by microbatches={plan.microbatches}")
    flax_model = plan.configure_model(work.model)
    tx = tx or work.tx
    loss_fn = work.loss_fn(flax_model)
    config = {"model": model, "batch_size": size, **plan.to_dict()}

    def init_variables(*x):
        return flax_model.init(jax.random.PRNGKey(0), *x, train=False)

    def split(variables):
        return variables["params"], {k: v for k, v in variables.items() if k != "params"}

    if sparse is None:

        def init_state(*x):
            params, model_state = split(init_variables(*x))
            return TrainState.create(params=params, tx=tx, plan=plan, model_state=model_state)

        step = make_train_step(loss_fn, tx, plan)
        model_params = None
        stored_grads = False
    else:
        if sparse.is_sparse is sparsity.default_is_sparse:
            sparse = dataclasses.replace(sparse, is_sparse=work.is_sparse)
        inputs = [work.batch[k] for k in work.init_inputs]
        abstract_params = jax.eval_shape(init_variables, *inputs)["params"]
        model_params = plan.policy.cast_to_param(abstract_params)
        sparse_tx = sparsity.sparse_training(tx, sparse, abstract_params)

        def init_state(*x):
            params, model_state = split(init_variables(*x))
            return sparse_tx.create_train_state(params=params, plan=plan, model_state=model_state)

        step = make_train_step(loss_fn, sparse_tx, plan, materialize=sparse_tx.materialize)
        stored_grads = sparse_tx.grads_in_stored_layout
        config["sparsity"] = {
            "algorithm": sparse.algorithm,
            "sparsity": 1.0 - sparse.density,
            "distribution": sparse.distribution,
            "storage": "compressed" if sparse.compressed else "masked",
        }
    return StepSetup(
        step=step,
        init_state=init_state,
        workload=work,
        loss_fn=precision.cast_loss_fn(loss_fn, plan.policy),
        model_params=model_params,
        config=config,
        grads_in_stored_layout=stored_grads,
    )


def analyze_model(
    model: str,
    batch_size: int | None,
    plan: Plan,
    *,
    sparse: sparsity.SparseConfig | None = None,
    seq_len: int = 40,
    image_size: int = 32,
    tx: optax.GradientTransformation | None = None,
) -> memory.MemoryReport:
    """Memory analysis of one train step of a named model: compile-only, no data, no step run.

    Arguments as :func:`build_train_step`.

    Raises:
      ValueError: for an unknown model, a bad plan, or a batch size the microbatches don't divide.
    """
    setup = build_train_step(
        model, batch_size, plan, sparse=sparse, seq_len=seq_len, image_size=image_size, tx=tx
    )
    return memory.analyze(
        setup.step,
        setup.abstract_state(),
        setup.workload.batch,
        loss_fn=setup.loss_fn,
        microbatches=plan.microbatches,
        model_params=setup.model_params,
        grads_in_stored_layout=setup.grads_in_stored_layout,
        config=setup.config,
    )
