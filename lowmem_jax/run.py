"""Training and evaluation of a classifier with a composed :class:`~lowmem_jax.Plan`.

The loop of ``lowmem train``, written like the Flax examples: a config, then
:func:`train_and_evaluate`, whose steps read top to bottom (data, model, optimizer, state, the
one jitted step, epochs with evaluation).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowmem_jax import data as data_lib
from lowmem_jax.train import Plan, TrainState, classifier_loss_fn, make_train_step
from lowmem_jax.workloads import make_model, sgd_nesterov

__all__ = ["TrainConfig", "train_and_evaluate", "DATASETS"]

DATASETS = ("digits",)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. The defaults are the embedded default job (``lowmem train``)."""

    model: str = "wrn-16-2"
    dataset: str = "digits"
    plan: Plan = Plan(precision="mixed_fp16", microbatches=4, remat="full")
    batch_size: int = 128
    epochs: int = 10
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"Unknown dataset={self.dataset!r}; allowed values: {list(DATASETS)}")
        make_model(self.model, 10)  # validates the name
        for name in ("batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.plan.microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"microbatches={self.plan.microbatches}"
            )


def train_and_evaluate(config: TrainConfig, log=print) -> dict[str, Any]:
    """Trains ``config.model`` on ``config.dataset``; returns a summary with the per-epoch history.

    ``log`` receives one line per epoch (``None`` to stay quiet).
    """
    from tqdm.auto import tqdm

    splits = data_lib.load_digits(seed=config.seed)
    train, test = splits["train"], splits["test"]
    steps_per_epoch = len(train["label"]) // config.batch_size

    plan = config.plan
    model = plan.configure_model(make_model(config.model, num_classes=10))
    rng = jax.random.PRNGKey(config.seed)
    variables = model.init(rng, jnp.asarray(train["image"][:2]), train=False)
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.epochs * steps_per_epoch)
    tx = sgd_nesterov(schedule, config.momentum, config.weight_decay)
    state = TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        tx=tx,
        plan=plan,
        rng=rng,
    )
    train_step = make_train_step(classifier_loss_fn(model), tx, plan)

    @jax.jit
    def predict(state, images):
        variables = {"params": plan.policy.cast_to_compute(state.params), **state.model_state}
        return model.apply(variables, plan.policy.cast_to_compute(images), train=False).argmax(-1)

    def evaluate(state, split):
        correct = 0
        for batch in data_lib.iterate_batches(split, 256, drop_remainder=False):
            correct += int((np.asarray(predict(state, batch["image"])) == batch["label"]).sum())
        return correct / len(split["label"])

    history = []
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        epoch_start = time.perf_counter()
        batches = data_lib.iterate_batches(train, config.batch_size, seed=config.seed + epoch)
        sums = {"loss": 0.0, "accuracy": 0.0}
        bar = tqdm(
            batches,
            total=steps_per_epoch,
            desc=f"epoch {epoch}/{config.epochs}",
            disable=not config.progress,
            leave=False,
        )
        for batch in bar:
            state, metrics = train_step(state, batch)
            for k in sums:
                sums[k] += float(metrics[k])
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
        record = {
            "epoch": epoch,
            "train_loss": sums["loss"] / steps_per_epoch,
            "train_accuracy": sums["accuracy"] / steps_per_epoch,
            "test_accuracy": evaluate(state, test),
            "skipped_steps": int(state.skipped_steps),
            "loss_scale": float(state.loss_scale.loss_scale),
            "epoch_seconds": time.perf_counter() - epoch_start,
        }
        history.append(record)
        if log:
            log(
                f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  "
                f"train acc {record['train_accuracy']:.4f}  "
                f"test acc {record['test_accuracy']:.4f}  "
                f"skipped {record['skipped_steps']}  scale {record['loss_scale']:.0f}  "
                f"{record['epoch_seconds']:.1f}s"
            )
    return {
        "model": config.model,
        "dataset": config.dataset,
        "plan": plan.to_dict(),
        "batch_size": config.batch_size,
        "epochs": config.epochs,
        "seed": config.seed,
        "param_count": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "test_accuracy": history[-1]["test_accuracy"],
        "skipped_steps": int(state.skipped_steps),
        "train_seconds": time.perf_counter() - start,
        "backend": jax.default_backend(),
        "history": history,
    }
