"""Image classification: the WideResNet on digits, Fashion-MNIST or CIFAR-10, scored by test
accuracy.

Datasets (nothing is downloaded):

* ``digits``: the 1,797 8x8 digits that ship with scikit-learn, split 80/20 by the seed,
  upsampled to ``image_size`` (8, 16 or 32) pixels;
* ``fashion-mnist``: the 60,000 / 10,000 28x28 images of Fashion-MNIST's IDX files
  (:mod:`lowmem_jax.data.fashion_mnist`; ``data_dir`` defaults to where Debian's
  ``dataset-fashion-mnist`` puts them), not augmented;
* ``cifar10``: read with ``tfds.data_source`` from a TFDS directory prepared once
  (docs/datasets.md); training batches get the WRN augmentation (4-px reflect pad, random
  crop, flip).

Epoch ``e`` (1-based) visits the training set in the order seeded by ``seed + e`` and augments
with ``default_rng([seed, e])``; a resumed run replays the skipped batches' augmentation, so
the data order and augmentation are functions of ``(seed, step)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from lowmem_jax import data as data_lib
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.registry import workload

#: The run's :class:`lowmem_jax.training.config.TrainConfig` (which imports the tasks: named,
#: not imported).
TrainConfig = Any

KIND = "classification"
DATASETS = ("digits", "fashion-mnist", "cifar10")
DEFAULT_MODEL = "wrn-16-2"
MODELS = "wrn-D-K (e.g. wrn-16-2, wrn-28-2)"
DEFAULT_EPOCHS = 10


def check_config(config: TrainConfig) -> None:
    """Raises ValueError for settings this task cannot run."""
    if config.dataset != "digits" and config.image_size != 32:
        raise ValueError(f"image_size={config.image_size} applies to dataset='digits' only")
    if config.dataset != "digits" and config.fold is not None:
        raise ValueError(f"fold={config.fold} applies to dataset='digits' only")
    sizes = data_lib.digits.IMAGE_SIZES
    if config.dataset == "digits" and config.image_size not in sizes:
        raise ValueError(f"image_size must be one of {list(sizes)}, got {config.image_size}")
    if config.batch_size % config.plan.microbatches:
        raise ValueError(
            f"batch_size={config.batch_size} is not divisible by "
            f"microbatches={config.plan.microbatches}"
        )


class Task:
    """The classification task of one run: data, batches, evaluation, summary."""

    # Parameters are initialised op by op, as the committed digits results were (a jitted
    # initialisation differs in the last bit and would not reproduce them bitwise).
    jit_init = False

    def __init__(self, config: TrainConfig):
        self.config = config
        input_dtype = config.plan.input_dtype
        if config.dataset == "digits":
            splits = data_lib.load_digits(
                seed=config.seed,
                image_size=config.image_size,
                input_dtype=input_dtype,
                fold=config.fold,
                folds=config.folds,
            )
            self.train, self.test, self.augment = splits["train"], splits["test"], False
            self.pixel_stats = {k: splits[k] for k in ("pixel_mean", "pixel_std")}
        elif config.dataset == "fashion-mnist":
            from lowmem_jax.data import fashion_mnist

            splits = fashion_mnist.load_fashion_mnist(config.data_dir, input_dtype=input_dtype)
            self.train, self.test, self.augment = splits["train"], splits["test"], False
            self.pixel_stats = {k: splits[k] for k in ("pixel_mean", "pixel_std")}
        else:
            from lowmem_jax.data import cifar10

            self.train = cifar10.load_cifar10("train", config.data_dir, input_dtype)
            self.test = cifar10.load_cifar10("test", config.data_dir, input_dtype)
            self.augment = True
            self.pixel_stats = {"pixel_mean": cifar10.PIXEL_MEAN, "pixel_std": cifar10.PIXEL_STD}
        self.steps_per_epoch = len(self.train["label"]) // config.batch_size
        if not self.steps_per_epoch:
            raise ValueError(
                f"batch_size={config.batch_size} exceeds the {len(self.train['label'])} "
                f"training images of dataset={config.dataset!r}"
            )
        if config.steps is not None:
            self.total_steps, self.epochs = config.steps, config.steps / self.steps_per_epoch
        else:
            self.epochs = config.epochs or DEFAULT_EPOCHS
            self.total_steps = self.epochs * self.steps_per_epoch
        self.eval_every = config.eval_every or self.steps_per_epoch

    def workload(self, config: TrainConfig) -> Workload:
        """The registry's model with this data's image shape (and pixel statistics, which
        normalise uint8 images inside the step)."""
        work = workload(config.model_name, **self.pixel_stats)
        return work.with_batch(self.example_batch(), config.batch_size)

    def example_batch(self) -> dict[str, np.ndarray]:
        return {k: v[:2] for k, v in self.train.items()}

    def train_batches(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(epoch, batch)`` for steps ``start .. stop - 1``."""
        from lowmem_jax.data.cifar10 import augment as augment_images

        config, step = self.config, start
        epoch = start // self.steps_per_epoch + 1
        skip = start - (epoch - 1) * self.steps_per_epoch
        while step < stop:
            batches = data_lib.iterate_batches(
                self.train, config.batch_size, seed=config.seed + epoch
            )
            augment_rng = np.random.default_rng([config.seed, epoch])
            for i, batch in enumerate(batches):
                if self.augment:  # also for skipped batches: the rng stream is replayed
                    batch = {**batch, "image": augment_images(batch["image"], augment_rng)}
                if i < skip:
                    continue
                yield epoch, batch
                step += 1
                if step >= stop:
                    return
            epoch, skip = epoch + 1, 0

    def evaluator(self, setup) -> Evaluator:
        return Evaluator(setup, self.test)

    def summary(self, evaluator, state, params, history, checkpointer, materialize) -> dict:
        del checkpointer, materialize
        if history and history[-1]["step"] == int(state.step):
            accuracy = history[-1]["test_accuracy"]
        else:
            accuracy = evaluator.evaluate(params, state.model_state)["test_accuracy"]
        return {
            "batch_size": self.config.batch_size,
            "epochs": self.epochs,
            "test_accuracy": accuracy,
            "test_examples": len(self.test["label"]),
        }


class Evaluator:
    """Test accuracy of the model's (materialized) parameters, in the plan's compute dtype."""

    def __init__(self, setup, test: dict[str, np.ndarray]):
        policy, model = setup.plan.policy, setup.model
        self.test = test

        @jax.jit
        def predict(params, model_state, images):
            variables = {"params": policy.cast_to_compute(params), **model_state}
            return model.apply(variables, policy.cast_to_compute(images), train=False).argmax(-1)

        self.predict = predict

    def evaluate(self, params, model_state) -> dict[str, float]:
        correct = 0
        for batch in data_lib.iterate_batches(self.test, 256, drop_remainder=False):
            predicted = np.asarray(self.predict(params, model_state, batch["image"]))
            correct += int((predicted == batch["label"]).sum())
        return {"test_accuracy": correct / len(self.test["label"])}
