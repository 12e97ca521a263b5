import json
import os

import pytest
from conftest import assert_tensorboard_matches_jsonl

from lowmem_jax.training.metrics_writer import MetricsWriter, read_jsonl, read_scalars


def test_writes_json_lines_and_tensorboard_scalars(tmp_path):
    records = [
        {"step": 10, "epoch": 1, "loss": 0.5, "done": False, "name": "a", "extra": None},
        {"step": 20, "epoch": 2, "loss": 0.25, "done": True, "name": "b", "extra": None},
    ]
    with MetricsWriter(str(tmp_path)) as writer:
        for r in records:
            writer.write(r)
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == records
    scalars = read_scalars(str(tmp_path))
    assert scalars == {"epoch": [(10, 1.0), (20, 2.0)], "loss": [(10, 0.5), (20, 0.25)]}
    assert_tensorboard_matches_jsonl(tmp_path)


def test_nested_records_are_flattened_and_step_can_be_given(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write({"eval": {"bleu": 30.5, "acc": 0.75}, "loss": 1.0}, step=7)
    assert read_scalars(str(tmp_path)) == {
        "eval/bleu": [(7, 30.5)],
        "eval/acc": [(7, 0.75)],
        "loss": [(7, 1.0)],
    }


def test_reopening_at_a_step_drops_and_purges_later_records(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        for step in (10, 20, 30):
            writer.write({"step": step, "loss": 1.0 / step})
    # A resume from the checkpoint at step 20: the record of step 30 goes, then comes again.
    with MetricsWriter(str(tmp_path), start_step=20) as writer:
        writer.write({"step": 30, "loss": 0.5})
        writer.write({"step": 40, "loss": 0.25})
    assert len(os.listdir(tmp_path)) == 3  # metrics.jsonl and two event files
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [
        (10, 0.1), (20, 0.05), (30, 0.5), (40, 0.25),
    ]  # fmt: skip
    assert_tensorboard_matches_jsonl(tmp_path)
    # A fresh run (start_step 0) in the same directory starts the history anew.
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write({"step": 5, "loss": 2.0})
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 5, "loss": 2.0}]
    assert read_scalars(str(tmp_path)) == {"loss": [(5, 2.0)]}


def test_tensorboard_can_be_turned_off(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.write({"step": 1, "loss": 1.0})
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}


def test_reader_checks_the_framing(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write({"step": 1, "loss": 1.0})
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("events.out.tfevents.")]
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[:-3]))  # a record cut short (a kill mid-write) is ignored
    assert read_scalars(str(tmp_path)) == {}
    data[-5] ^= 0xFF  # a flipped byte in the last record's payload is an error
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted"):
        read_scalars(str(tmp_path))
