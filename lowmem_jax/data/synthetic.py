"""Synthetic translation tasks: ``copy`` and ``reverse`` of random token sequences.

Token conventions (shared by source and target vocabularies of size ``vocab_size``):

- ``PAD = 0`` (the models' default ``pad_id``), ``BOS = 1``, ``EOS = 2``;
- content tokens are drawn uniformly from ``[FIRST_TOKEN, vocab_size)`` with ``FIRST_TOKEN = 3``;
- an example of length ``L`` (uniform in ``[min_len, max_len]``) with content ``x_1 .. x_L`` and
  target content ``y`` (``y = x`` for ``copy``, ``y = x`` reversed for ``reverse``) is::

      src     = x_1 .. x_L  EOS  PAD ..      (fairseq convention: the source ends with EOS)
      tgt_in  = BOS  y_1 .. y_L  PAD ..      (decoder input: the target shifted right)
      tgt_out = y_1 .. y_L  EOS  PAD ..      (what the decoder predicts at each position)

  every row padded on the right to ``max_len + 1``, so all three arrays are ``[N, max_len + 1]``
  int32 and ``tgt_in[:, 1:]`` equals ``tgt_out[:, :-1]`` wherever ``tgt_out`` is not EOS/PAD.

Everything is NumPy and deterministic per ``seed``; nothing is downloaded.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "FIRST_TOKEN",
    "TASKS",
    "make_translation_task",
]

PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3
TASKS = ("copy", "reverse")


def make_translation_task(
    task: str,
    num_examples: int,
    *,
    vocab_size: int = 16,
    min_len: int = 1,
    max_len: int = 8,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Returns ``{"src", "tgt_in", "tgt_out"}``, each ``[num_examples, max_len + 1]`` int32.

    Raises:
      ValueError: for an unknown ``task`` (allowed: ``copy``, ``reverse``), ``num_examples < 1``,
        ``vocab_size <= FIRST_TOKEN`` or lengths outside ``1 <= min_len <= max_len``.
    """
    if task not in TASKS:
        raise ValueError(f"Unknown task={task!r}; allowed values: {list(TASKS)}")
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if vocab_size <= FIRST_TOKEN:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN} (PAD, BOS, EOS), got {vocab_size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_examples)
    content = rng.integers(FIRST_TOKEN, vocab_size, size=(num_examples, max_len))
    width = max_len + 1
    src = np.full((num_examples, width), PAD, np.int32)
    tgt_in = np.full((num_examples, width), PAD, np.int32)
    tgt_out = np.full((num_examples, width), PAD, np.int32)
    for i, n in enumerate(lengths):
        x = content[i, :n]
        y = x if task == "copy" else x[::-1]
        src[i, :n], src[i, n] = x, EOS
        tgt_in[i, 0], tgt_in[i, 1 : n + 1] = BOS, y
        tgt_out[i, :n], tgt_out[i, n] = y, EOS
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}
