"""Your model as a workload: what :func:`lowmem_jax.plan_for_budget`, :func:`lowmem_jax.build`
and the analysis take, for a Linen or NNX model nobody registered here.

>>> work = lm.custom_workload("my-cnn", Net(), {"image": images, "label": labels},
...                          loss=my_loss, init=my_init, optimizer=optax.adam(1e-3))
>>> lm.plan_for_budget(work, 64 * 2**20, envelope="any").plan

A plan configures the model (``plan.configure_model``: remat on the blocks it finds, the compute
dtype, factorized layers) before ``init`` and ``loss`` see it, so the search covers every
technique the model can take; a setting it cannot take (e.g. factorizing a model without
``Dense`` / ``Conv`` layers) is left out of the search, named in its log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from lowmem_jax.compose.nnx_split import split_nnx
from lowmem_jax.core.base import LossFn, PyTree
from lowmem_jax.techniques import sparsity
from lowmem_jax.workloads.definition import Workload

__all__ = ["custom_workload"]


def custom_workload(
    name: str,
    model: Any,
    batch: PyTree,
    *,
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    init: Callable[[Any, jax.Array, PyTree], PyTree] | None = None,
    is_sparse: Callable[[tuple[str, ...], tuple[int, ...]], bool] = sparsity.default_is_sparse,
) -> Workload:
    """A :class:`~lowmem_jax.workloads.Workload` of a user's model.

    Args:
      name: what the search's log and results call it.
      model: a Linen module or an ``nnx.Module`` (unconfigured; each plan configures a copy).
      batch: one batch: a dict of arrays or ``jax.ShapeDtypeStruct`` (the leading axis is the
        batch size the microbatch counts divide).
      loss: Linen: ``loss(model) -> loss_fn(params, model_state, batch, rng) -> (loss,
        (model_state, metrics))`` for the configured ``model``; NNX: ``loss(module, batch) ->
        loss`` (:func:`lowmem_jax.split_nnx`'s).
      optimizer: the optax transformation (``plan.wrap_optimizer`` wraps it per plan).
      init: Linen: ``init(model, rng, batch) -> variables`` (``{"params": ..., "batch_stats":
        ...}``), required; NNX: not taken (the module holds its variables).
      is_sparse: which parameter leaves sparse training sparsifies.

    Raises:
      ValueError: a Linen model without ``init``, an NNX model with one, or a batch that is not
        a non-empty dict.
    """
    if not isinstance(batch, dict) or not batch:
        raise ValueError(f"batch must be a non-empty dict of arrays, got {type(batch).__name__}")
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    if isinstance(model, nnx.Module):
        if init is not None:
            raise ValueError("init is for Linen models; an NNX module holds its own variables")
        init, linen_loss = _nnx_hooks(loss)
    else:
        if init is None:
            raise ValueError(
                f"init is required for the Linen model {type(model).__name__}: "
                "init(model, rng, batch) -> variables, e.g. model.init(rng, batch['image'])"
            )
        linen_loss = loss
    return Workload(
        name=name,
        task="custom",
        model=model,
        batch=shapes,
        init_inputs=(),
        recipe=None,
        is_sparse=is_sparse,
        init=init,
        loss=linen_loss,
        optimizer=optimizer,
    )


def _nnx_hooks(module_loss: Callable[..., Any]):
    """``init`` and ``loss`` of an NNX model through :func:`split_nnx`: the variables
    ``{"params": ..., "model_state": ...}`` (the step's model state is then ``{"model_state":
    ...}``)."""

    def init(model, rng, batch):
        split = split_nnx(model, module_loss)
        return {"params": split.params, "model_state": split.model_state}

    def loss(model) -> LossFn:
        split = split_nnx(model, module_loss)

        def loss_fn(params, model_state, batch, rng):
            value, (new_state, metrics) = split.loss_fn(
                params, model_state["model_state"], batch, rng
            )
            return value, ({"model_state": new_state}, metrics)

        return loss_fn

    return init, loss
