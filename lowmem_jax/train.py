"""Composing the techniques into one jitted train step.

The step is a chain of function transforms over the user's loss (module :mod:`lowmem_jax`):

    loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))
      -> precision.cast_loss_fn     params and batch cast to the compute dtype, loss back to fp32
      -> scaled_grad_fn             grad of (loss x S), divided by S (S from the loss-scale state)
      -> accumulate_gradients       lax.scan over k microbatches, BatchNorm state threaded in order
      = grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)
    optimizer (any optax transformation): grads -> updates -> new params
    if any gradient is non-finite: keep the old params, optimizer state and model state (the
    whole update is skipped, the optimizer's own step counter included), count the skip, and
    let the loss-scale state back off; no host sync.

Remat lives in the model (per block, see :mod:`lowmem_jax.remat`); :meth:`Plan.configure_model`
sets it, and the compute dtype, on models that have ``remat`` / ``dtype`` attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax import microbatch as microbatch_lib
from lowmem_jax import precision as precision_lib
from lowmem_jax import remat as remat_lib

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree, Any], tuple[jax.Array, tuple[PyTree, PyTree]]]

__all__ = [
    "Plan",
    "TrainState",
    "scaled_grad_fn",
    "make_train_step",
    "classifier_loss_fn",
]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which techniques the train step composes. Validated on construction.

    Attributes:
      precision: a :mod:`lowmem_jax.precision` policy name (``fp32``, ``bf16``, ``fp16``,
        ``mixed_bf16``, ``mixed_fp16``).
      loss_scale: ``"auto"`` (dynamic when computing in float16, else none), ``"none"``,
        ``"static"`` or ``"dynamic"``.
      microbatches: ``k >= 1`` slices per batch, accumulated with ``lax.scan``.
      remat: a :mod:`lowmem_jax.remat` policy name, applied per block by the model.
      initial_loss_scale, loss_scale_period, loss_scale_factor, min_loss_scale: loss-scale
        settings (2**15, 2000, 2, 1 by default).
    """

    precision: str = "fp32"
    loss_scale: str = "auto"
    microbatches: int = 1
    remat: str = "none"
    initial_loss_scale: float = 2.0**15
    loss_scale_period: int = 2000
    loss_scale_factor: float = 2.0
    min_loss_scale: float = 1.0

    def __post_init__(self):
        precision_lib.get_policy(self.precision)
        if self.loss_scale != "auto" and self.loss_scale not in loss_scale_lib.LOSS_SCALES:
            raise ValueError(
                f"Unknown loss_scale={self.loss_scale!r}; allowed values: "
                f"{['auto', *loss_scale_lib.LOSS_SCALES]}"
            )
        microbatch_lib.check_num_microbatches(self.microbatches)
        remat_lib.parse_policy(self.remat)
        self.make_loss_scale()  # validates the loss-scale settings

    @property
    def policy(self) -> precision_lib.Policy:
        return precision_lib.get_policy(self.precision)

    @property
    def loss_scale_kind(self) -> str:
        if self.loss_scale == "auto":
            return "dynamic" if self.policy.needs_loss_scale else "none"
        return self.loss_scale

    def make_loss_scale(self) -> loss_scale_lib.LossScale:
        return loss_scale_lib.make_loss_scale(
            self.loss_scale_kind,
            initial_scale=self.initial_loss_scale,
            period=self.loss_scale_period,
            factor=self.loss_scale_factor,
            min_loss_scale=self.min_loss_scale,
        )

    def configure_model(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` with this plan's ``remat`` policy and compute ``dtype``.

        Raises:
          ValueError: if the plan asks for remat and the model has no ``remat`` attribute.
        """
        updates: dict[str, Any] = {}
        if hasattr(model, "dtype"):
            updates["dtype"] = self.policy.compute_dtype
        if hasattr(model, "remat"):
            updates["remat"] = self.remat
        elif self.remat != "none":
            raise ValueError(
                f"remat={self.remat!r} needs a model with a `remat` attribute; "
                f"{type(model).__name__} has none"
            )
        return model.clone(**updates)

    def compiler_options(self) -> dict[str, str]:
        """XLA options the jitted step needs for this plan (see :func:`remat.compiler_options`)."""
        return remat_lib.compiler_options(self.remat)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "loss_scale": self.loss_scale_kind}


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes, as one pytree.

    Attributes:
      step: int32 scalar, steps attempted (applied + skipped).
      params: parameters in the plan's ``param_dtype`` (the master weights).
      opt_state: the optax state for ``params``.
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
        tx: optax.GradientTransformation,
        plan: Plan,
        model_state: Mapping[str, Any] | None = None,
        rng: jax.Array | None = None,
    ) -> TrainState:
        """Casts ``params`` to the plan's ``param_dtype`` and initialises ``tx`` on them."""
        params = plan.policy.cast_to_param(params)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=dict(model_state or {}),
            loss_scale=plan.make_loss_scale(),
            skipped_steps=jnp.zeros((), jnp.int32),
            rng=_raw_key(jax.random.PRNGKey(0) if rng is None else rng),
        )


def _raw_key(rng: jax.Array) -> jax.Array:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng


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


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    plan: Plan,
    *,
    jit: bool = True,
    donate: bool = True,
    materialize: Callable[[PyTree, PyTree], PyTree] | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds ``train_step(state, batch) -> (state, metrics)``, jitted once, state donated.

    ``metrics`` holds the loss function's metrics (averaged over microbatches, float32) plus
    ``loss_scale`` (the scale used in this step), ``grads_finite`` (bool: was the update
    applied) and ``skipped_steps`` (running count).

    ``materialize(params, opt_state) -> model_params``, when given, builds the parameters the
    model sees from the stored ones (e.g. dense weights from compressed sparse storage,
    :mod:`lowmem_jax.sparsity`); it runs inside the step, so what it builds is transient. The
    loss is differentiated w.r.t. ``model_params``, and ``tx.update(grads, opt_state, params)``
    receives those gradients (in the model's layout) with the stored ``params``; if ``tx`` has
    ``grads_in_stored_layout = True`` (compressed sparse training that needs no dense gradient),
    ``loss(materialize(params))`` is differentiated w.r.t. the stored ``params`` instead, so each
    microbatch's gradient and the microbatch accumulator have the stored (compressed) size.
    ``None`` (default): the model sees the stored parameters.
    """
    policy_loss_fn = precision_lib.cast_loss_fn(loss_fn, plan.policy)

    def train_step(state: TrainState, batch: PyTree):
        rng = jax.random.fold_in(state.rng, state.step)
        loss = policy_loss_fn
        if materialize is None:
            model_params = state.params
        elif getattr(tx, "grads_in_stored_layout", False):
            model_params = state.params

            def loss(params, model_state, batch, rng):  # the dense weights exist per microbatch
                return policy_loss_fn(materialize(params, state.opt_state), model_state, batch, rng)

        else:
            model_params = materialize(state.params, state.opt_state)
        grad_fn = scaled_grad_fn(loss, state.loss_scale)
        grad_fn = microbatch_lib.accumulate_gradients(grad_fn, plan.microbatches)
        grads, model_state, metrics = grad_fn(model_params, state.model_state, batch, rng)

        finite = loss_scale_lib.all_finite(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params, opt_state, model_state = loss_scale_lib.select_tree(
            finite,
            (params, opt_state, model_state),
            (state.params, state.opt_state, state.model_state),
        )
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=state.loss_scale.adjust(finite),
            skipped_steps=skipped,
        )
        metrics = {
            **metrics,
            "loss_scale": state.loss_scale.loss_scale,
            "grads_finite": finite,
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


def classifier_loss_fn(model: nn.Module, *, label_smoothing: float = 0.0) -> LossFn:
    """Softmax cross-entropy loss for a Flax classifier ``model(images, train) -> logits``.

    ``batch = {"image": [B, H, W, C] float, "label": [B] int}``. The loss is the mean over the
    batch, computed in float32; metrics are ``loss`` and ``accuracy``. Model state collections
    (``batch_stats``) are updated as in training mode.
    """

    def loss_fn(params, model_state, batch, rng):
        mutable = list(model_state)
        out = model.apply(
            {"params": params, **model_state},
            batch["image"],
            train=True,
            mutable=mutable or False,
            rngs={"dropout": rng} if rng is not None else {},
        )
        logits, new_state = out if mutable else (out, {})
        logits = logits.astype(jnp.float32)
        labels = batch["label"]
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets).mean()
        accuracy = (logits.argmax(-1) == labels).mean()
        return loss, (dict(new_state), {"loss": loss, "accuracy": accuracy})

    return loss_fn
