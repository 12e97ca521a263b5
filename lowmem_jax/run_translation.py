"""Training and evaluation of the DynamicConv Transformer on translation, under a ``Plan``.

The translation counterpart of :mod:`lowmem_jax.run`, written like the Flax examples: a config,
then :func:`train_and_evaluate_translation`, which reads top to bottom (data and tokenizer,
model, optimizer, state, the one jitted step, the step loop with checkpoints, evaluation).

The recipe is fairseq's IWSLT'14 ``lightconv_iwslt_de_en`` one (BRIEF section 2): Adam
(0.9, 0.98) with decoupled weight decay 1e-4, learning rate warmed up linearly from 1e-7 to
``learning_rate`` over ``warmup`` steps then ``learning_rate * sqrt(warmup / step)``
(inverse square root), label smoothing 0.1, ``max_tokens`` tokens per batch, the last
``average_last`` checkpoints averaged, beam 4.

Datasets:

- ``synthetic-copy`` / ``synthetic-reverse``: :func:`lowmem_jax.data.make_translation_task`
  (vocabulary 16, lengths 1..8, 4,096 training and 256 held-out pairs from different seeds);
  BLEU is computed on the id strings (``"5 9 4"``).
- ``iwslt14`` / ``ted_multi``: German -> English from TFDS directories prepared once (README);
  a joint SentencePiece tokenizer of ``vocab_size`` ids is trained on the training split and
  saved as ``tokenizer.model`` in ``checkpoint_dir`` (reused on resume). Held-out = ``test``.

Batches come from :class:`lowmem_jax.data.TokenBatcher` (``max_tokens`` padded tokens per
batch, lengths rounded up to ``length_multiple``, rows padded to the budget): one compiled shape
per length bucket. The data order is a function of ``(seed, step)``, so ``resume`` continues a
run exactly, as :mod:`lowmem_jax.run` does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowmem_jax import translation
from lowmem_jax.checkpointing import resume_or_start
from lowmem_jax.data import synthetic
from lowmem_jax.data.token_batching import TokenBatcher, pad_batch
from lowmem_jax.data.tokenizer import Tokenizer, train_tokenizer
from lowmem_jax.models import (
    DynamicConvTransformer,
    greedy_decode,
    translation_is_sparse,
    translation_loss_fn,
)
from lowmem_jax.run import param_checksum
from lowmem_jax.sparsity import SparseConfig, default_is_sparse, density_report, sparse_training
from lowmem_jax.sparsity.layout import path_names
from lowmem_jax.train import Plan, TrainState, make_train_step

__all__ = [
    "TranslationConfig",
    "train_and_evaluate_translation",
    "inverse_sqrt_schedule",
    "load_translation_data",
    "translation_is_sparse",
    "MODELS",
    "DATASETS",
]

MODELS = ("small", "iwslt")
DATASETS = ("synthetic-copy", "synthetic-reverse", "iwslt14", "ted_multi")
SYNTHETIC = {"vocab_size": 16, "max_len": 8, "train": 4096, "test": 256}


@dataclasses.dataclass(frozen=True)
class TranslationConfig:
    """One translation run; the defaults are the synthetic copy task on the small model.

    For the IWSLT'14 recipe: ``model="iwslt", dataset="iwslt14", steps=50_000,
    learning_rate=5e-4, warmup=4000, max_tokens=4000, average_last=10``.

    Attributes:
      model: ``small`` (C 64, :meth:`DynamicConvTransformer.small`) or ``iwslt``
        (:meth:`DynamicConvTransformer.iwslt_de_en`, vocabularies from the tokenizer).
      dataset: one of :data:`DATASETS`.
      plan: the memory plan (precision, loss scale, microbatches, remat).
      sparse: train sparsely (:mod:`lowmem_jax.sparsity`), as :class:`lowmem_jax.run.TrainConfig`
        does: ``end_step`` defaults to 75% of ``steps``; with the default ``is_sparse`` the
        sparse leaves are :func:`translation_is_sparse`'s. Evaluation, decoding and checkpoint
        averaging use the dense (materialized) parameters.
      max_tokens: padded tokens per batch (``B * max(S, T)``; fairseq ``--max-tokens``).
      length_multiple: batch lengths are rounded up to a multiple of this (fewer shapes).
      steps: optimizer updates in total (a resumed run stops at the same step).
      learning_rate, warmup: peak rate and linear-warmup steps (:func:`inverse_sqrt_schedule`).
      weight_decay: decoupled (AdamW-style, as fairseq's Adam) decay on every parameter.
      label_smoothing: of the token cross-entropy.
      dropout: overrides the preset's dropout (``None``: 0.1 small, 0.3 iwslt).
      model_overrides: further :class:`DynamicConvTransformer` fields for the preset, e.g.
        ``{"embed_dim": 32, "encoder_kernel_sizes": (3,)}`` (``None``: the preset as is).
      vocab_size: SentencePiece vocabulary for the TFDS datasets (4 special ids included).
      seed: parameters, dropout and data order.
      data_dir: the TFDS directory (``None``: TFDS's default).
      checkpoint_dir, checkpoint_every, keep_checkpoints, resume: as :mod:`lowmem_jax.run`;
        the tokenizer, ``metrics.jsonl`` and the TensorBoard event files go there too.
      tensorboard: write each eval record as TensorBoard scalars as well
        (:mod:`lowmem_jax.metrics_writer`).
      average_last: evaluate also the average of the newest ``average_last`` checkpoints
        (``1``: no averaging; needs ``checkpoint_dir`` and ``keep_checkpoints >= average_last``).
      eval_every: steps between held-out loss / accuracy records (``metrics.jsonl``, ``log``).
      beam_size, length_penalty: beam search settings for the final BLEU.
      max_len_a, max_len_b: decode ``int(a * S + b)`` tokens for a source batch of width ``S``.
      eval_sentences: held-out sentences decoded for BLEU (``None``: all; ``0``: no decoding,
        only the teacher-forced loss and accuracy).
    """

    model: str = "small"
    dataset: str = "synthetic-copy"
    plan: Plan = Plan()
    sparse: SparseConfig | None = None
    max_tokens: int = 1024
    length_multiple: int = 8
    steps: int = 200
    learning_rate: float = 2e-3
    warmup: int = 50
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    dropout: float | None = None
    model_overrides: dict[str, Any] | None = None
    vocab_size: int = 10000
    seed: int = 0
    data_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 10
    resume: bool = False
    tensorboard: bool = True
    average_last: int = 1
    eval_every: int = 1000
    beam_size: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.0
    max_len_b: int = 8
    eval_sentences: int | None = 1000

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"Unknown model={self.model!r}; allowed values: {list(MODELS)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"Unknown dataset={self.dataset!r}; allowed values: {list(DATASETS)}")
        for name in (
            "max_tokens", "length_multiple", "steps", "warmup", "checkpoint_every",
            "keep_checkpoints", "average_last", "eval_every", "beam_size",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_sentences is not None and self.eval_sentences < 0:
            raise ValueError(f"eval_sentences must be >= 0 or None, got {self.eval_sentences}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty must be >= 0, got {self.length_penalty}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs a checkpoint_dir")
        if self.average_last > 1 and not self.checkpoint_dir:
            raise ValueError(f"average_last={self.average_last} needs a checkpoint_dir")
        if self.average_last > self.keep_checkpoints:
            raise ValueError(
                f"average_last={self.average_last} needs keep_checkpoints >= average_last, "
                f"got keep_checkpoints={self.keep_checkpoints}"
            )


def inverse_sqrt_schedule(
    learning_rate: float, warmup: int, init_learning_rate: float = 1e-7
) -> optax.Schedule:
    """fairseq's ``inverse_sqrt``: linear warmup, then decay with ``1 / sqrt(step)``.

    ``lr(s) = init + (learning_rate - init) * s / warmup`` for ``s < warmup``, else
    ``learning_rate * sqrt(warmup / s)``; ``s`` is the number of updates already applied, so
    the first update uses ``init`` (as fairseq, which sets the rate after each update).
    """
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = init_learning_rate + (learning_rate - init_learning_rate) * s / warmup
        decay = learning_rate * jnp.sqrt(warmup / jnp.maximum(s, 1.0))
        return jnp.where(s < warmup, warm, decay)

    return schedule


def _unpad(rows: np.ndarray, stop: int) -> list[list[int]]:
    """Padded rows -> id lists up to (excluding) the first ``stop`` token."""
    out = []
    for row in rows.tolist():
        out.append(row[: row.index(stop)] if stop in row else [t for t in row if t])
    return out


def load_translation_data(
    config: TranslationConfig,
) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]], Tokenizer | None]:
    """``(train, test, tokenizer)``: ``{"src", "tgt"}`` id lists without BOS/EOS.

    The tokenizer is ``None`` for the synthetic tasks (ids are the words). For the TFDS
    datasets it is trained on the training split's German and English sentences, or loaded from
    ``<checkpoint_dir>/tokenizer.model`` when that exists (a resumed run).
    """
    if config.dataset.startswith("synthetic-"):
        task = config.dataset.removeprefix("synthetic-")
        common = {"vocab_size": SYNTHETIC["vocab_size"], "max_len": SYNTHETIC["max_len"]}
        splits = []
        for size, seed in ((SYNTHETIC["train"], config.seed), (SYNTHETIC["test"], config.seed + 1)):
            data = synthetic.make_translation_task(task, size, seed=seed, **common)
            splits.append(
                {
                    "src": _unpad(data["src"], synthetic.EOS),
                    "tgt": _unpad(data["tgt_out"], synthetic.EOS),
                }
            )
        return splits[0], splits[1], None

    from lowmem_jax.data.iwslt14 import load_iwslt14, load_ted_multi_de_en

    load = load_iwslt14 if config.dataset == "iwslt14" else load_ted_multi_de_en
    train_pairs, test_pairs = load("train", config.data_dir), load("test", config.data_dir)
    directory = config.checkpoint_dir or tempfile.mkdtemp(prefix="lowmem_tokenizer_")
    path = os.path.join(directory, "tokenizer.model")
    if not os.path.exists(path):
        train_tokenizer(
            [s for pair in train_pairs for s in pair], config.vocab_size, path, seed=config.seed
        )
    tokenizer = Tokenizer.load(path)

    def encode(pairs):
        de, en = zip(*pairs, strict=True) if pairs else ((), ())
        return {"src": tokenizer.encode_batch(de), "tgt": tokenizer.encode_batch(en)}

    return encode(train_pairs), encode(test_pairs), tokenizer


def make_translation_model(config: TranslationConfig, vocab_size: int) -> DynamicConvTransformer:
    """The preset for ``config.model`` with a shared ``vocab_size`` for source and target."""
    overrides = dict(config.model_overrides or {})
    if config.dropout is not None:
        overrides["dropout"] = config.dropout
    if config.model == "small":
        return DynamicConvTransformer.small(vocab_size, vocab_size, **overrides)
    return DynamicConvTransformer.iwslt_de_en(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, **overrides
    )


def train_and_evaluate_translation(config: TranslationConfig, log=print) -> dict[str, Any]:
    """Trains ``config.model`` on ``config.dataset`` for ``config.steps`` updates; evaluates.

    Returns a summary: ``token_accuracy`` (teacher-forced, held-out, EOS included),
    ``bleu_greedy``, ``bleu_beam``, ``exact_match_greedy`` / ``exact_match_beam`` (decoded row
    equals the reference up to EOS), ``steps``, ``train_seconds``, ``param_checksum``, the
    metric ``history``, and, with ``average_last > 1``, ``averaged`` (the same metrics for the
    averaged parameters, ``steps_averaged`` and ``param_checksum``). The BLEU and exact-match
    keys are absent with ``eval_sentences=0``. ``log`` receives one line per ``eval_every``
    steps (``None`` to stay quiet).
    """
    # Data and tokenizer.
    train, test, tokenizer = load_translation_data(config)
    vocab_size = SYNTHETIC["vocab_size"] if tokenizer is None else tokenizer.vocab_size
    plan = config.plan
    batching = {
        "length_multiple": config.length_multiple,
        "batch_multiple": plan.microbatches,
        "equal_lengths": True,
        "pad_to_budget": True,
    }
    batcher = TokenBatcher(
        train["src"], train["tgt"], config.max_tokens, seed=config.seed, skip_oversized=True,
        **batching,
    )  # fmt: skip
    test_batcher = TokenBatcher(
        test["src"], test["tgt"], config.max_tokens, seed=None, skip_oversized=True, **batching
    )
    if not len(batcher) or not len(test_batcher):
        raise ValueError(
            f"dataset={config.dataset!r} has no training or held-out pair within "
            f"max_tokens={config.max_tokens}"
        )

    # Model, optimizer, state, the jitted step.
    model = plan.configure_model(make_translation_model(config, vocab_size))
    rng = jax.random.PRNGKey(config.seed)
    example = next(batcher.epoch(0))
    variables = jax.jit(functools.partial(model.init, train=False))(
        rng, example["src"][:1], example["tgt_in"][:1]
    )
    schedule = inverse_sqrt_schedule(config.learning_rate, config.warmup)
    tx = optax.adamw(
        schedule,
        b1=0.9,
        b2=0.98,
        eps=1e-8,
        weight_decay=config.weight_decay,
    )
    materialize = None
    if config.sparse is None:
        state = TrainState.create(params=variables["params"], tx=tx, plan=plan, rng=rng)
    else:
        sparse = config.sparse
        if sparse.end_step is None:
            sparse = dataclasses.replace(sparse, end_step=int(0.75 * config.steps))
        if sparse.is_sparse is default_is_sparse:
            sparse = dataclasses.replace(sparse, is_sparse=translation_is_sparse)
        tx = sparse_training(tx, sparse, variables["params"])
        materialize = tx.materialize
        state = tx.create_train_state(params=variables["params"], plan=plan, rng=rng)
    loss_fn = translation_loss_fn(model, label_smoothing=config.label_smoothing)
    train_step = make_train_step(loss_fn, tx, plan, materialize=materialize)

    def dense_params(state):
        """The model's parameters: sparse storage materialized (masked: already dense)."""
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

    # Evaluation: teacher-forced loss / accuracy (dropout off), greedy and beam decoding.
    policy = plan.policy

    @jax.jit
    def eval_metrics(params, batch):
        _, (_, metrics) = loss_fn(policy.cast_to_compute(params), {}, batch, None)
        return metrics

    decoders = {
        "greedy": jax.jit(
            lambda p, src, max_len: greedy_decode(model, policy.cast_to_compute(p), src, max_len),
            static_argnums=2,
        ),
        "beam": jax.jit(
            lambda p, src, max_len: translation.beam_search(
                model,
                policy.cast_to_compute(p),
                src,
                max_len=max_len,
                beam_size=config.beam_size,
                length_penalty=config.length_penalty,
            ),
            static_argnums=2,
        ),
    }

    # BLEU on the first eval_sentences held-out pairs (release order), batched by length.
    limit = len(test["src"]) if config.eval_sentences is None else config.eval_sentences
    bleu_set = {k: v[:limit] for k, v in test.items()}
    bleu_batcher = TokenBatcher(
        bleu_set["src"], bleu_set["tgt"], config.max_tokens, seed=None, skip_oversized=True,
        **batching,
    )  # fmt: skip

    def batches_of(batcher: TokenBatcher, data: dict[str, list[list[int]]]):
        for indices in batcher.batches:
            yield indices, pad_batch(data["src"], data["tgt"], indices, **_pad_args(batcher))

    def evaluate_loss(params) -> dict[str, float]:
        sums, tokens = {"loss": 0.0, "nll_loss": 0.0, "accuracy": 0.0}, 0.0
        for _, batch in batches_of(test_batcher, test):
            metrics = eval_metrics(params, batch)
            n = float(metrics["tokens"])
            tokens += n
            for k in sums:
                sums[k] += float(metrics[k]) * n
        return {f"test_{k}": v / max(tokens, 1.0) for k, v in sums.items()}

    def evaluate(params) -> dict[str, float]:
        results = evaluate_loss(params)
        if not bleu_batcher.num_examples:
            return results
        references, hypotheses = [], {name: [] for name in decoders}
        for indices, batch in batches_of(bleu_batcher, bleu_set):
            max_len = int(config.max_len_a * batch["src"].shape[1] + config.max_len_b)
            references += translation.detokenize([bleu_set["tgt"][i] for i in indices], tokenizer)
            for name, decode in decoders.items():
                rows = np.asarray(decode(params, batch["src"], max_len))[: len(indices)]
                hypotheses[name] += translation.detokenize(rows, tokenizer)
        for name, hyps in hypotheses.items():
            results[f"bleu_{name}"] = translation.bleu(
                hyps, references, tokenize="none" if tokenizer is None else "13a"
            )
            results[f"exact_match_{name}"] = float(
                np.mean([h == r for h, r in zip(hyps, references, strict=True)])
            )
        results["bleu_sentences"] = len(references)
        return results

    # The step loop. Step s uses batch s % len(batcher) of epoch s // len(batcher).
    history = []
    sums, seen = {"loss": 0.0, "accuracy": 0.0}, 0
    start = time.perf_counter()
    step = start_step
    while step < config.steps:
        epoch, skip = divmod(step, len(batcher))
        batches = itertools.islice(batcher.epoch(epoch), skip, None)
        for batch in batches:
            state, metrics = train_step(state, batch)
            step = int(state.step)
            seen += 1
            for k in sums:
                sums[k] += float(metrics[k])
            if step % config.eval_every == 0 or step == config.steps:
                record = {
                    "step": step,
                    "epoch": epoch,
                    "train_loss": sums["loss"] / max(seen, 1),
                    "train_accuracy": sums["accuracy"] / max(seen, 1),
                    **evaluate_loss(dense_params(state)),
                    "skipped_steps": int(state.skipped_steps),
                    "loss_scale": float(state.loss_scale.loss_scale),
                    "learning_rate": float(schedule(step - 1)),  # of this step's update
                    "seconds": time.perf_counter() - start,
                }
                history.append(record)
                sums, seen = {k: 0.0 for k in sums}, 0
                if metrics_writer:  # the record first, then the checkpoint of its step
                    metrics_writer.write(record)
                if log:
                    log(
                        f"step {step:6d}  loss {record['train_loss']:.4f}  "
                        f"test loss {record['test_loss']:.4f}  "
                        f"test acc {record['test_accuracy']:.4f}  "
                        f"lr {record['learning_rate']:.2e}  {record['seconds']:.1f}s"
                    )
            if checkpointer:
                checkpointer.save(step, state)
            if step >= config.steps:
                break
    train_seconds = time.perf_counter() - start
    if checkpointer:
        checkpointer.save(int(state.step), state, force=True)

    params = dense_params(state)
    final = evaluate(params)
    summary = {
        "model": config.model,
        "dataset": config.dataset,
        "plan": plan.to_dict(),
        "max_tokens": config.max_tokens,
        "seed": config.seed,
        "param_count": int(sum(x.size for x in jax.tree.leaves(params))),
        "param_checksum": param_checksum(state.params),
        "sparsity": None if config.sparse is None else _sparsity_summary(tx, state),
        "steps": int(state.step),
        "token_accuracy": final["test_accuracy"],
        **final,
        "beam_size": config.beam_size,
        "skipped_steps": int(state.skipped_steps),
        "train_seconds": train_seconds,
        "backend": jax.default_backend(),
        "history": history,
    }
    if checkpointer and config.average_last > 1:
        target = jax.eval_shape(lambda: state)
        steps = translation.checkpoint_steps(checkpointer.directory)[-config.average_last :]
        if len(steps) < config.average_last:
            raise FileNotFoundError(
                f"average of the last {config.average_last} checkpoints needs "
                f"{config.average_last}, found {len(steps)} in {checkpointer.directory}"
            )
        # Sparse runs average the materialized dense weights (masks may differ between
        # checkpoints, so the average's non-zeros are the union of theirs).
        averaged = translation.average_checkpoints(
            [dense_params(checkpointer.restore(target, step=s)) for s in steps]
        )
        summary["averaged"] = {
            **evaluate(averaged),
            "steps_averaged": steps,
            "param_checksum": param_checksum(averaged),
        }
        if config.sparse is not None:
            summary["averaged"]["density"] = _dense_density(averaged, tx)
    if checkpointer:
        checkpointer.close()
    if metrics_writer:
        metrics_writer.close()
    summary["seconds"] = time.perf_counter() - start
    return summary


def _sparsity_summary(tx, state) -> dict[str, Any]:
    """Measured sparsity of the final state: algorithm, storage, nnz, budget, density."""
    report = density_report(tx, state.params, state.opt_state)
    return {
        "algorithm": tx.config.algorithm,
        "storage": "compressed" if tx.config.compressed else "masked",
        "target_density": tx.config.density,
        "nnz": report["nnz"],
        "budget": tx.layout.total_budget,
        "size": report["size"],
        "density": report["density"],
        "sparse_leaves": len(tx.layout.leaves),
    }


def _dense_density(params, tx) -> float:
    """Fraction of non-zeros in the sparse leaves of dense ``params``."""
    keys = set(tx.layout.keys)
    nnz = size = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if "/".join(path_names(path)) in keys:
            nnz += int(np.count_nonzero(np.asarray(leaf)))
            size += leaf.size
    return nnz / max(size, 1)


def _pad_args(batcher: TokenBatcher) -> dict[str, Any]:
    """The :func:`pad_batch` arguments ``batcher.epoch`` uses."""
    return {
        "length_multiple": batcher.length_multiple,
        "batch_multiple": batcher.batch_multiple,
        "equal_lengths": batcher.equal_lengths,
        "max_tokens": batcher.max_tokens if batcher.pad_to_budget else None,
    }
