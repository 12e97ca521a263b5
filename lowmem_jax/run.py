"""Training and evaluation of a classifier with a composed :class:`~lowmem_jax.Plan`.

The loop of ``lowmem train``, written like the Flax examples: a config, then
:func:`train_and_evaluate`, whose steps read top to bottom (data, model, optimizer, state, the
one jitted step, epochs with evaluation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowmem_jax import data as data_lib
from lowmem_jax.checkpointing import resume_or_start
from lowmem_jax.data.cifar10 import augment as augment_images
from lowmem_jax.sparsity import SparseConfig, density_report, sparse_training
from lowmem_jax.train import Plan, TrainState, classifier_loss_fn, make_train_step
from lowmem_jax.workloads import make_model, sgd_nesterov

__all__ = ["TrainConfig", "train_and_evaluate", "param_checksum", "DATASETS"]

DATASETS = ("digits", "cifar10")
SCHEDULES = ("cosine", "step")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. The defaults are the embedded default job (``lowmem train``).

    ``sparse``: train sparsely (:mod:`lowmem_jax.sparsity`); its ``end_step`` defaults to 75% of
    training (mask updates stop there). ``image_size``: digits only (8, 16 or 32 pixels; 8 is the
    original resolution and trains ~16x cheaper than 32). ``lr_schedule``: ``cosine`` decay to
    0, or ``step`` (x0.2 at 30%, 60% and 80% of training: epochs 60/120/160 of 200, the WRN
    recipe). With
    ``checkpoint_dir`` the state is saved every ``checkpoint_every`` steps (keeping
    ``keep_checkpoints``) and at the end, and per-epoch metrics are appended to
    ``<checkpoint_dir>/metrics.jsonl`` and, unless ``tensorboard=False``, written as TensorBoard
    scalars there (:mod:`lowmem_jax.metrics_writer`); ``resume`` continues from the newest
    checkpoint there, exactly (records after it are dropped and written again).
    """

    model: str = "wrn-16-2"
    dataset: str = "digits"
    plan: Plan = Plan(precision="mixed_fp16", microbatches=4, remat="full")
    sparse: SparseConfig | None = None
    batch_size: int = 128
    epochs: int = 10
    learning_rate: float = 0.1
    lr_schedule: str = "cosine"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    image_size: int = 32
    data_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    resume: bool = False
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"Unknown dataset={self.dataset!r}; allowed values: {list(DATASETS)}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown lr_schedule={self.lr_schedule!r}; allowed values: {list(SCHEDULES)}"
            )
        if not self.model.startswith("wrn-"):
            raise ValueError(f"model={self.model!r}: lowmem train supports wrn-D-K models")
        make_model(self.model, 10)  # validates the name
        if self.dataset != "digits" and self.image_size != 32:
            raise ValueError(f"image_size={self.image_size} applies to dataset='digits' only")
        for name in ("batch_size", "epochs", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.plan.microbatches:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"microbatches={self.plan.microbatches}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs a checkpoint_dir")


def load_splits(config: TrainConfig) -> tuple[dict, dict, bool]:
    """(train, test, augment) for ``config.dataset``; nothing is downloaded."""
    if config.dataset == "digits":
        splits = data_lib.load_digits(seed=config.seed, image_size=config.image_size)
        return splits["train"], splits["test"], False
    from lowmem_jax.data.cifar10 import load_cifar10

    return (
        load_cifar10("train", config.data_dir),
        load_cifar10("test", config.data_dir),
        True,
    )


def learning_rate_schedule(config: TrainConfig, total_steps: int) -> optax.Schedule:
    if config.lr_schedule == "cosine":
        return optax.cosine_decay_schedule(config.learning_rate, total_steps)
    bounds = {int(total_steps * f): 0.2 for f in (0.3, 0.6, 0.8)}
    return optax.piecewise_constant_schedule(config.learning_rate, bounds)


def param_checksum(params) -> str:
    """sha256 of the parameters' bytes in tree order: equal iff bitwise-equal parameters."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def train_and_evaluate(config: TrainConfig, log=print) -> dict[str, Any]:
    """Trains ``config.model`` on ``config.dataset``; returns a summary with the per-epoch history.

    ``log`` receives one line per epoch (``None`` to stay quiet).
    """
    from tqdm.auto import tqdm

    train, test, augment = load_splits(config)
    steps_per_epoch = len(train["label"]) // config.batch_size
    total_steps = config.epochs * steps_per_epoch

    plan = config.plan
    model = plan.configure_model(make_model(config.model, num_classes=10))
    rng = jax.random.PRNGKey(config.seed)
    variables = model.init(rng, jnp.asarray(train["image"][:2]), train=False)
    tx = sgd_nesterov(
        learning_rate_schedule(config, total_steps), config.momentum, config.weight_decay
    )
    model_state = {"batch_stats": variables["batch_stats"]}
    materialize = None
    if config.sparse is None:
        state = TrainState.create(
            params=variables["params"], model_state=model_state, tx=tx, plan=plan, rng=rng
        )
    else:
        sparse = config.sparse
        if sparse.end_step is None:
            sparse = dataclasses.replace(sparse, end_step=int(0.75 * total_steps))
        tx = sparse_training(tx, sparse, variables["params"])
        materialize = tx.materialize
        state = tx.create_train_state(
            params=variables["params"], plan=plan, model_state=model_state, rng=rng
        )
    train_step = make_train_step(classifier_loss_fn(model), tx, plan, materialize=materialize)

    def model_params(state):
        return state.params if materialize is None else materialize(state.params, state.opt_state)

    checkpointer, state, metrics_writer = resume_or_start(
        state,
        config.checkpoint_dir,
        every=config.checkpoint_every,
        keep=config.keep_checkpoints,
        resume=config.resume,
        tensorboard=config.tensorboard,
    )
    start_step = int(state.step)
    if log and start_step:
        log(f"resumed from step {start_step} in {config.checkpoint_dir}")

    @jax.jit
    def predict(state, images):
        params = plan.policy.cast_to_compute(model_params(state))
        variables = {"params": params, **state.model_state}
        return model.apply(variables, plan.policy.cast_to_compute(images), train=False).argmax(-1)

    def evaluate(state, split):
        correct = 0
        for batch in data_lib.iterate_batches(split, 256, drop_remainder=False):
            correct += int((np.asarray(predict(state, batch["image"])) == batch["label"]).sum())
        return correct / len(split["label"])

    history = []
    start = time.perf_counter()
    for epoch in range(start_step // steps_per_epoch + 1, config.epochs + 1):
        epoch_start = time.perf_counter()
        # The data order is a function of (seed, epoch): a resumed run skips what was consumed.
        batches = data_lib.iterate_batches(train, config.batch_size, seed=config.seed + epoch)
        augment_rng = np.random.default_rng([config.seed, epoch])
        skip = max(0, start_step - (epoch - 1) * steps_per_epoch)
        sums, seen = {"loss": 0.0, "accuracy": 0.0}, 0
        bar = tqdm(
            batches,
            total=steps_per_epoch,
            desc=f"epoch {epoch}/{config.epochs}",
            disable=not config.progress,
            leave=False,
        )
        for i, batch in enumerate(bar):
            if augment:
                batch = {**batch, "image": augment_images(batch["image"], augment_rng)}
            if i < skip:
                continue
            state, metrics = train_step(state, batch)
            seen += 1
            for k in sums:
                sums[k] += float(metrics[k])
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
            if checkpointer and int(state.step) % steps_per_epoch:  # epoch end: below
                checkpointer.save(int(state.step), state)
        record = {
            "epoch": epoch,
            "step": int(state.step),
            "train_loss": sums["loss"] / max(seen, 1),
            "train_accuracy": sums["accuracy"] / max(seen, 1),
            "test_accuracy": evaluate(state, test),
            "skipped_steps": int(state.skipped_steps),
            "loss_scale": float(state.loss_scale.loss_scale),
            "epoch_seconds": time.perf_counter() - epoch_start,
        }
        history.append(record)
        if metrics_writer:  # the record first, then the checkpoint of its step
            metrics_writer.write(record)
        if checkpointer:
            checkpointer.save(int(state.step), state)
        if log:
            log(
                f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  "
                f"train acc {record['train_accuracy']:.4f}  "
                f"test acc {record['test_accuracy']:.4f}  "
                f"skipped {record['skipped_steps']}  scale {record['loss_scale']:.0f}  "
                f"{record['epoch_seconds']:.1f}s"
            )
    if checkpointer:
        checkpointer.save(int(state.step), state, force=True)
        checkpointer.close()
    if metrics_writer:
        metrics_writer.close()
    return {
        "model": config.model,
        "dataset": config.dataset,
        "plan": plan.to_dict(),
        "batch_size": config.batch_size,
        "epochs": config.epochs,
        "seed": config.seed,
        "param_count": int(sum(x.size for x in jax.tree.leaves(model_params(state)))),
        "param_checksum": param_checksum(state.params),
        "sparsity": None
        if config.sparse is None
        else {
            "algorithm": config.sparse.algorithm,
            "storage": "compressed" if config.sparse.compressed else "masked",
            "density": density_report(tx, state.params, state.opt_state)["density"],
        },
        "steps": int(state.step),
        "test_accuracy": evaluate(state, test) if not history else history[-1]["test_accuracy"],
        "skipped_steps": int(state.skipped_steps),
        "train_seconds": time.perf_counter() - start,
        "backend": jax.default_backend(),
        "history": history,
    }
