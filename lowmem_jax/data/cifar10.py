"""CIFAR-10 through tensorflow-datasets, as NumPy arrays for JAX, with the WRN augmentation.

Reading uses ``tfds.data_source`` (random-access ArrayRecord files; TensorFlow is not needed to
read). Nothing is downloaded here: the data must have been prepared once (docs/datasets.md).

* images: float32 ``[N, 32, 32, 3]``, scaled to [0, 1] and normalised per channel with the
  CIFAR-10 training mean and standard deviation (or uint8 raw pixels, ``input_dtype``);
* labels: int32 ``[N]``;
* training augmentation (per batch, deterministic per seed): 4-pixel reflect padding, a random
  32x32 crop, and a horizontal flip with probability 1/2, as in the WRN/DSR reference code.
"""

from __future__ import annotations

import numpy as np

__all__ = ["load_cifar10", "augment", "MEAN", "STD", "PIXEL_MEAN", "PIXEL_STD"]

_MEAN, _STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MEAN, STD = np.array(_MEAN, np.float32), np.array(_STD, np.float32)
# The same in pixel units (0..255), for uint8 batches the model normalises.
PIXEL_MEAN = tuple(round(255 * m, 6) for m in _MEAN)
PIXEL_STD = tuple(round(255 * s, 6) for s in _STD)


def load_cifar10(
    split: str, data_dir: str | None = None, input_dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Loads a CIFAR-10 split (``"train"`` / ``"test"``) into memory: images float32
    normalised, or with ``input_dtype="uint8"`` the raw pixels (normalise with
    :data:`PIXEL_MEAN` / :data:`PIXEL_STD`).

    Raises:
      FileNotFoundError: if the dataset has not been prepared in ``data_dir`` (or TFDS's
        default directory); the message says how to prepare it.
    """
    if input_dtype not in ("float32", "uint8"):
        raise ValueError(f"input_dtype must be 'float32' or 'uint8', got {input_dtype!r}")
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source("cifar10", split=split, data_dir=data_dir, download=False)
    except Exception as err:  # TFDS raises several types for "not prepared"
        raise FileNotFoundError(
            f"CIFAR-10 is not prepared in data_dir={data_dir or '~/tensorflow_datasets'} ({err}). "
            'Prepare it once with: pip install tensorflow-cpu && python -c "import '
            "tensorflow_datasets as tfds; tfds.builder('cifar10', file_format='array_record')"
            '.download_and_prepare()"'
        ) from err
    n = len(source)
    images = np.empty((n, 32, 32, 3), np.uint8)
    labels = np.empty((n,), np.int32)
    for i in range(n):
        example = source[i]
        images[i], labels[i] = example["image"], example["label"]
    return {"image": images if input_dtype == "uint8" else normalize(images), "label": labels}


def normalize(images_uint8: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 3]`` -> float32, per-channel standardised."""
    return (images_uint8.astype(np.float32) / 255.0 - MEAN) / STD


def augment(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """Reflect-pads by ``pad``, crops back to the input size at random, flips half horizontally.

    ``images``: ``[B, H, W, C]``; returns a new array of the same shape and dtype.
    """
    b, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    dy = rng.integers(0, 2 * pad + 1, size=b)
    dx = rng.integers(0, 2 * pad + 1, size=b)
    flip = rng.random(b) < 0.5
    out = np.empty_like(images)
    for i in range(b):
        crop = padded[i, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        out[i] = crop[:, ::-1] if flip[i] else crop
    return out
