"""Named workloads: a model, its input shapes, loss and optimizer recipe, under a :class:`Plan`.

One place that turns ``("wrn-28-2", batch 128, plan)`` into the pieces the training loop, the
memory analysis, the report and the benchmarks all need, so that every figure they print refers
to the same step.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import memory, models, precision
from lowmem_jax.train import Plan, TrainState, classifier_loss_fn, make_train_step

__all__ = ["make_model", "sgd_nesterov", "abstract_state", "analyze_model", "MODEL_PATTERN"]

MODEL_PATTERN = "wrn-D-K (e.g. wrn-28-2)"


def make_model(name: str, num_classes: int = 10, **kwargs: Any) -> models.WideResNet:
    """``wrn-D-K`` -> ``WideResNet(depth=D, width=K, num_classes=...)``.

    Raises:
      ValueError: naming ``model`` and the accepted pattern.
    """
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


def abstract_state(model, tx, plan: Plan, input_shape) -> TrainState:
    """The train state's shapes and dtypes (``jax.eval_shape``: nothing is allocated)."""

    def init():
        variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, *input_shape)), train=False)
        model_state = {k: v for k, v in variables.items() if k != "params"}
        return TrainState.create(
            params=variables["params"], tx=tx, plan=plan, model_state=model_state
        )

    return jax.eval_shape(init)


def analyze_model(
    model: str,
    batch_size: int,
    plan: Plan,
    *,
    input_shape: tuple[int, ...] = (32, 32, 3),
    num_classes: int = 10,
    tx: optax.GradientTransformation | None = None,
) -> memory.MemoryReport:
    """Memory analysis of one train step of a named model: compile-only, no data, no step run.

    Raises:
      ValueError: for an unknown model, a bad plan, or a batch size the microbatches don't divide.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size % plan.microbatches:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by microbatches={plan.microbatches}"
        )
    flax_model = plan.configure_model(make_model(model, num_classes))
    tx = tx or sgd_nesterov()
    state = abstract_state(flax_model, tx, plan, input_shape)
    batch = {
        "image": jax.ShapeDtypeStruct((batch_size, *input_shape), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }
    loss_fn = classifier_loss_fn(flax_model)
    step = make_train_step(loss_fn, tx, plan)
    return memory.analyze(
        step,
        state,
        batch,
        loss_fn=precision.cast_loss_fn(loss_fn, plan.policy),
        microbatches=plan.microbatches,
        config={"model": model, "batch_size": batch_size, **plan.to_dict()},
    )
