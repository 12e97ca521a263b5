import json

import pytest

from lowmem_jax import cli


def test_train_runs_end_to_end_and_learns(capsys, tmp_path):
    out = tmp_path / "summary.json"
    code = cli.main(
        [
            "train",
            "--model",
            "wrn-10-1",
            "--epochs",
            "4",
            "--batch-size",
            "64",
            "--microbatches",
            "2",
            "--remat",
            "full",
            "--precision",
            "mixed_fp16",
            "--no-progress",
            "--json",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == json.loads(out.read_text())
    assert summary["plan"]["loss_scale"] == "dynamic" and summary["plan"]["microbatches"] == 2
    assert len(summary["history"]) == 4
    assert summary["test_accuracy"] >= 0.9, summary["history"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--remat", "sometimes"], "remat"),
        (["--microbatches", "3"], "microbatches"),
        (["--model", "resnet-50"], "model"),
        (["--precision", "fp8"], "precision"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_help_explains_every_technique(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--precision", "--loss-scale", "--microbatches", "--remat"):
        assert flag in text


def test_train_sparse_keeps_the_budget(capsys):
    code = cli.main([
        "train", "--model", "wrn-10-1", "--epochs", "1", "--batch-size", "64",
        "--microbatches", "1", "--precision", "fp32", "--sparsity", "0.8",
        "--sparse-algorithm", "rigl", "--sparse-period", "5", "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sparsity"]["storage"] == "compressed"
    assert abs(summary["sparsity"]["density"] - 0.2) < 1e-3
    assert summary["param_count"] == 77_562 and summary["steps"] == 1437 // 64


def test_train_routes_translation_datasets_to_the_transformer(capsys):
    code = cli.main([
        "train", "--dataset", "synthetic-reverse", "--steps", "10", "--max-tokens", "256",
        "--microbatches", "2", "--precision", "fp32", "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 10 and 0.0 <= summary["bleu_beam"] <= 100.0


def test_train_rejects_an_image_model_for_translation(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--dataset", "synthetic-copy", "--model", "wrn-16-2"])
    assert exc.value.code == 2 and "dynamicconv-small" in capsys.readouterr().err


def test_train_accepts_sparsity_for_translation(monkeypatch, capsys):
    """The flags reach TranslationConfig (sparse runs themselves: test_run_translation.py)."""
    from lowmem_jax import run_translation

    seen = {}

    def fake_train(config, log):
        seen["config"] = config
        sparsity = {"density": 0.1}
        return {"token_accuracy": 0.5, "bleu_greedy": 1.0, "bleu_beam": 1.0, "steps": 10,
                "train_seconds": 1.0, "sparsity": sparsity}  # fmt: skip

    monkeypatch.setattr(run_translation, "train_and_evaluate_translation", fake_train)
    code = cli.main([
        "train", "--dataset", "synthetic-copy", "--sparsity", "0.9", "--sparse-algorithm", "set",
        "--sparse-period", "4", "--sparse-storage", "masked", "--no-tensorboard",
    ])  # fmt: skip
    assert code == 0 and "density 0.1000" in capsys.readouterr().out
    config = seen["config"]
    assert config.sparse.algorithm == "set" and config.sparse.density == pytest.approx(0.1)
    assert config.sparse.update_period == 4 and not config.sparse.compressed
    assert config.tensorboard is False
