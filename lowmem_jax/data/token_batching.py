"""Token-budget batching for translation, as fairseq's ``--max-tokens`` does.

Examples are pairs of token-id sequences without specials (``Tokenizer.encode`` output). A batch
of ``B`` examples becomes three int32 arrays, padded on the right with ``PAD_ID = 0`` (the same
layout as ``synthetic.py``)::

    src     [B, S] = x_1 .. x_n  EOS  PAD ..   (fairseq: the source ends with EOS)
    tgt_in  [B, T] = BOS  y_1 .. y_m  PAD ..   (decoder input)
    tgt_out [B, T] = y_1 .. y_m  EOS  PAD ..   (prediction targets)

so an example's lengths are ``n + 1`` and ``m + 1``. Batching (fairseq ``batch_by_size``):

1. order: a seeded random permutation, then a stable sort by target length and a stable sort by
   source length (so equal lengths are in seeded random order);
2. greedy grouping along that order: an example joins the current batch while the batch's padded
   size ``B_pad * max(S, T)`` stays ``<= max_tokens`` (and ``B <= max_batch_size`` if given);
3. batches are fixed once (as fairseq's are); each epoch visits them in an order shuffled with
   ``(seed, epoch)``.

Shapes for ``jit``: ``length_multiple=m`` rounds ``S`` and ``T`` up to multiples of ``m``;
``batch_multiple=k`` pads ``B`` up to a multiple of ``k`` with all-PAD rows (for ``k``
microbatches). The budget is checked on the padded sizes, so every emitted array satisfies
``B * max(S, T) <= max_tokens``. ``B`` still varies from batch to batch; to bound the number of
compiled shapes, also pass ``pad_to_budget=True`` (``B`` becomes the most rows of width
``max(S, T)`` that fit the budget, so the shape depends on ``(S, T)`` only) and, optionally,
``equal_lengths=True`` (``S = T = max(S, T)``): then there is one shape per length bucket,
at most ``ceil(longest / m)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from lowmem_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

__all__ = ["TokenBatcher", "TokenBudget", "batch_by_tokens", "pad_batch", "round_up"]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def _check_positive(**kwargs: int | None) -> None:
    for name, value in kwargs.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """How examples group into batches (module docstring); checked on construction.

    Attributes:
      max_tokens: padded tokens per batch, ``B * max(S, T)``, at most.
      length_multiple: ``S`` and ``T`` rounded up to a multiple of it.
      batch_multiple: ``B`` padded up to a multiple of it (the microbatch count).
      max_batch_size: examples per batch, at most (``None``: no limit).
      skip_oversized: drop an example that alone exceeds ``max_tokens`` (else an error).

    Raises:
      ValueError: a count below 1, naming it.
    """

    max_tokens: int = 4000
    length_multiple: int = 1
    batch_multiple: int = 1
    max_batch_size: int | None = None
    skip_oversized: bool = False

    def __post_init__(self) -> None:
        _check_positive(
            max_tokens=self.max_tokens,
            length_multiple=self.length_multiple,
            batch_multiple=self.batch_multiple,
            max_batch_size=self.max_batch_size,
        )


def batch_by_tokens(
    src_lengths: Sequence[int] | np.ndarray,
    tgt_lengths: Sequence[int] | np.ndarray,
    budget: TokenBudget = TokenBudget(),
    *,
    seed: int | None = 0,
) -> list[np.ndarray]:
    """Groups example indices into batches within ``budget`` (see module docstring).

    ``src_lengths`` / ``tgt_lengths`` are the padded-array lengths of each example (EOS / BOS
    included). Returns int64 index arrays in length order; ``seed=None`` breaks length ties by
    index instead of at random.

    Raises:
      ValueError: for mismatched lengths, or an example that alone exceeds ``max_tokens``
        (unless ``budget.skip_oversized``, which drops such examples).
    """
    max_tokens, length_multiple, batch_multiple, max_batch_size, skip_oversized = (
        dataclasses.astuple(budget)
    )
    src_len = np.asarray(src_lengths, np.int64)
    tgt_len = np.asarray(tgt_lengths, np.int64)
    if src_len.shape != tgt_len.shape or src_len.ndim != 1:
        raise ValueError(
            f"src_lengths and tgt_lengths must be 1-D of equal size, got {src_len.shape} "
            f"and {tgt_len.shape}"
        )
    n = len(src_len)
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    order = order[np.argsort(tgt_len[order], kind="stable")]
    order = order[np.argsort(src_len[order], kind="stable")]
    width = np.maximum(src_len, tgt_len)

    def cost(rows: int, max_width: int) -> int:
        return round_up(rows, batch_multiple) * round_up(max_width, length_multiple)

    batches: list[np.ndarray] = []
    current: list[int] = []
    current_max = 0
    for i in order.tolist():
        w = int(width[i])
        if cost(1, w) > max_tokens:
            if skip_oversized:
                continue
            raise ValueError(
                f"example {i} (source length {src_len[i]}, target length {tgt_len[i]}, EOS/BOS "
                f"included) alone exceeds max_tokens={max_tokens} with "
                f"length_multiple={length_multiple}, batch_multiple={batch_multiple}; raise "
                "max_tokens, filter long examples or pass skip_oversized=True"
            )
        new_max = max(current_max, w)
        too_many = max_batch_size is not None and len(current) + 1 > max_batch_size
        if current and (too_many or cost(len(current) + 1, new_max) > max_tokens):
            batches.append(np.asarray(current, np.int64))
            current, new_max = [], w
        current.append(i)
        current_max = new_max
    if current:
        batches.append(np.asarray(current, np.int64))
    return batches


def pad_batch(
    src: Sequence[Sequence[int]],
    tgt: Sequence[Sequence[int]],
    indices: Sequence[int] | np.ndarray,
    *,
    length_multiple: int = 1,
    batch_multiple: int = 1,
    equal_lengths: bool = False,
    max_tokens: int | None = None,
) -> dict[str, np.ndarray]:
    """Builds ``{"src" [B, S], "tgt_in" [B, T], "tgt_out" [B, T]}`` int32 for ``indices``.

    ``B`` is ``len(indices)`` rounded up to ``batch_multiple`` (extra rows are all PAD); ``S`` /
    ``T`` are the longest source / target plus one, rounded up to ``length_multiple``, and both
    ``max(S, T)`` with ``equal_lengths``. If ``max_tokens`` is given, ``B`` is raised to the most
    rows that fit it, ``max_tokens // max(S, T)`` rounded down to a multiple of ``batch_multiple``.
    """
    _check_positive(
        length_multiple=length_multiple, batch_multiple=batch_multiple, max_tokens=max_tokens
    )
    rows = [(src[i], tgt[i]) for i in indices]
    b = round_up(max(len(rows), 1), batch_multiple)
    s = round_up(max((len(x) for x, _ in rows), default=0) + 1, length_multiple)
    t = round_up(max((len(y) for _, y in rows), default=0) + 1, length_multiple)
    if equal_lengths:
        s = t = max(s, t)
    if max_tokens is not None:
        b = max(b, max_tokens // max(s, t) // batch_multiple * batch_multiple)
    out_src = np.full((b, s), PAD_ID, np.int32)
    tgt_in = np.full((b, t), PAD_ID, np.int32)
    tgt_out = np.full((b, t), PAD_ID, np.int32)
    for r, (x, y) in enumerate(rows):
        n, m = len(x), len(y)
        out_src[r, :n], out_src[r, n] = x, EOS_ID
        tgt_in[r, 0], tgt_in[r, 1 : m + 1] = BOS_ID, y
        tgt_out[r, :m], tgt_out[r, m] = y, EOS_ID
    return {"src": out_src, "tgt_in": tgt_in, "tgt_out": tgt_out}


class TokenBatcher:
    """Fixed token-budget batches of ``(src, tgt)`` id sequences, reshuffled per epoch.

    ``src[i]`` / ``tgt[i]``: token ids of example ``i`` without BOS/EOS (``Tokenizer.encode``).
    ``batches`` holds the index arrays (length order); iterate an epoch with :meth:`epoch`.
    ``budget`` and ``seed`` as :func:`batch_by_tokens`, ``equal_lengths`` as :func:`pad_batch`;
    ``pad_to_budget=True`` pads every batch's ``B`` up to what ``max_tokens`` allows for its
    width.

    Raises:
      ValueError: if ``src`` and ``tgt`` differ in size or :func:`batch_by_tokens` rejects them.
    """

    def __init__(
        self,
        src: Sequence[Sequence[int]],
        tgt: Sequence[Sequence[int]],
        budget: TokenBudget = TokenBudget(),
        *,
        seed: int | None = 0,
        equal_lengths: bool = False,
        pad_to_budget: bool = False,
    ) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"src and tgt must have equal sizes, got {len(src)} and {len(tgt)}")
        self.src, self.tgt, self.budget = src, tgt, budget
        self.seed, self.equal_lengths, self.pad_to_budget = seed, equal_lengths, pad_to_budget
        self.batches = batch_by_tokens(
            [len(x) + 1 for x in src], [len(y) + 1 for y in tgt], budget, seed=seed
        )
        self.num_examples = sum(len(b) for b in self.batches)

    def __len__(self) -> int:
        """Number of batches per epoch."""
        return len(self.batches)

    def batch_order(self, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
        """The order of :attr:`batches` in ``epoch``: shuffled per ``(seed, epoch)`` or fixed."""
        if not shuffle or self.seed is None:
            return np.arange(len(self.batches))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.batches))

    def epoch(self, epoch: int = 0, shuffle: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Yields the padded batches of one epoch (see :func:`pad_batch` for the arrays)."""
        for b in self.batch_order(epoch, shuffle):
            yield self.padded(self.batches[b])

    def padded(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The examples ``indices`` as one padded batch (:func:`pad_batch`)."""
        return pad_batch(
            self.src,
            self.tgt,
            indices,
            length_multiple=self.budget.length_multiple,
            batch_multiple=self.budget.batch_multiple,
            equal_lengths=self.equal_lengths,
            max_tokens=self.budget.max_tokens if self.pad_to_budget else None,
        )
