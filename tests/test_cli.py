import json

import pytest

from lowmem_jax.cli import dispatch as cli
from lowmem_jax.compose.flags import plan_from_args
from lowmem_jax.workloads.flags import analyze_argv


@pytest.mark.slow
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
            "--image-size",  # the digits' own 8x8 pixels: ~10x cheaper than 32x32
            "8",
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
        (["--optimizer-state", "int2"], "optimizer-state"),
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


@pytest.mark.slow
def test_train_sparse_keeps_the_budget(capsys):
    """RigL from SNIP masks (the gradient on the first batch): the budget holds."""
    code = cli.main([
        "train", "--model", "wrn-10-1", "--epochs", "1", "--batch-size", "64",
        "--microbatches", "1", "--precision", "fp32", "--sparsity", "0.8", "--image-size", "8",
        "--sparse-init", "snip",
        "--sparse-algorithm", "rigl", "--sparse-period", "5", "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sparsity"]["storage"] == "compressed"
    assert abs(summary["sparsity"]["density"] - 0.2) < 1e-3
    assert summary["param_count"] == 77_562 and summary["steps"] == 1437 // 64


@pytest.mark.slow
def test_train_routes_translation_datasets_to_the_transformer(capsys):
    code = cli.main([
        "train", "--dataset", "synthetic-reverse", "--steps", "10", "--max-tokens", "256",
        "--microbatches", "1", "--precision", "fp32", "--no-progress", "--json",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 10 and 0.0 <= summary["bleu_beam"] <= 100.0


def test_train_rejects_an_image_model_for_translation(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--dataset", "synthetic-copy", "--model", "wrn-16-2"])
    assert exc.value.code == 2 and "dynamicconv-small" in capsys.readouterr().err


def _fake_train(monkeypatch, summary):
    """Replaces the one training loop; returns the dict that receives the config it gets."""
    from lowmem_jax.training import loop

    seen = {}

    def fake_train(config, log):
        seen["config"] = config
        return {"steps": 10, "train_seconds": 1.0, "skipped_steps": 0, "param_count": 1000,
                "backend": "cpu", **summary}  # fmt: skip

    monkeypatch.setattr(loop, "train_and_evaluate", fake_train)
    return seen


def test_train_accepts_sparsity_for_translation(monkeypatch, capsys):
    """The flags reach the plan of the one loop's config (sparse runs themselves:
    test_loop_translation.py)."""
    seen = _fake_train(
        monkeypatch,
        {"token_accuracy": 0.5, "bleu_greedy": 1.0, "bleu_beam": 1.0, "beam_size": 4,
         "sparsity": {"density": 0.1, "headline": "density 0.1000"}},
    )  # fmt: skip
    code = cli.main([
        "train", "--dataset", "synthetic-copy", "--sparsity", "0.9", "--sparse-algorithm", "set",
        "--sparse-period", "4", "--sparse-storage", "masked", "--no-tensorboard",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "density 0.1000" in out
    assert "token accuracy 0.5000, BLEU greedy 1.0 / beam-4 1.0 after 10 steps" in out
    config = seen["config"]
    sparse = config.plan.sparsity
    assert sparse.algorithm == "set" and sparse.density == pytest.approx(0.1)
    assert sparse.update_period == 4 and not sparse.compressed
    assert config.tensorboard is False and config.model_name == "dynamicconv-small"


def test_train_flags_left_out_keep_the_config_defaults(monkeypatch, capsys):
    from lowmem_jax.training.loop import TrainConfig

    seen = _fake_train(monkeypatch, {"test_accuracy": 0.5})
    assert cli.main(["train"]) == 0
    assert seen["config"] == TrainConfig()  # digits, wrn-16-2, the default plan and recipe
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("training wrn-16-2 on digits")
    assert lines[-1].startswith("test accuracy 0.5000 after 10 steps (")
    assert "density" not in lines[-1]


def test_train_steps_epochs_and_image_size_reach_either_task(monkeypatch, capsys):
    seen = _fake_train(monkeypatch, {"test_accuracy": 0.5})
    argv = ["train", "--model", "wrn-10-1", "--steps", "7", "--image-size", "8"]
    assert cli.main([*argv, "--lr-schedule", "step", "--eval-every", "3"]) == 0
    config = seen["config"]
    assert (config.steps, config.epochs, config.image_size) == (7, None, 8)
    assert (config.lr_schedule, config.eval_every) == ("step", 3)
    seen = _fake_train(
        monkeypatch, {"token_accuracy": 0.5, "bleu_greedy": 1.0, "bleu_beam": 1.0, "beam_size": 2}
    )
    argv = ["train", "--dataset", "synthetic-reverse", "--epochs", "2", "--beam-size", "2"]
    assert cli.main([*argv, "--lr-schedule", "constant", "--lr", "0.01"]) == 0
    config = seen["config"]
    assert (config.epochs, config.steps, config.beam_size) == (2, None, 2)
    assert (config.lr_schedule, config.learning_rate) == ("constant", 0.01)
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--dataset", "wmt"], "dataset"),
        (["--lr-schedule", "linear"], "lr-schedule"),
        (["--epochs", "2", "--steps", "3"], "epochs"),
        (["--image-size", "12"], "image_size"),
        (["--dataset", "cifar10", "--image-size", "8"], "image_size"),
        (["--dataset", "synthetic-copy", "--lr-schedule", "inverse_sqrt", "--warmup", "0"],
         "warmup"),
    ],
)  # fmt: skip
def test_bad_train_settings_exit_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_analyze_reads_its_compiled_step_back_from_the_cache(tmp_path):
    """A second run finds the step in the persistent compilation cache; same figures."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "lowmem_jax.cli", "analyze", "--model", "wrn-10-1",
            "--batch-size", "8", "--json", "--cache-dir", str(tmp_path)]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    cached = sorted(p.name for p in tmp_path.iterdir() if "train_step" in p.name)
    assert cached, list(tmp_path.iterdir())
    second = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    assert sorted(p.name for p in tmp_path.iterdir() if "train_step" in p.name) == cached
    assert json.loads(first.stdout)["xla"] == json.loads(second.stdout)["xla"]


@pytest.mark.parametrize("model, batch", [("wrn-28-2", 128), ("dynamicconv-iwslt", 100)])
def test_analyze_argv_gives_back_every_plan_of_the_report_grid(model, batch):
    import dataclasses

    from lowmem_jax.compose.plan import Plan
    from lowmem_jax.report.grid import standard_grid

    for name, _, plan in standard_grid(batch):
        argv = analyze_argv(model, batch, plan)
        args = cli.build_parser().parse_args(["analyze", *argv])
        assert (args.model, args.batch_size) == (model, batch), name
        assert args.plain == (plan is None), name
        if plan is not None:
            assert plan_from_args(args, Plan()) == plan, name
    workload_flags = ["--model", model, "--batch-size", str(batch)]
    if model.startswith("dynamicconv"):
        workload_flags += ["--seq-len", "40"]
    assert analyze_argv(model, batch, Plan()) == workload_flags  # no technique: no flag
    sparse = standard_grid(batch)[-1][2].sparsity
    pooled = Plan(sparsity=dataclasses.replace(sparse, regrow_pool="zeros_first"))
    assert analyze_argv(model, batch, pooled)[-2:] == ["--sparse-regrow-pool", "zeros_first"]
    with pytest.raises(ValueError, match="no flags for every setting"):
        analyze_argv(model, batch, Plan(sparsity=dataclasses.replace(sparse, seed=3)))
