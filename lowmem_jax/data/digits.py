"""The scikit-learn digits dataset as 32x32 images: real data that ships with a package.

1,797 handwritten digits (UCI ML hand-written digits test set), 8x8 pixels with values 0..16,
ten classes. Loaded from scikit-learn's bundled copy: nothing is downloaded.

Images are upsampled by pixel repetition to ``[image_size, image_size, 1]`` float32 (32 by
default: 4x, CIFAR's size; 8 keeps the original pixels and trains 16x cheaper), scaled to [0, 1] and
normalised with the training split's mean and standard deviation; or, with ``input_dtype="uint8"``,
kept as the raw pixel values 0..16 with those statistics in pixel units beside them (the model
normalises). The split is a stratified 80/20 train/test split, deterministic per ``seed``; or,
with ``fold``, the ``fold``-th test fold of a stratified ``folds``-fold partition shuffled by
``seed`` (cross-validation: over the folds every image is a test image once).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["load_digits", "iterate_batches"]


IMAGE_SIZES = (8, 16, 32)


def load_digits(
    seed: int = 0,
    test_fraction: float = 0.2,
    image_size: int = 32,
    *,
    input_dtype: str = "float32",
    fold: int | None = None,
    folds: int = 5,
) -> dict[str, Any]:
    """Returns ``{"train": {"image", "label"}, "test": {...}, "pixel_mean", "pixel_std"}``.

    ``image``: ``[N, image_size, image_size, 1]``, float32 normalised, or uint8 pixel values
    0..16 (``input_dtype="uint8"``); ``label``: int32 ``[N]``. ``pixel_mean`` / ``pixel_std``:
    the training split's statistics in pixel units (1-tuples), which normalise the uint8 images
    as the float32 ones are. ``fold`` (in ``[0, folds)``) replaces the ``test_fraction`` split by
    a stratified K-fold one (``test_fraction`` is then unused).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"image_size must be one of {list(IMAGE_SIZES)}, got {image_size}")
    if input_dtype not in ("float32", "uint8"):
        raise ValueError(f"input_dtype must be 'float32' or 'uint8', got {input_dtype!r}")
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    if fold is not None and not 0 <= fold < folds:
        raise ValueError(f"fold must be in [0, {folds}) or None, got {fold}")
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import StratifiedKFold, train_test_split

    digits = sk_load_digits()
    factor = image_size // 8
    pixels = digits.images.astype(np.uint8)  # [N, 8, 8], values 0..16
    pixels = pixels.repeat(factor, axis=1).repeat(factor, axis=2)[..., None]  # [N, S, S, 1]
    labels = digits.target.astype(np.int32)
    if fold is None:
        train, test = train_test_split(
            np.arange(len(labels)), test_size=test_fraction, random_state=seed, stratify=labels
        )
    else:
        splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        train, test = list(splitter.split(pixels, labels))[fold]
    scaled = pixels[train].astype(np.float32) / 16.0
    mean, std = scaled.mean(), scaled.std()

    def images(idx: np.ndarray) -> np.ndarray:
        if input_dtype == "uint8":
            return pixels[idx]
        return (pixels[idx].astype(np.float32) / 16.0 - mean) / std

    return {
        "train": {"image": images(train), "label": labels[train]},
        "test": {"image": images(test), "label": labels[test]},
        "pixel_mean": (16.0 * float(mean),),
        "pixel_std": (16.0 * float(std),),
    }


def iterate_batches(
    split: dict[str, np.ndarray],
    batch_size: int,
    *,
    seed: int | None = None,
    drop_remainder: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields batches of ``batch_size`` rows of every array of ``split``.

    ``split`` maps names to arrays sharing their leading axis (images and labels; src, tgt_in
    and tgt_out). Rows are shuffled per ``seed`` when it is not None. With ``drop_remainder``
    every batch has the same shape, so a jitted step compiles once.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(next(iter(split.values())))
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield {k: v[idx] for k, v in split.items()}
