"""A workload: a model with its task, batch shapes and recipe (:class:`Workload`), what
:func:`lowmem_jax.build` turns into a train step under a plan."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.core.base import LossFn, PyTree
from lowmem_jax.techniques import sparsity
from lowmem_jax.workloads import losses
from lowmem_jax.workloads.recipes import Recipe

__all__ = ["Workload", "variable_shapes"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named model with its task, batch shapes and recipe.

    Attributes:
      name: the registry name.
      task: ``classification``, ``translation``, ``lm`` (causal language modelling) or ``mlm``
        (masked language modelling).
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

    def variable_shapes(self, model: Any) -> PyTree:
        """The shapes and dtypes of ``model``'s variables on this workload's batch
        (:func:`variable_shapes`)."""
        return variable_shapes(model, self)

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
        if self.task == "lm":
            return losses.lm_loss_fn(model)
        if self.task == "mlm":
            return losses.mlm_loss_fn(model)
        return losses.classifier_loss_fn(model, label_smoothing=label_smoothing)


def variable_shapes(model: Any, work: Workload) -> PyTree:
    """The shapes and dtypes of ``model``'s variables (``jax.eval_shape`` of ``model.init`` on
    ``work``'s batch); kept per (model, input shapes) when the model is hashable, since a
    search builds the same model many times (treat the result as read-only)."""
    if work.init is not None:  # a user's model: its own init on the whole batch
        leaves, treedef = jax.tree.flatten(work.batch)
        inputs = (work.init, treedef, *((x.shape, jnp.dtype(x.dtype)) for x in leaves))
    else:
        inputs = (None, None, *(work.batch[k] for k in work.init_inputs))
    try:
        return _cached_variable_shapes(model, inputs)
    except TypeError:  # an unhashable field (a user model's list): trace it each time
        return _trace_variable_shapes(model, inputs)


def _trace_variable_shapes(model: Any, inputs: tuple) -> PyTree:
    """``inputs``: ``(init, treedef, *(shape, dtype))`` of a user's init and batch, or
    ``(None, None, *arrays)``, the arrays ``model.init`` takes."""
    init, treedef, *rest = inputs
    if init is None:
        return jax.eval_shape(lambda *x: model.init(jax.random.PRNGKey(0), *x, train=False), *rest)
    batch = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*leaf) for leaf in rest])
    return jax.eval_shape(lambda b: init(model, jax.random.PRNGKey(0), b), batch)


_cached_variable_shapes = functools.lru_cache(maxsize=64)(_trace_variable_shapes)
