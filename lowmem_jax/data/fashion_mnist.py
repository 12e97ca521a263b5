"""Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017) read from its IDX files; nothing is downloaded.

70,000 grayscale 28x28 images of 10 kinds of clothing: 60,000 for training, 10,000 for test,
in the four files of the original release (gzipped or not)::

    train-images-idx3-ubyte(.gz)  train-labels-idx1-ubyte(.gz)
    t10k-images-idx3-ubyte(.gz)   t10k-labels-idx1-ubyte(.gz)

Debian's package ``dataset-fashion-mnist`` (``apt install dataset-fashion-mnist``) puts them in
:data:`DEFAULT_DIR`, the default ``data_dir``. Unlike the 8x8 digits, the task is not
saturated (a small CNN reaches about 90-93%), so it can tell training plans apart.

An IDX file is a big-endian header (two zero bytes, a type code, the number of dimensions,
then each dimension as an int32) followed by the values in row-major order.
"""

from __future__ import annotations

import gzip
import os
from typing import Any

import numpy as np

__all__ = ["DEFAULT_DIR", "FILES", "read_idx", "write_idx", "load_fashion_mnist"]

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {  # split -> (images, labels), without the optional .gz
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX type codes and the big-endian dtypes they hold.
_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """The array in the IDX file ``path`` (gzipped when it ends in ``.gz``), native byte order.

    Raises:
      ValueError: not an IDX file (header, type code or size wrong), naming the file.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _TYPES:
        raise ValueError(f"{path} is not an IDX file (header {raw[:4]!r})")
    ndim, body = raw[3], 4 + 4 * raw[3]
    if len(raw) < body:
        raise ValueError(f"{path} ends inside its IDX header ({len(raw)} of {body} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_TYPES[raw[2]])
    if len(raw) - body != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(
            f"{path} holds {len(raw) - body} bytes of values; its header says {shape} of {dtype}"
        )
    return np.frombuffer(raw, dtype, offset=body).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str, array: np.ndarray) -> None:
    """Writes ``array`` as an IDX file (gzipped when ``path`` ends in ``.gz``).

    Raises:
      ValueError: a dtype IDX has no code for (it holds u1, i1, i2, i4, f4 and f8).
    """
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _TYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"IDX holds {sorted(map(str, codes))}, not {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    data = header + np.ascontiguousarray(array, _TYPES[code]).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(data)


def _find(data_dir: str, name: str) -> str:
    for candidate in (name + ".gz", name):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"Fashion-MNIST's {name}(.gz) is not in data_dir={data_dir}: install Debian's package "
        f"with `apt install dataset-fashion-mnist` (it fills {DEFAULT_DIR}) or pass a data_dir "
        f"holding the four IDX files of the release"
    )


def _split(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = FILES[split]
    images = read_idx(_find(data_dir, images_name))
    labels = read_idx(_find(data_dir, labels_name))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(
            f"Fashion-MNIST {split}: images {images.shape} and labels {labels.shape} do not "
            "pair up (expected [N, H, W] and [N])"
        )
    return images.astype(np.uint8), labels.astype(np.int32)


def load_fashion_mnist(
    data_dir: str | None = None, *, input_dtype: str = "float32"
) -> dict[str, Any]:
    """Returns ``{"train": {"image", "label"}, "test": {...}, "pixel_mean", "pixel_std"}`` (the
    layout of :func:`lowmem_jax.data.load_digits`).

    ``image``: ``[N, 28, 28, 1]``, float32 standardised with the training split's mean and
    standard deviation, or the raw uint8 pixels (``input_dtype="uint8"``); ``label``: int32
    ``[N]`` in ``[0, 10)``. ``pixel_mean`` / ``pixel_std``: the training statistics in pixel
    units (1-tuples), which normalise uint8 batches inside the step.

    Raises:
      FileNotFoundError: a file is missing; the message names the Debian package.
      ValueError: an unknown ``input_dtype``, or files that are not Fashion-MNIST's IDX files.
    """
    if input_dtype not in ("float32", "uint8"):
        raise ValueError(f"input_dtype must be 'float32' or 'uint8', got {input_dtype!r}")
    data_dir = os.path.expanduser(data_dir or DEFAULT_DIR)
    splits = {name: _split(data_dir, name) for name in FILES}
    train_pixels = splits["train"][0]
    mean, std = float(train_pixels.mean()), float(train_pixels.std()) or 1.0
    out: dict[str, Any] = {"pixel_mean": (mean,), "pixel_std": (std,)}
    for name, (images, labels) in splits.items():
        images = images[..., None]
        if input_dtype == "float32":
            images = ((images.astype(np.float32) - mean) / std).astype(np.float32)
        out[name] = {"image": images, "label": labels}
    return out
