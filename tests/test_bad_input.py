"""Bad input as a new user gives it: one line on stderr, exit status 2, no traceback, and
refused before anything is compiled (no train step is built)."""

import contextlib
import io
import math
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowmem_jax import workloads
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.training import loop

TRAIN = ["train", "--model", "wrn-10-1", "--image-size", "8", "--no-progress"]


@pytest.fixture
def nothing_compiles(monkeypatch):
    """Every refusal must come before the train step exists."""

    def refuse(*args, **kwargs):
        raise AssertionError("a train step was built for bad input")

    monkeypatch.setattr(workloads.builder, "make_train_step", refuse)


def _one_line_error(argv, capsys, prog="lowmem train"):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--lr", "-0.1"], "learning_rate must be a finite number > 0, got -0.1"),
        (["--lr", "nan"], "learning_rate must be a finite number > 0, got nan"),
        (["--lr", "inf"], "learning_rate must be a finite number > 0, got inf"),
        (["--weight-decay", "-1"], "weight_decay must be a finite number >= 0"),
        (["--label-smoothing", "1.5"], "label_smoothing must be in [0, 1)"),
        (["--warmup", "-5"], "warmup must be >= 0"),
        (["--batch-size", "5000"], "batch_size=5000 exceeds the 1437 training images"),
        (["--steps", "3", "--batch-size", "5000"], "batch_size=5000 exceeds"),
        (["--remat", "save:nosuchname"], "the model tags: ['conv_out']"),
        (["--model", "foo"], "Unknown model='foo'; allowed values: wrn-D-K"),
        (["--model", "dynamicconv-small"], "does not fit dataset='digits'"),
        (["--microbatches", "3"], "batch_size=128 is not divisible by microbatches=3"),
        (["--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
        (["--sparsity", "0.5", "--sparse-period", "0"], "update_period"),
        (["--epochs", "1", "--steps", "10"], "give epochs or steps, not both"),
        (["--image-size", "7"], "image_size must be one of [8, 16, 32]"),
        (["--eval-every", "0"], "eval_every must be >= 1"),
        (["--seed", "-1"], "seed must be in [0, 2**32), got -1"),
        (["--precision", "bogus"], "argument --precision: invalid choice: 'bogus'"),
        (["--optimizer-memory", "disk"], "argument --optimizer-memory: invalid choice: 'disk'"),
        (["--average-last", "3"], "average_last=3 needs a checkpoint_dir"),
        (["--max-consecutive-skips", "-1"], "max_consecutive_skips must be >= 0"),
        (["--dataset", "synthetic-copy", "--model", "dynamicconv-small", "--beam-size", "0"],
         "beam_size must be >= 1"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--fold", "5"], "fold must be in [0, 5) (folds=5), got 5"),
        (["--folds", "1"], "folds must be >= 2, got 1"),
        (["--input-dtype", "float16"], "argument --input-dtype: invalid choice: 'float16'"),
        (["--dataset", "synthetic-copy", "--model", "dynamicconv-small", "--input-dtype",
          "uint8"], "input_dtype='uint8' applies to image datasets"),
    ],
)  # fmt: skip
def test_bad_train_input_is_one_line_before_compiling(argv, match, capsys, nothing_compiles):
    assert match in _one_line_error([*TRAIN, *argv], capsys)


def test_bad_paths_are_one_line_before_anything_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loop.tasks_lib, "make_task", lambda config: pytest.fail("data loaded"))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--resume", "--checkpoint-dir", str(tmp_path / "nope")], "does not exist"),
        (["--resume", "--checkpoint-dir", str(tmp_path / "empty")], "holds no checkpoint"),
        (["--checkpoint-dir", str(a_file)], "is a file, not a directory"),
        (["--checkpoint-dir", "/proc/lowmem-checkpoints"], "cannot be created"),
        (["--output", str(tmp_path / "no" / "out.json")], "does not exist"),
        (["--output", str(tmp_path)], "is a directory"),
    ]
    for argv, match in cases:
        assert match in _one_line_error([*TRAIN, *argv], capsys)


def test_missing_datasets_are_one_line_with_how_to_prepare_them(tmp_path, capsys):
    line = _one_line_error(["train", "--dataset", "cifar10", "--data-dir", str(tmp_path)], capsys)
    assert "CIFAR-10 is not prepared" in line and "download_and_prepare" in line
    line = _one_line_error(["train", "--dataset", "iwslt14", "--data-dir", str(tmp_path)], capsys)
    assert "IWSLT" in line


@pytest.mark.parametrize(
    "argv, match",
    [
        (["analyze", "--model", "foo"], "Unknown model='foo'"),
        (["analyze", "--batch-size", "0"], "batch_size must be >= 1"),
        (["analyze", "--model", "dynamicconv-small", "--seq-len", "0"], "seq_len must be >= 1"),
        (["analyze", "--model", "wrn-10-1", "--batch-size", "8", "--remat", "save:x"],
         "the model tags: ['conv_out']"),
        (["analyze", "--model", "dynamicconv-small", "--remat", "save:conv_out"],
         "the model tags: ['dot_out']"),
        (["analyze", "--model", "wrn-10-1", "--batch-size", "8", "--remat", "offload:x"],
         "keeps ['x'], which the model never tags"),
        (["analyze", "--model", "wrn-10-1", "--microbatches", "3"], "not divisible"),
        (["analyze", "--plain", "--remat", "full", "--microbatches", "2"],
         "--plain is the step without any technique; it takes no --microbatches, --remat"),
        (["analyze", "--plain", "--sparsity", "0.5"], "it takes no --sparsity"),
        (["analyze", "--activations", "int3"], "Unknown activations='int3'; allowed values"),
        (["analyze", "--grad-compression", "int8"],
         "grad_compression='int8' needs shard=dp or zero1 (got 'none')"),
        (["analyze", "--devices", "1", "--shard", "zero3", "--grad-compression", "int8"],
         "which zero2 and zero3 partition"),
        (["analyze", "--grad-compression", "int4"], "argument --grad-compression: invalid choice"),
        (["analyze", "--pipeline", "0"], "pipeline must be an int >= 1, got 0"),
        (["analyze", "--pipeline-microbatches", "4"],
         "pipeline_microbatches=4 needs pipeline >= 2"),
        (["analyze", "--pipeline-rest", "partition"], "pipeline_rest='partition' needs pipeline"),
        (["analyze", "--pipeline-rest", "x"], "argument --pipeline-rest: invalid choice: 'x'"),
        (["analyze", "--model", "dynamicconv-small", "--input-dtype", "uint8"],
         "input_dtype='uint8' applies to image batches"),
        (["report", "--model", "foo", "--shard-devices", "none"], "Unknown model='foo'"),
        (["report", "--shard-devices", "1,2"], "'1,2': give auto, none or comma-separated"),
        (["report", "--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["plan", "--budget", "-5MiB"], "budget '-5MiB' is not a positive size"),  # not argparse's
        (["train", "--memory-budget", "-5MiB"], "budget '-5MiB' is not a positive size"),
        (["report", "--shard-devices", "x"], "argument --shard-devices: 'x': give auto"),
        (["report", "--model", "wrn-10-1", "--out-dir", "/proc/lowmem-report", "--shard-devices",
          "none"], "--out-dir"),
    ],
)  # fmt: skip
def test_bad_analyze_and_report_input_is_one_line(argv, match, capsys, nothing_compiles):
    assert match in _one_line_error(argv, capsys, prog=f"lowmem {argv[0]}")


def test_no_command_is_one_line(capsys):
    assert "required: command" in _one_line_error([], capsys, prog="lowmem")


def test_debug_shows_the_traceback_instead(capsys):
    with pytest.raises(ValueError, match="learning_rate"):
        cli.main([*TRAIN, "--lr", "-1", "--debug"])


def test_a_real_process_prints_one_line_and_no_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "lowmem_jax.cli", *TRAIN, "--lr", "nan"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "lowmem train: error: learning_rate must be a finite number > 0, got nan"
    ]


NUMBERS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([0.0, -0.5, 0.5, 1.0, 1.5, 1e9, math.inf, -math.inf, math.nan]),
)
NUMERIC_FLAGS = {
    "--lr": float, "--weight-decay": float, "--label-smoothing": float, "--warmup": int,
    "--seed": int, "--eval-every": int, "--checkpoint-every": int, "--keep-checkpoints": int,
    "--max-consecutive-skips": int, "--microbatches": int, "--sparsity": float,
}  # fmt: skip


def _run_cli_without_training(argv):
    """``(config the loop received or None, exit status, stderr)``; nothing trains."""
    seen = {}

    def fake_train(config, log=print):
        seen["config"] = config
        return {}

    err = io.StringIO()
    with (
        mock.patch.object(loop, "train_and_evaluate", fake_train),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            code = cli.main([*argv, "--json"])
        except SystemExit as exit_:
            code = exit_.code
    return seen.get("config"), code, err.getvalue()


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(NUMERIC_FLAGS)), NUMBERS, min_size=1, max_size=3))
def test_any_numeric_flag_value_is_accepted_or_refused_in_one_line(flags):
    """Accepted values reach the loop as a config; the rest exit 2 with one line."""
    argv = list(TRAIN)
    for flag, value in flags.items():
        value = NUMERIC_FLAGS[flag](value) if math.isfinite(value) else value
        argv += [flag, str(value)]
    config, code, err = _run_cli_without_training(argv)
    if code == 0:
        assert config is not None
        assert math.isfinite(config.recipe(workloads.WRN_RECIPE).learning_rate)
    else:
        assert config is None
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("lowmem train: error: ") and "Traceback" not in err


def test_paths_that_cannot_work_name_the_real_cause(tmp_path, capsys, nothing_compiles):
    """--output under a file said the directory "does not exist"; a missing --data-dir got a
    TFDS message claiming the data was "already prepared"; an unusable --cache-dir was a raw
    JAX warning and no cache. Each is one line naming the parameter and the cause."""
    a_file = tmp_path / "afile.txt"
    a_file.write_text("x")
    cases = [
        (["--output", str(a_file / "out.json")], f"--output={a_file}/out.json: {a_file} is a file"),
        (["--cache-dir", str(a_file)], f"--cache-dir={a_file} is a file, not a directory"),
    ]  # fmt: skip
    for argv, match in cases:
        assert match in _one_line_error([*TRAIN, *argv], capsys)
    missing = ["train", "--dataset", "cifar10", "--data-dir", str(tmp_path / "nope")]
    assert f"data_dir={tmp_path / 'nope'} does not exist" in _one_line_error(missing, capsys)
