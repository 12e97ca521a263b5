"""An NNX module as :func:`lowmem_jax.make_train_step` takes it: parameters, model state and a
pure loss function, and back into a module after training.

``nnx.split`` separates the module into a static graph definition and its variables:

* ``params``: the ``nnx.Param`` values, a nested dict of arrays (``nnx.to_pure_dict``; list
  indices are int keys), the tree the optimizer, the precision cast and sparse training see;
* ``model_state``: every other variable except the random-number state (``nnx.BatchStat``
  running statistics, caches, counters of your own), a nested dict of arrays that the loss
  returns updated;
* the random-number state (``nnx.RngState``: each stream's key and count) is not carried in the
  train state: the loss rebuilds it from the step's ``rng`` (the ``i``-th key in tree order is
  ``fold_in(rng, i)``, every count 0), so dropout draws fresh masks each step and microbatch
  as it does for a Linen model
  (:func:`lowmem_jax.techniques.microbatches.accumulate.accumulate_gradients` folds the microbatch
  index into ``rng``), and a resumed run draws the same ones. Streams split per layer (a key per
  layer, ``nnx.split_rngs``) get a fresh key per layer. With ``rng=None`` the module's own keys are
  used.

The loss is merged from these inside the traced step, so nothing of the module is mutated
outside it; the module's mode is the one it was split in (``model.train()`` /
``model.eval()`` before :func:`split_nnx`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax.core.base import LossFn, PyTree

__all__ = ["SplitNNX", "split_nnx"]

#: ``loss(module, batch) -> loss`` or ``(loss, metrics)``, ``metrics`` a dict of scalars.
ModuleLoss = Callable[[nnx.Module, PyTree], Any]

_MODEL_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


@dataclasses.dataclass(frozen=True)
class SplitNNX:
    """An NNX module split for :func:`lowmem_jax.make_train_step` (see :func:`split_nnx`).

    Attributes:
      graphdef: the module's static structure (``nnx.split``).
      params: the ``nnx.Param`` values, a nested dict of arrays.
      model_state: the other variables except the random-number state, a nested dict.
      rng_state: the module's random-number state as split (keys and counts), the template
        the loss rebuilds from each step's ``rng``.
      loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``.
    """

    graphdef: Any
    params: PyTree
    model_state: dict[str, Any]
    rng_state: PyTree
    loss_fn: LossFn

    def merge(self, params: PyTree, model_state: PyTree | None = None) -> nnx.Module:
        """A new module with ``params`` and ``model_state`` (default: as split), e.g.
        ``split.merge(lm.model_params(state, tx), state.model_state)`` after training."""
        state = self.model_state if model_state is None else model_state
        return nnx.merge(self.graphdef, params, self.rng_state, state)


def split_nnx(module: nnx.Module, loss: ModuleLoss) -> SplitNNX:
    """Splits ``module`` into parameters, model state and a pure loss function.

    ``loss(module, batch)`` returns the scalar loss, or ``(loss, metrics)`` with ``metrics`` a
    dict of scalars (``"loss"`` is added when missing). It is called on a module merged from the
    step's (possibly cast, possibly materialized-from-sparse) parameters and model state; the
    variables it changes (BatchNorm statistics, ...) come back as the new model state.

    Apply :meth:`lowmem_jax.Plan.configure_model` (remat, compute dtype) to ``module`` before
    splitting. ``params`` and ``model_state`` hold the module's own arrays (no copy): a step
    that donates its state (the default) deletes them, so use :meth:`SplitNNX.merge` after
    training, not ``module``.

    Raises:
      TypeError: ``module`` is not an ``nnx.Module``.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"split_nnx takes an nnx.Module, got {type(module).__name__} (a Linen module's "
            f"init gives its params and model state directly)"
        )
    graphdef, params, rng_state, model_state = nnx.split(module, nnx.Param, nnx.RngState, ...)
    rng_state = nnx.to_pure_dict(rng_state)

    def loss_fn(params, model_state, batch, rng):
        merged = nnx.merge(graphdef, params, _fresh_rng_state(rng_state, rng), model_state)
        out = loss(merged, batch)
        value, metrics = out if isinstance(out, tuple) else (out, {})
        metrics = {"loss": value, **metrics}
        return value, (nnx.to_pure_dict(nnx.state(merged, _MODEL_STATE)), metrics)

    return SplitNNX(
        graphdef=graphdef,
        params=nnx.to_pure_dict(params),
        model_state=nnx.to_pure_dict(model_state),
        rng_state=rng_state,
        loss_fn=loss_fn,
    )


def _fresh_rng_state(template: PyTree, rng: jax.Array | None) -> PyTree:
    """``template`` with its ``i``-th key leaf (tree order) ``fold_in(rng, i)`` and counts 0.

    A key leaf with a shape (streams split per layer, ``nnx.split_rngs`` + ``nnx.vmap``: one
    key per layer, scanned over with ``nnx.scan``) gets as many distinct keys, split from that
    one, in the same shape; counts keep their shapes too."""
    if rng is None:
        return template
    leaves, treedef = jax.tree.flatten(template)
    raw = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng

    def fresh(index: int, leaf):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(raw, impl=jax.random.key_impl(leaf))
            key = jax.random.fold_in(key, index)
            if leaf.shape:
                key = jax.random.split(key, math.prod(leaf.shape)).reshape(leaf.shape)
            return key
        return jnp.zeros_like(leaf)

    return jax.tree.unflatten(treedef, [fresh(i, x) for i, x in enumerate(leaves)])
