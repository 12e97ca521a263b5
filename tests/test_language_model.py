"""The Python source corpus (lowmem_jax.data.python_source) and the language modelling task
(lowmem_jax.training.tasks.language_model), on folders of .py files the tests write."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest

from lowmem_jax import Plan
from lowmem_jax.data import python_source
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate
from lowmem_jax.training.tasks import language_model

FAST = {"precision": "fp32", "microbatches": 1, "remat": "none"}


def _write_corpus(root, files: int = 40, size: int = 600) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    texts = {}
    for i in range(files):
        words = rng.choice(["def", "return", "x", "=", "(", ")", ":", "\n", "    ", "# why"], size)
        text = " ".join(words).encode()
        path = root / f"pkg{i % 3}" / f"mod_{i}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text)
        texts[path.relative_to(root).as_posix()] = text
    (root / "site-packages").mkdir()
    (root / "site-packages" / "installed.py").write_text("not the standard library")
    (root / "notes.txt").write_text("not source")
    return texts


def test_the_corpus_is_every_source_file_split_by_its_path(tmp_path):
    texts = _write_corpus(tmp_path)
    corpus = python_source.load_python_source(tmp_path, held_out_every=4)
    held = sorted(n for n in texts if zlib.crc32(n.encode()) % 4 == 0)
    kept = sorted(n for n in texts if n not in held)
    for split, names in (("train", kept), ("test", held)):
        joined = python_source.SEPARATOR.join(texts[n] for n in names)
        assert corpus[split].tobytes() == joined
        info = corpus["info"][split]
        assert info == {"files": len(names), "bytes": len(joined),
                        "sha256": hashlib.sha256(joined).hexdigest()}  # fmt: skip
    assert corpus["info"]["root"] == str(tmp_path)


def test_bad_corpora_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="held_out_every must be >= 2, got 1"):
        python_source.load_python_source(tmp_path, held_out_every=1)
    with pytest.raises(ValueError, match="holds no .py file"):
        python_source.load_python_source(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        python_source.load_python_source(tmp_path / "missing")
    (tmp_path / "one.py").write_text("x = 1")
    with pytest.raises(ValueError, match="no file falls in the (test|train) split"):
        python_source.load_python_source(tmp_path)


def test_windows_overlap_by_the_one_byte_the_targets_shift():
    stream = np.arange(23, dtype=np.uint8)
    w = python_source.windows(stream, 5)
    assert w.shape == (4, 6) and not w.flags.writeable
    np.testing.assert_array_equal(w[1], np.arange(5, 11))
    assert all(w[k, -1] == w[k + 1, 0] for k in range(3))
    with pytest.raises(ValueError, match="holds no window of 24"):
        python_source.windows(stream, 23)


def _config(tmp_path, **overrides) -> TrainConfig:
    fields = {"dataset": "python-source", "model": "llama-tiny", "data_dir": str(tmp_path),
              "seq_len": 16, "max_tokens": 64, "steps": 6, "eval_every": 3, "eval_windows": 8,
              "plan": Plan(**FAST), "progress": False,
              "tensorboard": False}  # fmt: skip
    return TrainConfig(**{**fields, **overrides})


def test_a_step_s_batch_depends_on_the_seed_and_the_step_only(tmp_path):
    _write_corpus(tmp_path)
    task = language_model.Task(_config(tmp_path))
    whole = list(task.train_batches(0, task.steps_per_epoch + 3))
    resumed = list(task.train_batches(task.steps_per_epoch - 1, task.steps_per_epoch + 3))
    for (e1, a), (e2, b) in zip(whole[task.steps_per_epoch - 1 :], resumed, strict=True):
        assert e1 == e2 and all(np.array_equal(a[k], b[k]) for k in a)
    batch = whole[0][1]
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    # Each epoch visits every window once, in a seeded order.
    seen = np.concatenate([b["inputs"][:, 0] for _, b in whole[: task.steps_per_epoch]])
    assert len(seen) == task.rows * task.steps_per_epoch
    other = language_model.Task(_config(tmp_path, seed=1))
    assert not np.array_equal(next(other.train_batches(0, 1))[1]["inputs"], batch["inputs"])


def test_the_decoder_learns_held_out_source_bytes(tmp_path):
    _write_corpus(tmp_path)
    summary = train_and_evaluate(_config(tmp_path, steps=30, eval_every=30), log=None)
    first = train_and_evaluate(_config(tmp_path, steps=1, eval_every=1), log=None)
    assert summary["test_loss"] < first["test_loss"] - 0.5
    assert summary["test_bits_per_byte"] == pytest.approx(summary["test_loss"] / np.log(2))
    assert summary["eval_windows"] == 8 and summary["corpus"]["test"]["files"] >= 1
    assert summary["param_count"] == 106_816  # the tiny shape with the 256 byte values


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_tokens": 60}, "max_tokens=60 is not a multiple of seq_len=16"),
        ({"dropout": 0.1}, "dropout=0.1: the llama-\\* decoders have no dropout"),
        ({"model": "wrn-16-2"}, "does not fit dataset='python-source' \\(lm\\)"),
    ],
)
def test_settings_the_task_cannot_run_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)
