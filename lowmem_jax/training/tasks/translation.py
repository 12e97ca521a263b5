"""Translation: the DynamicConv Transformer, scored by held-out loss, accuracy and BLEU.

Datasets (nothing is downloaded):

- ``synthetic-copy`` / ``synthetic-reverse``: :func:`lowmem_jax.data.make_translation_task`
  (vocabulary 16, lengths 1..8, 4,096 training and 256 held-out pairs from different seeds);
  ``synthetic-reverse-long``: the reversal with vocabulary 32 and lengths 4..16, which the
  small model learns in about a thousand Adam steps, not a few hundred (:data:`SYNTHETIC`).
  BLEU is computed on the id strings (``"5 9 4"``).
- ``iwslt14`` / ``ted_multi``: German -> English from TFDS directories prepared once
  (docs/datasets.md); a joint SentencePiece tokenizer of ``vocab_size`` ids is trained on the
  training split and saved as ``tokenizer.model`` in ``checkpoint_dir`` (reused on resume).
  Held-out = ``test``.

Batches come from :class:`lowmem_jax.data.TokenBatcher` (``max_tokens`` padded tokens per
batch, lengths rounded up to ``length_multiple``, rows padded to the budget and to a multiple of
the plan's microbatches): one compiled shape per length bucket. Step ``s`` uses batch
``s % len(batcher)`` of epoch ``s // len(batcher)``, so a resumed run continues exactly.

Records carry the teacher-forced held-out ``test_loss``, ``test_nll_loss`` and
``test_accuracy`` (dropout off). The summary adds greedy and beam-search BLEU and exact match on
the first ``eval_sentences`` held-out pairs and, with ``average_last > 1``, the same for the
average of the newest checkpoints (fairseq's recipe: the last 10), computed on the model's
(materialized) parameters.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from lowmem_jax.core.base import in_host_memory
from lowmem_jax.data import synthetic
from lowmem_jax.data.token_batching import TokenBatcher, TokenBudget
from lowmem_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_tokenizer
from lowmem_jax.models import beam_search, greedy_decode
from lowmem_jax.training.averaging import average_last_checkpoints
from lowmem_jax.training.checkpointing import param_checksum
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.registry import workload

#: The run's :class:`lowmem_jax.training.config.TrainConfig` (which imports the tasks: named,
#: not imported).
TrainConfig = Any

__all__ = ["Task", "load_translation_data", "detokenize", "bleu"]

KIND = "translation"
DATASETS = ("synthetic-copy", "synthetic-reverse", "synthetic-reverse-long", "iwslt14", "ted_multi")
DEFAULT_MODEL = "dynamicconv-small"
MODELS = "dynamicconv-small, dynamicconv-iwslt"
DEFAULT_STEPS = 200
DEFAULT_EVAL_EVERY = 1000
# dataset -> make_translation_task's arguments; 4,096 training and 256 held-out pairs each.
SYNTHETIC = {
    "synthetic-copy": {"task": "copy", "vocab_size": 16, "min_len": 1, "max_len": 8},
    "synthetic-reverse": {"task": "reverse", "vocab_size": 16, "min_len": 1, "max_len": 8},
    "synthetic-reverse-long": {"task": "reverse", "vocab_size": 32, "min_len": 4, "max_len": 16},
}
SYNTHETIC_SIZES = {"train": 4096, "test": 256}


def check_config(config: TrainConfig) -> None:
    """Raises ValueError for settings this task cannot run."""
    if config.dropout is not None and not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {config.dropout}")
    if config.plan.input_dtype != "float32":
        raise ValueError(
            f"input_dtype={config.plan.input_dtype!r} applies to image datasets; translation "
            "batches are int32 tokens (allowed here: 'float32')"
        )
    if config.fold is not None:
        raise ValueError(f"fold={config.fold} applies to dataset='digits' only")


def detokenize(rows: Any, tokenizer: Tokenizer | None = None) -> list[str]:
    """Token rows ``[N, T]`` (or a list of id lists) -> ``N`` strings, each cut at its first EOS.

    With a ``tokenizer``: :meth:`Tokenizer.decode` (subwords joined into text). Without: the ids
    as space-separated decimal words (PAD and BOS skipped): ``[5, 9, 2, 0] -> "5 9"``, which is
    how BLEU is computed on the synthetic tasks.
    """
    out = []
    for row in rows:
        if tokenizer is not None:
            out.append(tokenizer.decode(row))
            continue
        words = []
        for i in np.asarray(row).tolist():
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                words.append(str(i))
        out.append(" ".join(words))
    return out


def bleu(
    hypotheses: Sequence[str],
    references: Sequence[str],
    *,
    tokenize: str = "13a",
    lowercase: bool = False,
) -> float:
    """sacreBLEU corpus BLEU (0..100) of detokenized ``hypotheses`` against one reference each.

    ``tokenize`` is sacreBLEU's tokenizer (``13a`` the default, ``none`` for pre-tokenized text
    such as the synthetic id strings). Identical corpora score 100, disjoint ones 0.

    Raises:
      ValueError: for empty or unequal-length inputs.
    """
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(
            f"hypotheses and references must have equal lengths, got {len(hypotheses)} and "
            f"{len(references)}"
        )
    if not hypotheses:
        raise ValueError("hypotheses must not be empty")
    result = sacrebleu.corpus_bleu(
        list(hypotheses), [list(references)], tokenize=tokenize, lowercase=lowercase
    )
    return float(result.score)


def _unpad(rows: np.ndarray, stop: int) -> list[list[int]]:
    """Padded rows -> id lists up to (excluding) the first ``stop`` token."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(stop)] if stop in row else [t for t in row if t])
    return out


def load_translation_data(
    config: TrainConfig,
) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]], Tokenizer | None]:
    """``(train, test, tokenizer)``: ``{"src", "tgt"}`` id lists without BOS/EOS.

    The tokenizer is ``None`` for the synthetic tasks (ids are the words). For the TFDS
    datasets it is trained on the training split's German and English sentences, or loaded from
    ``<checkpoint_dir>/tokenizer.model`` when that exists (a resumed run).
    """
    if config.dataset in SYNTHETIC:
        settings = dict(SYNTHETIC[config.dataset])
        task = settings.pop("task")
        splits = []
        for split, seed in (("train", config.seed), ("test", config.seed + 1)):
            size = SYNTHETIC_SIZES[split]
            pairs = synthetic.make_translation_task(task, size, seed=seed, **settings)
            splits.append(
                {
                    "src": _unpad(pairs["src"], synthetic.EOS),
                    "tgt": _unpad(pairs["tgt_out"], synthetic.EOS),
                }
            )
        return splits[0], splits[1], None

    from lowmem_jax.data.iwslt14 import load_iwslt14, load_ted_multi_de_en

    load = load_iwslt14 if config.dataset == "iwslt14" else load_ted_multi_de_en
    train_pairs, test_pairs = load("train", config.data_dir), load("test", config.data_dir)
    directory = config.checkpoint_dir or tempfile.mkdtemp(prefix="lowmem_tokenizer_")
    path = os.path.join(directory, "tokenizer.model")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        train_tokenizer(
            [s for pair in train_pairs for s in pair], config.vocab_size, path, seed=config.seed
        )
    tokenizer = Tokenizer.load(path)

    def encode(pairs):
        de, en = zip(*pairs, strict=True) if pairs else ((), ())
        return {"src": tokenizer.encode_batch(de), "tgt": tokenizer.encode_batch(en)}

    return encode(train_pairs), encode(test_pairs), tokenizer


class Task:
    """The translation task of one run: data, token batches, evaluation, summary."""

    jit_init = True

    def __init__(self, config: TrainConfig):
        self.config = config
        self.train, self.test, self.tokenizer = load_translation_data(config)
        self.vocab_size = (
            SYNTHETIC[config.dataset]["vocab_size"]
            if self.tokenizer is None
            else self.tokenizer.vocab_size
        )
        # Every batch's shape from its length bucket, B a multiple of the microbatch count.
        self.budget = TokenBudget(
            config.max_tokens,
            length_multiple=config.length_multiple,
            batch_multiple=config.plan.microbatches,
            skip_oversized=True,
        )
        self.batcher = self._batcher(self.train, seed=config.seed)
        self.test_batcher = self._batcher(self.test, seed=None)
        if not len(self.batcher) or not len(self.test_batcher):
            raise ValueError(
                f"dataset={config.dataset!r} has no training or held-out pair within "
                f"max_tokens={config.max_tokens}"
            )
        if config.steps is not None:
            self.total_steps = config.steps
        elif config.epochs is not None:
            self.total_steps = config.epochs * len(self.batcher)
        else:
            self.total_steps = DEFAULT_STEPS
        self.eval_every = config.eval_every or DEFAULT_EVAL_EVERY

    def _batcher(self, split: dict[str, list[list[int]]], seed: int | None) -> TokenBatcher:
        return TokenBatcher(
            split["src"], split["tgt"], self.budget, seed=seed, equal_lengths=True,
            pad_to_budget=True,
        )  # fmt: skip

    def workload(self, config: TrainConfig) -> Workload:
        """The registry's model with this data's (shared) vocabulary and the run's dropout."""
        overrides = {"src_vocab_size": self.vocab_size, "tgt_vocab_size": self.vocab_size}
        overrides.update(config.model_overrides or {})
        if config.dropout is not None:
            overrides["dropout"] = config.dropout
        return workload(config.model_name, **overrides).with_batch(self.example_batch())

    def example_batch(self) -> dict[str, np.ndarray]:
        return next(self.batcher.epoch(0))

    def train_batches(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(epoch, batch)`` for steps ``start .. stop - 1`` (epochs 1-based)."""
        step = start
        while step < stop:
            epoch, skip = divmod(step, len(self.batcher))
            for i, batch in enumerate(self.batcher.epoch(epoch)):
                if i < skip:
                    continue
                yield epoch + 1, batch
                step += 1
                if step >= stop:
                    return

    def evaluator(self, setup) -> Evaluator:
        return Evaluator(setup, self)

    def summary(self, evaluator, state, params, history, checkpointer, materialize) -> dict:
        config = self.config
        final = evaluator.evaluate(params, state.model_state, decode=True)
        out = {
            "max_tokens": config.max_tokens,
            "token_accuracy": final["test_accuracy"],
            **final,
            "beam_size": config.beam_size,
        }
        if checkpointer and config.average_last > 1:
            # Sparse runs average the materialized dense weights (masks may differ between
            # checkpoints, so the average's non-zeros are the union of theirs).
            averaged, steps = average_last_checkpoints(
                checkpointer, jax.eval_shape(lambda: state), config.average_last, materialize
            )
            out["averaged"] = {
                **evaluator.evaluate(averaged, state.model_state, decode=True),
                "steps_averaged": steps,
                "param_checksum": param_checksum(averaged),
                **evaluator.tx.describe(params=averaged),
            }
        return out


class Evaluator:
    """Held-out loss and accuracy (teacher-forced), and greedy / beam BLEU."""

    def __init__(self, setup, task: Task):
        config, policy, model = task.config, setup.plan.policy, setup.model
        self.task, self.tx = task, setup.tx
        loss_fn = setup.loss_fn

        @jax.jit
        def metrics(params, model_state, batch):
            _, (_, out) = loss_fn(policy.cast_to_compute(params), model_state, batch, None)
            return out

        def decoded(params):  # decoding reads the parameters whole, on the device (streamed
            # ones too: Plan.weight_memory moves them only inside the training step's layers)
            device = jax.memory.Space.Device
            on_device = jax.tree.map(
                lambda x: jax.device_put(x, device) if in_host_memory(x) else x, params
            )
            return policy.cast_to_compute(on_device)

        def greedy(params, src, max_len):
            return greedy_decode(model, decoded(params), src, max_len)

        def beam(params, src, max_len):
            return beam_search(
                model,
                decoded(params),
                src,
                max_len=max_len,
                beam_size=config.beam_size,
                length_penalty=config.length_penalty,
            )

        self.metrics = metrics
        self.decoders = {
            "greedy": jax.jit(greedy, static_argnums=2),
            "beam": jax.jit(beam, static_argnums=2),
        }
        # BLEU on the first eval_sentences held-out pairs (release order), batched by length.
        limit = len(task.test["src"]) if config.eval_sentences is None else config.eval_sentences
        self.bleu_set = {k: v[:limit] for k, v in task.test.items()}
        self.bleu_batcher = task._batcher(self.bleu_set, seed=None)

    @staticmethod
    def _batches(batcher: TokenBatcher):
        for indices in batcher.batches:
            yield indices, batcher.padded(indices)

    def evaluate(self, params, model_state, decode: bool = False) -> dict[str, float]:
        """Token-weighted ``test_loss``, ``test_nll_loss``, ``test_accuracy``; with ``decode``
        also ``bleu_greedy``, ``bleu_beam``, ``exact_match_*`` and ``bleu_sentences`` (none of
        them when ``eval_sentences`` is 0)."""
        sums, tokens = {"loss": 0.0, "nll_loss": 0.0, "accuracy": 0.0}, 0.0
        for _, batch in self._batches(self.task.test_batcher):
            metrics = self.metrics(params, model_state, batch)
            n = float(metrics["count"])  # the non-pad tokens (translation_loss_fn)
            tokens += n
            for k in sums:
                sums[k] += float(metrics[k]) * n
        results = {f"test_{k}": v / max(tokens, 1.0) for k, v in sums.items()}
        if decode and self.bleu_batcher.num_examples:
            results.update(self._bleu(params))
        return results

    def _bleu(self, params) -> dict[str, float]:
        config, tokenizer = self.task.config, self.task.tokenizer
        references, hypotheses = [], {name: [] for name in self.decoders}
        for indices, batch in self._batches(self.bleu_batcher):
            max_len = int(config.max_len_a * batch["src"].shape[1] + config.max_len_b)
            references += detokenize([self.bleu_set["tgt"][i] for i in indices], tokenizer)
            for name, decode in self.decoders.items():
                rows = np.asarray(decode(params, batch["src"], max_len))[: len(indices)]
                hypotheses[name] += detokenize(rows, tokenizer)
        results: dict[str, float] = {}
        for name, hyps in hypotheses.items():
            results[f"bleu_{name}"] = bleu(
                hyps, references, tokenize="none" if tokenizer is None else "13a"
            )
            results[f"exact_match_{name}"] = float(
                np.mean([h == r for h, r in zip(hyps, references, strict=True)])
            )
        results["bleu_sentences"] = len(references)
        return results
