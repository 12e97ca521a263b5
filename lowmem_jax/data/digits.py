"""The scikit-learn digits dataset as 32x32 images: real data that ships with a package.

1,797 handwritten digits (UCI ML hand-written digits test set), 8x8 pixels with values 0..16,
ten classes. Loaded from scikit-learn's bundled copy: nothing is downloaded.

Images are upsampled by pixel repetition to ``[image_size, image_size, 1]`` float32 (32 by
default: 4x, CIFAR's size; 8 keeps the original pixels and trains 16x cheaper), scaled to [0, 1] and
normalised with the training split's mean and standard deviation. The split is a stratified
80/20 train/test split, deterministic per ``seed``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["load_digits", "iterate_batches"]


IMAGE_SIZES = (8, 16, 32)


def load_digits(
    seed: int = 0, test_fraction: float = 0.2, image_size: int = 32
) -> dict[str, dict[str, np.ndarray]]:
    """Returns ``{"train": {"image", "label"}, "test": {...}}`` as NumPy arrays.

    ``image``: float32 ``[N, image_size, image_size, 1]``; ``label``: int32 ``[N]``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"image_size must be one of {list(IMAGE_SIZES)}, got {image_size}")
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
    images = digits.images.astype(np.float32) / 16.0  # [N, 8, 8]
    factor = image_size // 8
    images = images.repeat(factor, axis=1).repeat(factor, axis=2)[..., None]  # [N, S, S, 1]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    mean, std = x_train.mean(), x_train.std()
    return {
        "train": {"image": (x_train - mean) / std, "label": y_train},
        "test": {"image": (x_test - mean) / std, "label": y_test},
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
