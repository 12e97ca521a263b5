"""Composing the techniques into one jitted train step.

The step is a chain of function transforms over the user's loss (module :mod:`lowmem_jax`):

    loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))
      -> precision.cast_loss_fn     params and batch cast to the compute dtype, loss back to fp32
      -> base.differentiated_loss   the model's parameters from the stored ones (the optimizer's
                                    storage: identity, or e.g. dense weights from sparse values)
      -> scaled_grad_fn             grad of (loss x S), divided by S (S from the loss-scale state)
      -> accumulate_gradients       lax.scan over k microbatches, BatchNorm state threaded in order
      = grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)
    optimizer (any optax transformation, or a plan's wrap_optimizer): grads -> updates -> params
    if any gradient, update or new parameter is non-finite: keep the old params, optimizer
    state and model state (the whole update is skipped, the optimizer's own step counter
    included) and count the skip; the loss-scale state backs off on non-finite gradients;
    no host sync.

Remat lives in the model (per block, see :mod:`lowmem_jax.remat`); :meth:`Plan.configure_model`
sets it, and the compute dtype, on models that have ``remat`` / ``dtype`` attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import PartitionSpec

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax import microbatch as microbatch_lib
from lowmem_jax import precision as precision_lib
from lowmem_jax import scanned_blocks
from lowmem_jax import sharding as sharding_lib
from lowmem_jax.base import LossFn, Optimizer, PyTree, as_optimizer, differentiated_loss
from lowmem_jax.plan import Plan

__all__ = [
    "TrainState",
    "scaled_grad_fn",
    "make_train_step",
    "make_plain_train_step",
    "state_specs",
    "state_shardings",
]


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes, as one pytree.

    Attributes:
      step: int32 scalar, steps attempted (applied + skipped).
      params: parameters as the optimizer stores them (:class:`lowmem_jax.base.Optimizer`), in
        the plan's ``param_dtype`` (the master weights).
      opt_state: the optimizer's state.
      model_state: non-parameter collections, e.g. ``{"batch_stats": ...}`` (float32).
      loss_scale: a :mod:`lowmem_jax.loss_scale` state.
      skipped_steps: int32 scalar, steps skipped for non-finite gradients.
      rng: a raw uint32 PRNG key (``jax.random.PRNGKey``; typed keys are converted, so the state
        converts to NumPy and checkpoints plainly); step ``t`` uses ``fold_in(rng, t)``.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    loss_scale: Any
    skipped_steps: jax.Array
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
        does (:meth:`~lowmem_jax.base.Optimizer.store`: as they are for a plain optax
        transformation) and initialises its state.

        ``grads``: the loss's gradient at ``params``, for an optimizer that needs it
        (``tx.needs_init_grads``: SNIP masks); :meth:`lowmem_jax.workloads.Setup.init_state`
        computes it on a batch.
        """
        params = plan.policy.cast_to_param(params)
        stored, opt_state = as_optimizer(tx).store(params, grads)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=stored,
            opt_state=opt_state,
            model_state=dict(model_state or {}),
            loss_scale=plan.make_loss_scale(),
            skipped_steps=jnp.zeros((), jnp.int32),
            rng=_raw_key(jax.random.PRNGKey(0) if rng is None else rng),
        )


def _raw_key(rng: jax.Array) -> jax.Array:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


def model_params(state: TrainState, tx: optax.GradientTransformation | Optimizer) -> PyTree:
    """The parameters the model sees: ``state.params`` materialized by ``tx``'s storage."""
    return as_optimizer(tx).materialize(state.params, state.opt_state)


def scaled_grad_fn(loss_fn: LossFn, loss_scale: loss_scale_lib.LossScale):
    """``grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)``.

    ``grads = grad(S * loss) / S`` with ``S`` from ``loss_scale``; non-finite values propagate
    (the caller decides what to do with them).
    """

    def grad_fn(params, model_state, batch, rng):
        def scaled(p):
            loss, aux = loss_fn(p, model_state, batch, rng)
            return loss_scale.scale(loss), aux

        grads, (new_model_state, metrics) = jax.grad(scaled, has_aux=True)(params)
        return loss_scale.unscale(grads), new_model_state, metrics

    return grad_fn


def state_specs(state: TrainState, plan: Plan, num_shards: int) -> TrainState:
    """A :class:`~jax.sharding.PartitionSpec` per leaf of ``state`` (arrays or shapes) under
    ``plan.shard``: the optimizer state partitioned from ``zero1`` on, the parameters at
    ``zero3`` (:func:`lowmem_jax.sharding.leaf_spec`), everything else replicated."""
    stage = sharding_lib.stage(plan.shard)
    specs = sharding_lib.tree_specs(state, num_shards, partition=False)
    return specs.replace(
        params=sharding_lib.tree_specs(state.params, num_shards, stage.parameters),
        opt_state=sharding_lib.tree_specs(state.opt_state, num_shards, stage.optimizer_state),
    )


def state_shardings(state: TrainState, plan: Plan) -> TrainState | None:
    """:func:`state_specs` as ``NamedSharding`` on ``plan.mesh()``, the optimizer state's in
    ``plan.optimizer_memory``; ``None`` without a mesh."""
    mesh = plan.mesh()
    if mesh is None:
        return None
    specs = state_specs(state, plan, mesh.size)
    return sharding_lib.named(mesh, specs).replace(
        opt_state=sharding_lib.named(mesh, specs.opt_state, plan.optimizer_memory)
    )


def _in_stack(path) -> bool:
    return scanned_blocks.in_stack([getattr(key, "key", None) for key in path])


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

    With ``plan.shard`` set, the step is one SPMD program over ``plan.mesh()``: the batch is
    split over the devices, the state laid out by :func:`state_specs` on the way in and out,
    and from ``zero2`` on the gradients are partitioned as the optimizer state is (XLA then
    reduce-scatters them). Microbatches are taken from each device's examples
    (:func:`lowmem_jax.microbatch.split_batch` with ``shards``).

    With ``plan.optimizer_memory="pinned_host"`` the optimizer state arrives in host memory,
    is moved to the device for the update, and the new state is moved back (its layout as
    above): the device holds it only during the update (ZeRO-Offload keeps it on the host and
    updates there; XLA cannot run the update on the host, so it is streamed instead).

    ``metrics`` holds the loss function's metrics (averaged over microbatches, float32) plus
    ``loss_scale`` (the scale used in this step), ``grads_finite`` and ``update_finite``
    (bools: were the gradients, and the updates and new parameters, finite; the step is
    applied iff both) and ``skipped_steps`` (running count).
    """
    opt = as_optimizer(tx)
    policy_loss_fn = precision_lib.cast_loss_fn(loss_fn, plan.policy)
    mesh = plan.mesh()
    shards = 1 if mesh is None else mesh.size
    stage = sharding_lib.stage(plan.shard)
    offload = plan.optimizer_memory != "device"

    def layout(tree, specs):
        return tree if mesh is None else sharding_lib.constrain(tree, mesh, specs)

    def gathered(loss):
        # zero3: the partitioned parameters are gathered whole where the loss reads them (the
        # transpose reduce-scatters their gradient); left to itself, XLA's partitioner lets
        # the parameters' layout split the convolutions' channels instead of the batch. The
        # stacks of scanned blocks stay partitioned here: a configured model gathers one
        # block's inside its loop (Plan.configure_model).
        def loss_of_gathered(p, *args):
            specs = jax.tree_util.tree_map_with_path(
                lambda path, spec: spec if _in_stack(path) else PartitionSpec(),
                sharding_lib.tree_specs(p, shards),
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
            return loss(layout(p, specs), *args)

        return loss_of_gathered

    def train_step(state: TrainState, batch: PyTree):
        specs = state_specs(state, plan, shards)
        if offload:  # the update runs on the device: the state comes in from host memory
            state = state.replace(
                opt_state=sharding_lib.to_memory(state.opt_state, mesh, specs.opt_state, "device")
            )
        state = layout(state, specs)
        batch = layout(batch, sharding_lib.batch_spec(batch))
        rng = jax.random.fold_in(state.rng, state.step)
        loss, wrt = differentiated_loss(policy_loss_fn, opt, state.params, state.opt_state)
        if stage.parameters:
            loss = gathered(loss)
        grad_fn = scaled_grad_fn(loss, state.loss_scale)
        grad_fn = microbatch_lib.accumulate_gradients(grad_fn, plan.microbatches, shards)
        grads, model_state, metrics = grad_fn(wrt, state.model_state, batch, rng)
        grads = layout(grads, sharding_lib.tree_specs(grads, shards, stage.gradients))

        grads_finite = loss_scale_lib.all_finite(grads)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Finite gradients can still give a non-finite update (e.g. 0/0 in a low-precision
        # optimizer): what is applied is checked too, so nothing non-finite reaches the state.
        update_finite = loss_scale_lib.all_finite((updates, params))
        applied = grads_finite & update_finite
        params, opt_state, model_state = loss_scale_lib.select_tree(
            applied,
            (params, opt_state, model_state),
            (state.params, state.opt_state, state.model_state),
        )
        skipped = state.skipped_steps + (~applied).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=state.loss_scale.adjust(grads_finite),  # the scale answers to overflow
            skipped_steps=skipped,
        )
        new_state = layout(new_state, specs)
        if offload:
            new_state = new_state.replace(
                opt_state=sharding_lib.to_memory(
                    new_state.opt_state, mesh, specs.opt_state, plan.optimizer_memory
                )
            )
        metrics = {
            **metrics,
            "loss_scale": state.loss_scale.loss_scale,
            "grads_finite": grads_finite,
            "update_finite": update_finite,
            "skipped_steps": skipped,
        }
        return new_state, metrics

    if not jit:
        return train_step
    return jax.jit(
        train_step,
        donate_argnums=(0,) if donate else (),
        compiler_options=plan.compiler_options() or None,
    )


def make_plain_train_step(
    loss_fn: LossFn, tx: optax.GradientTransformation
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """The baseline every reduction is quoted against: the step a Flax/Optax user writes.

    ``jax.grad`` of ``loss_fn`` w.r.t. ``state.params`` (as stored: no cast, no loss scale,
    one batch), ``tx.update``, ``optax.apply_updates``; jitted, state donated. ``rng`` and
    ``step`` as :func:`make_train_step` uses them; ``loss_scale`` and ``skipped_steps`` are
    carried untouched. Pair it with a model as its author would run it (the bundled models:
    ``unroll=True``, ``conv_impl="xla"``; see :func:`lowmem_jax.workloads.build_plain`).
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
