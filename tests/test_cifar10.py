import numpy as np
import pytest
import tensorflow_datasets as tfds

from lowmem_jax.compose.plan import Plan
from lowmem_jax.data.cifar10 import MEAN, STD, augment, load_cifar10
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate


def test_loads_normalised_arrays_from_tfds():
    with tfds.testing.mock_data(num_examples=12):
        split = load_cifar10("train")
    assert split["image"].shape == (12, 32, 32, 3) and split["image"].dtype == np.float32
    assert split["label"].dtype == np.int32 and split["label"].shape == (12,)
    assert split["image"].min() >= -MEAN.max() / STD.min() - 1e-5
    assert split["image"].max() <= (1 - MEAN.min()) / STD.min() + 1e-5


def test_uint8_pixels_normalise_with_the_pixel_statistics_to_the_float_images():
    from lowmem_jax.data.cifar10 import PIXEL_MEAN, PIXEL_STD, normalize

    with tfds.testing.mock_data(num_examples=12):
        raw = load_cifar10("train", input_dtype="uint8")
    assert raw["image"].dtype == np.uint8 and raw["image"].shape == (12, 32, 32, 3)
    x = (raw["image"].astype(np.float32) - np.array(PIXEL_MEAN)) / np.array(PIXEL_STD)
    np.testing.assert_allclose(x, normalize(raw["image"]), rtol=1e-5, atol=1e-5)  # the float path
    with pytest.raises(ValueError, match="input_dtype"):
        load_cifar10("train", input_dtype="int8")


def test_missing_data_is_an_error_that_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_and_prepare"):
        load_cifar10("train", data_dir=str(tmp_path))


def test_augment_is_a_reflect_pad_crop_and_flip_deterministic_per_seed():
    images = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype(np.float32)
    a = augment(images, np.random.default_rng(1))
    b = augment(images, np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)
    assert a.shape == images.shape and not np.array_equal(a, images)
    # pad 0: only flips remain, each image equals itself or its mirror
    flipped = augment(images, np.random.default_rng(2), pad=0)
    for x, y in zip(images, flipped, strict=True):
        assert np.array_equal(y, x) or np.array_equal(y, x[:, ::-1])


@pytest.mark.slow
def test_train_on_cifar10_end_to_end_with_mock_data():
    config = TrainConfig(
        model="wrn-10-1", dataset="cifar10", plan=Plan(microbatches=2), batch_size=8, epochs=1,
        lr_schedule="step", progress=False,
    )  # fmt: skip
    with tfds.testing.mock_data(num_examples=16):
        summary = train_and_evaluate(config, log=None)
    assert summary["steps"] == 2 and 0.0 <= summary["test_accuracy"] <= 1.0
