"""Composing the techniques into one jitted train step.

The step is a chain of function transforms over the user's loss; at each stage every
registered technique's hook (:data:`lowmem_jax.techniques.TECHNIQUES`, in order) wraps what the
stage has:

    loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))
      -> step.loss                  precision: params and batch cast to the compute dtype,
                                    loss back to fp32; activations: residuals compressed
      -> model.block                per-block hooks active while the loss is traced (pipeline)
      -> base.differentiated_loss   the model's parameters from the stored ones (the optimizer's
                                    storage: identity, or e.g. dense weights from sparse values)
      -> step.stored_loss           shard (zero3): the parameters gathered where the loss reads
      -> scaled_grad_fn             grad of (loss x S), divided by S (S from the loss-scale state)
      -> step.grad_fn               microbatches: lax.scan over k microbatches, BatchNorm state
                                    threaded in order; shard (zero2): the gradients partitioned
      = grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)
    optimizer (any optax transformation, or a plan's wrap_optimizer): grads -> updates
      -> step.apply                 the parameters updated (precision: rounded stochastically)
    if any gradient, update or new parameter is non-finite: keep the old params, optimizer
    state and model state (the whole update is skipped, the optimizer's own step counter
    included) and count the skip; the loss-scale state backs off on non-finite gradients;
    no host sync.
      -> step.step                  shard: the state laid out over the mesh in and out, the
                                    batch split over the devices, offloaded state moved

Remat, the compute dtype and factorized layers live in the model (:meth:`Plan.configure_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.base import (
    LossFn,
    Optimizer,
    PyTree,
    as_optimizer,
    differentiated_loss,
    in_host_memory,
)
from lowmem_jax.core.finite import all_finite, select_tree
from lowmem_jax.core.host import on_host
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.techniques import loss_scale as loss_scale_lib

__all__ = ["TrainState", "scaled_grad_fn", "make_train_step", "make_plain_train_step"]


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes, as one pytree.

    Attributes:
      step: int32 scalar, steps attempted (applied + skipped).
      params: parameters as the optimizer stores them (:class:`lowmem_jax.core.base.Optimizer`), in
        the plan's ``param_dtype`` (the master weights).
      opt_state: the optimizer's state.
      model_state: non-parameter collections, e.g. ``{"batch_stats": ...}`` (float32).
      loss_scale: a :mod:`lowmem_jax.techniques.loss_scale.scale` state.
      skipped_steps: int32 scalar, steps skipped for non-finite gradients or updates.
      skip_streak: int32 scalar, the steps skipped in a row up to the last one (0 after an
        applied step): a hand-written loop stops a run that makes no progress on it
        (:class:`lowmem_jax.SkipGuard` names the likely cause).
      rng: a raw uint32 PRNG key (``jax.random.PRNGKey``; typed keys are converted, so the state
        converts to NumPy and checkpoints plainly); step ``t`` uses ``fold_in(rng, t)``.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    loss_scale: Any
    skipped_steps: jax.Array
    skip_streak: jax.Array
    rng: jax.Array

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation | Optimizer,
        plan: Plan,
        model_state: Mapping[str, Any] | None = None,
        rng: jax.Array | None = None,
        grads: PyTree | None = None,
    ) -> TrainState:
        """Casts the model's ``params`` to the plan's ``param_dtype``, stores them as ``tx``
        does (:meth:`~lowmem_jax.core.base.Optimizer.store`: as they are for a plain optax
        transformation), initialises its state and lays the state out as the plan's techniques
        do (:meth:`lowmem_jax.Plan.state_shardings`: over a mesh, streamed weights in host
        memory), as :meth:`lowmem_jax.workloads.setup.Setup.init_state` does. Inside ``jax.jit`` the
        layout is the program's: give it ``plan.state_shardings`` as ``out_shardings``.

        ``grads``: the loss's gradient at ``params``, for an optimizer that needs it
        (``tx.needs_init_grads``: SNIP masks); :meth:`lowmem_jax.workloads.setup.Setup.init_state`
        computes it on a batch.

        Raises:
          ValueError: a raw optax ``tx`` with a plan that has optimizer-side work
            (:meth:`Plan.check_optimizer`): pass ``plan.wrap_optimizer(tx, params)``.
        """
        params = plan.policy.cast_to_param(params)
        plan.check_optimizer(tx, params)
        stored, opt_state = as_optimizer(tx).store(params, grads)
        state = cls(
            step=jnp.zeros((), jnp.int32),
            params=stored,
            opt_state=opt_state,
            model_state=dict(model_state or {}),
            loss_scale=plan.make_loss_scale(),
            skipped_steps=jnp.zeros((), jnp.int32),
            skip_streak=jnp.zeros((), jnp.int32),
            rng=_raw_key(jax.random.PRNGKey(0) if rng is None else rng),
        )
        shardings = plan.state_shardings(state)  # e.g. streamed weights in host memory
        return state if shardings is None else jax.device_put(state, shardings)


def _raw_key(rng: jax.Array) -> jax.Array:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


def model_params(state: TrainState, tx: optax.GradientTransformation | Optimizer) -> PyTree:
    """The parameters the model sees: ``state.params`` materialized by ``tx``'s storage."""
    return as_optimizer(tx).materialize(state.params, state.opt_state)


def scaled_grad_fn(loss_fn: LossFn, loss_scale: loss_scale_lib.LossScale):
    """``grad_fn(params, model_state, batch, rng, weight=None) -> (grads, model_state, metrics)``.

    ``grads = grad(S * loss) / S`` with ``S`` from ``loss_scale``, or ``grad(S * weight * loss)
    / S`` with a float32 scalar ``weight`` (microbatch accumulation's count weights, given at the
    seed of the backward pass; ``metrics`` are the loss's own, unweighted); non-finite values
    propagate (the caller decides what to do with them). A gradient in host memory (a streamed
    parameter's, ``Plan.weight_memory``) is divided there, by the host.
    """

    def grad_fn(params, model_state, batch, rng, weight=None):
        def scaled(p):
            loss, aux = loss_fn(p, model_state, batch, rng)
            return loss_scale.scale(loss if weight is None else loss * weight), aux

        grads, (new_model_state, metrics) = jax.grad(scaled, has_aux=True)(params)
        return _unscaled(loss_scale, grads), new_model_state, metrics

    return grad_fn


def _unscaled(loss_scale: loss_scale_lib.LossScale, grads: PyTree) -> PyTree:
    leaves, treedef = jax.tree.flatten(grads)
    host = [in_host_memory(g) for g in leaves]
    if not any(host) or isinstance(loss_scale, loss_scale_lib.NoOpLossScale):
        return loss_scale.unscale(grads)
    on_device = loss_scale.unscale([g for g, h in zip(leaves, host, strict=True) if not h])
    on_the_host = on_host(jax.jit(lambda scale, g: scale.unscale(g)))(
        jax.device_put(loss_scale, jax.memory.Space.Host),
        [g for g, h in zip(leaves, host, strict=True) if h],
    )
    on_device, on_the_host = iter(on_device), iter(on_the_host)
    merged = [next(on_the_host) if h else next(on_device) for h in host]
    return jax.tree.unflatten(treedef, merged)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation | Optimizer,
    plan: Plan,
    *,
    jit: bool = True,
    donate: bool = True,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds ``train_step(state, batch) -> (state, metrics)``, jitted once, state donated.

    ``tx``: any optax transformation, or the plan's ``plan.wrap_optimizer(tx, params)`` (which
    may store the parameters in another form, e.g. compressed sparse: the model then sees
    ``tx.materialize(state.params, state.opt_state)``, built inside the step, so transiently).

    The registered techniques' step hooks compose it (module docstring; e.g. with
    ``plan.shard`` the step is one SPMD program over ``plan.mesh()``, see
    :mod:`lowmem_jax.techniques.shard`).

    ``metrics`` holds the loss function's metrics (averaged over microbatches, float32) plus
    ``loss_scale`` (the scale used in this step), ``grads_finite`` and ``update_finite``
    (bools: were the gradients, and the updates and new parameters, finite; the step is
    applied iff both), ``skipped_steps`` (running count) and ``skip_streak`` (skipped in a row,
    0 after an applied step).
    """
    opt = as_optimizer(tx)
    model_loss = plan.model_loss(loss_fn)

    def train_step(state: TrainState, batch: PyTree):
        plan.check_optimizer(tx, state.params)  # traced once: the same refusal as create's
        rng = jax.random.fold_in(state.rng, state.step)
        loss, wrt = differentiated_loss(model_loss, opt, state.params, state.opt_state)
        loss = _fold(loss, "stored_loss", plan)
        grad_fn = _fold(scaled_grad_fn(loss, state.loss_scale), "grad_fn", plan)
        grads, model_state, metrics = grad_fn(wrt, state.model_state, batch, rng)
        apply_updates = _fold(_apply_updates, "apply", plan)

        if opt.applies_updates:  # updated where the state lives, the skip rule applied there
            params, opt_state, grads_finite, update_finite = opt.apply(
                grads, state.opt_state, state.params
            )
        else:
            grads_finite = all_finite(grads)
            updates, opt_state = opt.update(grads, state.opt_state, state.params)
            params = apply_updates(state.params, updates, rng)
            # Finite gradients can still give a non-finite update (e.g. 0/0 in a low-precision
            # optimizer): what is applied is checked too, so nothing non-finite reaches the state.
            update_finite = all_finite((updates, params))
        applied = grads_finite & update_finite
        if opt.applies_updates:  # the parameters and state chosen already
            model_state = select_tree(applied, model_state, state.model_state)
        elif opt.selects_state:  # the update chose its state by the same rule, where it lives
            params, model_state = select_tree(
                applied, (params, model_state), (state.params, state.model_state)
            )
        else:
            params, opt_state, model_state = select_tree(
                applied,
                (params, opt_state, model_state),
                (state.params, state.opt_state, state.model_state),
            )
        skipped = state.skipped_steps + (~applied).astype(jnp.int32)
        streak = jnp.where(applied, 0, state.skip_streak + 1)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=state.loss_scale.adjust(grads_finite),  # the scale answers to overflow
            skipped_steps=skipped,
            skip_streak=streak,
        )
        metrics = {
            **metrics,
            "loss_scale": state.loss_scale.loss_scale,
            "grads_finite": grads_finite,
            "update_finite": update_finite,
            "skipped_steps": skipped,
            "skip_streak": streak,
        }
        return new_state, metrics

    step = _fold(train_step, "step", plan)
    if not jit:
        return step
    return jax.jit(
        step,
        donate_argnums=(0,) if donate else (),
        compiler_options=plan.compiler_options() or None,
    )


def _apply_updates(params: PyTree, updates: PyTree, rng: jax.Array) -> PyTree:
    """``optax.apply_updates`` (the ``apply`` hooks' start)."""
    del rng
    return optax.apply_updates(params, updates)


def _fold(fn: Callable, hook: str, plan: Plan) -> Callable:
    """``fn`` wrapped by each registered technique's ``step.<hook>``, in the registry's order."""
    for technique in TECHNIQUES:
        wrap = getattr(technique.step, hook)
        if wrap is not None:
            fn = wrap(fn, plan)
    return fn


def make_plain_train_step(
    loss_fn: LossFn, tx: optax.GradientTransformation
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """The baseline every reduction is quoted against: the step a Flax/Optax user writes.

    ``jax.grad`` of ``loss_fn`` w.r.t. ``state.params`` (as stored: no cast, no loss scale,
    one batch), ``tx.update``, ``optax.apply_updates``; jitted, state donated. ``rng`` and
    ``step`` as :func:`make_train_step` uses them; ``loss_scale``, ``skipped_steps`` and
    ``skip_streak`` are carried untouched. Pair it with a model as its author would run it (the
    bundled models: ``unroll=True``, ``conv_impl="xla"``; see
    :func:`lowmem_jax.workloads.build_plain`).
    """

    def plain_step(state: TrainState, batch: PyTree):
        rng = jax.random.fold_in(state.rng, state.step)
        grads, (model_state, metrics) = jax.grad(loss_fn, has_aux=True)(
            state.params, state.model_state, batch, rng
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
        )
        return new_state, metrics

    return jax.jit(plain_step, donate_argnums=(0,))
