"""Fashion-MNIST's IDX loader on files the tests write, and `lowmem train` on them."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowmem_jax.cli import dispatch as cli
from lowmem_jax.data import fashion_mnist as fm


def write_release(folder, n_train=24, n_test=8, size=28, gz=True, seed=0):
    """A miniature of the release: the four IDX files, random pixels and labels."""
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("test", n_test)):
        images_name, labels_name = fm.FILES[split]
        images = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        fm.write_idx(str(folder / (images_name + suffix)), images)
        fm.write_idx(str(folder / (labels_name + suffix)), labels)
    return folder


@settings(max_examples=30, deadline=None)
@given(
    array=hnp.arrays(
        st.sampled_from([np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
    ),
    gz=st.booleans(),
)
def test_idx_files_round_trip(tmp_path_factory, array, gz):
    path = str(tmp_path_factory.mktemp("idx") / ("a.idx" + (".gz" if gz else "")))
    fm.write_idx(path, array)
    back = fm.read_idx(path)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_the_header_is_big_endian_as_the_format_says(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    fm.write_idx(str(path), np.arange(300, dtype=np.int32))
    raw = path.read_bytes()
    assert raw[:8] == bytes([0, 0, 0x0C, 1, 0, 0, 1, 44])  # int32, 1 dim, 300 = 0x012C
    assert raw[8:12] == bytes([0, 0, 0, 0]) and raw[-4:] == bytes([0, 0, 1, 43])  # 299


def test_loads_both_splits_standardised_with_the_training_statistics(tmp_path):
    splits = fm.load_fashion_mnist(str(write_release(tmp_path)))
    train, test = splits["train"], splits["test"]
    assert train["image"].shape == (24, 28, 28, 1) and test["image"].shape == (8, 28, 28, 1)
    assert train["image"].dtype == np.float32 and train["label"].dtype == np.int32
    assert abs(train["image"].mean()) < 1e-5 and abs(train["image"].std() - 1) < 1e-4
    raw = fm.load_fashion_mnist(str(tmp_path), input_dtype="uint8")
    (mean,), (std,) = raw["pixel_mean"], raw["pixel_std"]
    pixels = fm.read_idx(str(tmp_path / "t10k-images-idx3-ubyte.gz"))
    np.testing.assert_array_equal(raw["test"]["image"][..., 0], pixels)
    np.testing.assert_allclose(test["image"], (raw["test"]["image"] - mean) / std, rtol=1e-6)


def test_plain_files_load_like_gzipped_ones(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    gz = fm.load_fashion_mnist(str(write_release(tmp_path / "a", gz=True)), input_dtype="uint8")
    plain = fm.load_fashion_mnist(str(write_release(tmp_path / "b", gz=False)), input_dtype="uint8")
    np.testing.assert_array_equal(gz["train"]["image"], plain["train"]["image"])


def test_a_missing_release_names_the_debian_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt install dataset-fashion-mnist"):
        fm.load_fashion_mnist(str(tmp_path))


@pytest.mark.parametrize(
    "content, match",
    [(b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "is not an IDX file"),
     (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "holds 2 bytes of values"),
     (b"\x00\x00\x08\x03\x00\x00\x00\x05", "ends inside its IDX header")],
)  # fmt: skip
def test_a_file_that_is_not_idx_is_refused_by_name(tmp_path, content, match):
    path = tmp_path / "x-idx1-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(content)
    with pytest.raises(ValueError, match=match):
        fm.read_idx(str(path))


def test_lowmem_train_reads_the_release_from_data_dir(tmp_path):
    (tmp_path / "fm").mkdir()
    data = write_release(tmp_path / "fm", n_train=16, n_test=8)
    output = tmp_path / "summary.json"
    argv = ["train", "--dataset", "fashion-mnist", "--data-dir", str(data), "--model", "wrn-10-1",
            "--batch-size", "8", "--steps", "2", "--output", str(output)]  # fmt: skip
    assert cli.main(argv) == 0
    summary = json.loads(output.read_text())
    assert summary["test_examples"] == 8 and 0 <= summary["test_accuracy"] <= 1


def test_lowmem_train_without_the_release_is_one_line_and_exit_2(tmp_path, capsys):
    argv = ["train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path), "--steps", "1"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "apt install dataset-fashion-mnist" in err[0]


def test_a_dtype_idx_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not int64"):
        fm.write_idx(str(tmp_path / "x"), np.zeros(3, np.int64))
