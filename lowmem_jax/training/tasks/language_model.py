"""Causal language modelling: a LLaMA-style decoder on real text, scored by held-out loss.

Dataset (nothing is downloaded): ``python-source``, the ``.py`` files of this interpreter's
standard library as bytes (:mod:`lowmem_jax.data.python_source`; ``data_dir`` another folder of
``.py`` files), 1 file in 20 held out. The model's vocabulary is set to the 256 byte values.

Batches: ``max_tokens // seq_len`` windows of ``seq_len + 1`` bytes of the training stream
(:func:`~lowmem_jax.data.python_source.windows`, non-overlapping), inputs and targets shifted by
one; epoch ``e`` (1-based) visits the windows in the order ``default_rng([seed, e])`` permutes
them, so step ``s``'s batch is a function of ``(seed, s)`` and a resumed run continues exactly.

Records carry the held-out ``test_loss`` (nats per byte), ``test_bits_per_byte`` and
``test_accuracy`` (next-byte argmax), the mean over ``eval_windows`` windows spread evenly over
the held-out stream (default: all of them; rounded down to whole batches), in the plan's compute
dtype. The summary adds the
corpus' provenance (root, files, bytes and sha256 of each split).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from lowmem_jax.data import python_source
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.registry import workload

#: The run's :class:`lowmem_jax.training.config.TrainConfig` (which imports the tasks: named,
#: not imported).
TrainConfig = Any

__all__ = ["Task", "Evaluator"]

KIND = "lm"
DATASETS = ("python-source",)
DEFAULT_MODEL = "llama-18m"
MODELS = "llama-SIZE (e.g. llama-18m, llama-tiny)"
DEFAULT_STEPS = 300
DEFAULT_EVAL_EVERY = 100


def check_config(config: TrainConfig) -> None:
    """Raises ValueError for settings this task cannot run."""
    if config.plan.input_dtype != "float32":
        raise ValueError(
            f"input_dtype={config.plan.input_dtype!r} applies to image datasets; language "
            "model batches are int32 tokens (allowed here: 'float32')"
        )
    if config.fold is not None:
        raise ValueError(f"fold={config.fold} applies to dataset='digits' only")
    if config.dropout is not None:
        raise ValueError(f"dropout={config.dropout}: the llama-* decoders have no dropout")
    if config.max_tokens % config.seq_len:
        raise ValueError(
            f"max_tokens={config.max_tokens} is not a multiple of seq_len={config.seq_len}"
        )
    rows = config.max_tokens // config.seq_len
    if rows % config.plan.microbatches:
        raise ValueError(
            f"max_tokens // seq_len = {rows} sequences per batch is not divisible by "
            f"microbatches={config.plan.microbatches}"
        )


class Task:
    """The language modelling task of one run: the corpus, its windows, evaluation, summary."""

    jit_init = True

    def __init__(self, config: TrainConfig):
        self.config = config
        corpus = python_source.load_python_source(config.data_dir)
        self.info = corpus["info"]
        self.train = python_source.windows(corpus["train"], config.seq_len)
        self.rows = config.max_tokens // config.seq_len
        test = python_source.windows(corpus["test"], config.seq_len)
        count = len(test) if config.eval_windows is None else min(config.eval_windows, len(test))
        count -= count % self.rows  # whole batches of the training batch's shape
        if not count:
            raise ValueError(
                f"dataset={config.dataset!r}: the held-out split has {len(test)} windows of "
                f"{config.seq_len + 1} bytes, fewer than a batch of {self.rows}"
            )
        self.test = test[np.linspace(0, len(test) - 1, count).astype(int)]
        self.steps_per_epoch = len(self.train) // self.rows
        if not self.steps_per_epoch:
            raise ValueError(
                f"max_tokens={config.max_tokens} exceeds the {len(self.train) * config.seq_len} "
                f"training tokens of dataset={config.dataset!r}"
            )
        if config.steps is not None:
            self.total_steps = config.steps
        elif config.epochs is not None:
            self.total_steps = config.epochs * self.steps_per_epoch
        else:
            self.total_steps = DEFAULT_STEPS
        self.eval_every = config.eval_every or DEFAULT_EVAL_EVERY

    def workload(self, config: TrainConfig) -> Workload:
        """The registry's decoder with the 256 byte values as its vocabulary."""
        overrides = {"vocab_size": python_source.VOCAB_SIZE, **(config.model_overrides or {})}
        return workload(config.model_name, self.rows, seq_len=config.seq_len, **overrides)

    @staticmethod
    def _batch(windows: np.ndarray) -> dict[str, np.ndarray]:
        tokens = windows.astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def example_batch(self) -> dict[str, np.ndarray]:
        return self._batch(self.train[: self.rows])

    def train_batches(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(epoch, batch)`` for steps ``start .. stop - 1`` (epochs 1-based)."""
        order, epoch = None, None
        for step in range(start, stop):
            e, i = divmod(step, self.steps_per_epoch)
            if e + 1 != epoch:
                epoch = e + 1
                order = np.random.default_rng([self.config.seed, epoch]).permutation(
                    len(self.train)
                )
            rows = np.sort(order[i * self.rows : (i + 1) * self.rows])
            yield epoch, self._batch(self.train[rows])

    def evaluator(self, setup) -> Evaluator:
        return Evaluator(setup, self)

    def summary(self, evaluator, state, params, history, checkpointer, materialize) -> dict:
        del checkpointer, materialize
        if history and history[-1]["step"] == int(state.step):
            final = {k: v for k, v in history[-1].items() if k.startswith("test_")}
        else:
            final = evaluator.evaluate(params, state.model_state)
        return {
            "seq_len": self.config.seq_len,
            "max_tokens": self.config.max_tokens,
            **final,
            "eval_windows": len(self.test),
            "corpus": self.info,
        }


class Evaluator:
    """Held-out next-byte loss and accuracy of the model's (materialized) parameters."""

    def __init__(self, setup, task: Task):
        policy, loss_fn = setup.plan.policy, setup.loss_fn
        self.task = task

        @jax.jit
        def metrics(params, model_state, batch):
            _, (_, out) = loss_fn(policy.cast_to_compute(params), model_state, batch, None)
            return out

        self.metrics = metrics

    def evaluate(self, params, model_state) -> dict[str, float]:
        """``test_loss`` (nats per byte), ``test_bits_per_byte``, ``test_accuracy``: means over
        the held-out windows, in batches of the training batch's rows."""
        rows, test = self.task.rows, self.task.test
        sums = {"loss": 0.0, "accuracy": 0.0}
        for begin in range(0, len(test), rows):
            out = self.metrics(params, model_state, Task._batch(test[begin : begin + rows]))
            for k in sums:
                sums[k] += float(out[k])
        batches = len(test) // rows
        loss = sums["loss"] / batches
        return {
            "test_loss": loss,
            "test_bits_per_byte": loss / math.log(2),
            "test_accuracy": sums["accuracy"] / batches,
        }
