"""Translation through the one training loop (:mod:`lowmem_jax.training.loop`): config validation,
the inverse-sqrt schedule, learning, checkpoints and averaging, resume, the TFDS path, sparsity."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_TRANSLATION, assert_tensorboard_matches_jsonl

import lowmem_jax as lm
from lowmem_jax.techniques.sparsity import SparseConfig
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate
from lowmem_jax.workloads import translation_is_sparse
from lowmem_jax.workloads.recipes import inverse_sqrt_schedule

# A 1 + 1 layer, 32-channel model, one batch shape (widths <= 9 round up to 16; 32 rows), no
# dropout: a short run learns the copy task; compiles and steps stay short on CPU. The plan is
# fp32 (Plan()) unless a test says otherwise.
FAST = {
    "model_overrides": TINY_TRANSLATION, "max_tokens": 512, "length_multiple": 16,
    "max_len_b": 0, "dropout": 0.0, "learning_rate": 3e-3, "warmup": 50, "progress": False,
}  # fmt: skip


def _config(**kwargs):
    """The synthetic copy task on the small model, fp32, :data:`FAST` settings."""
    fields = {"dataset": "synthetic-copy", "model": "dynamicconv-small", "plan": lm.Plan()}
    return TrainConfig(**{**fields, **FAST, **kwargs})


def test_config_validation_errors():
    with pytest.raises(ValueError, match="model='big'"):
        TrainConfig(dataset="synthetic-copy", model="big")
    with pytest.raises(ValueError, match="dataset='wmt'.*synthetic-copy"):
        TrainConfig(dataset="wmt")
    with pytest.raises(
        ValueError,
        match=r"model='wrn-16-2' does not fit dataset='synthetic-copy' \(translation\); "
        "allowed values: dynamicconv-small, dynamicconv-iwslt",
    ):
        TrainConfig(dataset="synthetic-copy", model="wrn-16-2")
    with pytest.raises(ValueError, match="does not fit dataset='digits'"):
        TrainConfig(model="dynamicconv-small")
    with pytest.raises(ValueError, match="warmup"):
        TrainConfig(dataset="synthetic-copy", warmup=0)
    with pytest.raises(ValueError, match="resume"):
        TrainConfig(dataset="synthetic-copy", resume=True)
    with pytest.raises(ValueError, match="average_last"):
        TrainConfig(dataset="synthetic-copy", average_last=2)
    with pytest.raises(ValueError, match="keep_checkpoints"):
        TrainConfig(
            dataset="synthetic-copy", average_last=4, keep_checkpoints=3, checkpoint_dir="x"
        )
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(dataset="synthetic-copy", steps=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        TrainConfig(dataset="synthetic-copy", max_tokens=0)
    with pytest.raises(ValueError, match="epochs or steps"):
        TrainConfig(dataset="synthetic-copy", epochs=1, steps=10)
    with pytest.raises(ValueError, match="dropout"):
        TrainConfig(dataset="synthetic-copy", dropout=1.0)
    # keep_checkpoints defaults to max(3, average_last)
    config = TrainConfig(dataset="synthetic-copy", average_last=5, checkpoint_dir="x")
    assert config.keep == 5 and config.model_name == "dynamicconv-small"


def test_synthetic_reverse_long_is_the_longer_larger_vocabulary_reversal():
    from lowmem_jax.training.tasks.translation import load_translation_data

    config = TrainConfig(dataset="synthetic-reverse-long", model="dynamicconv-small", steps=1)
    train, test, tokenizer = load_translation_data(config)
    assert tokenizer is None and len(train["src"]) == 4096 and len(test["src"]) == 256
    lengths = [len(s) for s in train["src"]]
    assert min(lengths) == 4 and max(lengths) == 16
    assert max(max(s) for s in train["src"]) == 31 and min(min(s) for s in train["src"]) == 3
    assert all(t == s[::-1] for s, t in zip(train["src"], train["tgt"], strict=True))
    short, _, _ = load_translation_data(dataclasses.replace(config, dataset="synthetic-reverse"))
    assert max(len(s) for s in short["src"]) == 8  # the original task is unchanged


def test_inverse_sqrt_schedule_matches_fairseq():
    lr = inverse_sqrt_schedule(5e-4, 4000)
    assert float(lr(0)) == pytest.approx(1e-7)
    assert float(lr(2000)) == pytest.approx(1e-7 + (5e-4 - 1e-7) / 2)
    assert float(lr(4000)) == pytest.approx(5e-4)
    assert float(lr(16000)) == pytest.approx(2.5e-4)


@pytest.mark.slow
def test_synthetic_copy_learns_with_checkpoints_and_averaging(tmp_path):
    config = _config(
        steps=200, checkpoint_dir=str(tmp_path), checkpoint_every=50, keep_checkpoints=2,
        average_last=2, eval_every=100,
    )  # fmt: skip
    summary = train_and_evaluate(config, log=None)
    assert summary["steps"] == 200 and summary["skipped_steps"] == 0
    assert summary["model"] == "dynamicconv-small" and summary["dataset"] == "synthetic-copy"
    assert summary["plan"] == lm.Plan().to_dict() and "sparsity" not in summary
    assert summary["recipe"]["learning_rate"] == 3e-3 and summary["recipe"]["warmup"] == 50
    # Observed: token accuracy 0.983, BLEU greedy 94.9 / beam 96.2, exact match 0.92 / 0.92.
    assert summary["token_accuracy"] > 0.95
    assert summary["token_accuracy"] == summary["test_accuracy"]
    assert summary["bleu_greedy"] > 85 and summary["bleu_beam"] > 85
    assert summary["exact_match_greedy"] > 0.75 and summary["exact_match_beam"] > 0.75
    assert summary["bleu_sentences"] == 256 and summary["beam_size"] == 4
    averaged = summary["averaged"]
    assert averaged["steps_averaged"] == [150, 200]
    assert averaged["param_checksum"] != summary["param_checksum"]
    assert averaged["test_accuracy"] > 0.85
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [100, 200]
    assert records == summary["history"]
    assert_tensorboard_matches_jsonl(tmp_path)  # the same records as TensorBoard scalars


@pytest.mark.slow
def test_resumed_run_continues_from_the_saved_step(tmp_path):
    common = {"checkpoint_every": 10, "eval_every": 1000, "eval_sentences": 0}
    plan = lm.Plan(microbatches=2)  # every batch padded to an even number of rows
    straight = train_and_evaluate(_config(steps=30, plan=plan, **common), log=None)
    first = train_and_evaluate(
        _config(steps=20, plan=plan, checkpoint_dir=str(tmp_path), **common), log=None
    )
    assert first["steps"] == 20 and "bleu_beam" not in first
    lines = []
    resumed = train_and_evaluate(
        _config(steps=30, plan=plan, checkpoint_dir=str(tmp_path), resume=True, **common),
        log=lines.append,
    )
    assert lines[0].startswith("resumed from step 20")
    assert resumed["steps"] == 30
    assert resumed["param_checksum"] == straight["param_checksum"]
    assert resumed["token_accuracy"] == pytest.approx(straight["token_accuracy"])
    assert np.isfinite(resumed["test_loss"]) and jnp.isfinite(resumed["test_nll_loss"])


@pytest.mark.slow
def test_tfds_dataset_path_trains_tokenizer_and_scores_bleu(tmp_path, monkeypatch):
    from lowmem_jax.data import iwslt14

    rng = np.random.default_rng(0)
    de_words = "der die das haus katze hund ist klein groß und nicht ein".split()
    en_words = "the the the house cat dog is small big and not a".split()

    def fake_load(split, data_dir=None):
        pairs = []
        for _ in range(64 if split == "train" else 8):
            idx = rng.integers(0, len(de_words), size=rng.integers(2, 7))
            pairs.append((" ".join(de_words[i] for i in idx), " ".join(en_words[i] for i in idx)))
        return pairs

    monkeypatch.setattr(iwslt14, "load_iwslt14", fake_load)
    config = _config(
        dataset="iwslt14", vocab_size=40, steps=3, checkpoint_dir=str(tmp_path), max_len_b=4
    )
    summary = train_and_evaluate(config, log=None)
    assert (tmp_path / "tokenizer.model").is_file()
    assert summary["steps"] == 3 and summary["bleu_sentences"] == 8
    assert 0.0 <= summary["bleu_greedy"] <= 100.0 and 0.0 <= summary["bleu_beam"] <= 100.0


def test_translation_sparse_leaves_are_the_linear_kernels():
    assert translation_is_sparse(("encoder_k3_0", "stack", "fc1", "kernel"), (1, 64, 128))
    assert translation_is_sparse(
        ("decoder_k3_0", "stack", "encoder_attn", "q_proj", "kernel"), (64, 64)
    )
    assert not translation_is_sparse(
        ("encoder_k3_0", "stack", "conv", "weight_linear", "kernel"), (1, 64, 12)
    )
    assert not translation_is_sparse(("src_embed", "embedding"), (16, 64))
    assert not translation_is_sparse(("embed_out",), (16, 64))
    assert not translation_is_sparse(("encoder_k3_0", "stack", "fc1", "bias"), (1, 128))


SPARSE = SparseConfig(
    algorithm="rigl", density=0.1, distribution="uniform", update_period=25, compressed=True
)


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    """400 RigL steps at 90% sparsity (compressed), checkpoints every 100, the last 2 averaged."""
    directory = tmp_path_factory.mktemp("sparse")
    config = _config(
        steps=400, plan=lm.Plan(sparsity=SPARSE), checkpoint_dir=str(directory),
        checkpoint_every=100, keep_checkpoints=5, average_last=2, eval_every=100,
        eval_sentences=0,
    )  # fmt: skip
    return config, train_and_evaluate(config, log=None)


@pytest.mark.slow
def test_sparse_translation_keeps_the_budget_and_learns(sparse_run):
    _, summary = sparse_run
    sparsity = summary["sparsity"]
    assert sparsity["algorithm"] == "rigl" and sparsity["storage"] == "compressed"
    assert sparsity["target_density"] == 0.1
    assert sparsity["nnz"] == sparsity["budget"]  # exactly the budget after every rewiring
    assert sparsity["density"] == pytest.approx(0.1, abs=1e-3)
    assert sparsity["sparse_leaves"] == 12  # 6 Linear kernels per layer, 1 + 1 layers
    assert summary["plan"]["sparsity"] == SPARSE.describe()
    assert summary["param_count"] == 19_456  # dense (materialized) parameters
    # Observed: 0.71 after 400 steps (dense: 0.98 after 200); chance is 1/16.
    assert summary["token_accuracy"] > 0.5, summary["history"]
    # The average of the dense weights of steps 300 and 400 (masks frozen after step 300).
    averaged = summary["averaged"]
    assert averaged["steps_averaged"] == [300, 400]
    assert averaged["sparsity"]["density"] == pytest.approx(0.1, abs=1e-3)
    assert averaged["test_accuracy"] > 0.5


@pytest.mark.slow
def test_sparse_translation_resumes_exactly(sparse_run):
    config, summary = sparse_run
    directory = config.checkpoint_dir
    shutil.rmtree(f"{directory}/400")  # as if killed between the saves of steps 300 and 400
    lines = []
    resumed = train_and_evaluate(dataclasses.replace(config, resume=True), log=lines.append)
    assert lines[0].startswith("resumed from step 300")
    assert resumed["param_checksum"] == summary["param_checksum"]
    assert resumed["sparsity"] == summary["sparsity"]
    assert resumed["token_accuracy"] == pytest.approx(summary["token_accuracy"])
    # The record of step 400 was written once more, not twice; TensorBoard agrees.
    records = [json.loads(line) for line in open(f"{directory}/metrics.jsonl")]
    assert [r["step"] for r in records] == [100, 200, 300, 400]
    assert_tensorboard_matches_jsonl(directory)
