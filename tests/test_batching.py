import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowmem_jax.data.token_batching import (
    TokenBatcher,
    TokenBudget,
    batch_by_tokens,
    pad_batch,
    round_up,
)
from lowmem_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID


def _corpus(n: int, max_len: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, 50, size=rng.integers(0, max_len + 1)).tolist() for _ in range(n)]
    tgt = [rng.integers(4, 50, size=rng.integers(0, max_len + 1)).tolist() for _ in range(n)]
    return src, tgt


def _check_row(batch, r, x, y):
    n, m = len(x), len(y)
    assert batch["src"][r, :n].tolist() == x and batch["src"][r, n] == EOS_ID
    assert (batch["src"][r, n + 1 :] == PAD_ID).all()
    assert batch["tgt_in"][r, 0] == BOS_ID and batch["tgt_in"][r, 1 : m + 1].tolist() == y
    assert (batch["tgt_in"][r, m + 1 :] == PAD_ID).all()
    assert batch["tgt_out"][r, :m].tolist() == y and batch["tgt_out"][r, m] == EOS_ID
    assert (batch["tgt_out"][r, m + 1 :] == PAD_ID).all()


def test_pad_batch_layout_and_bucketing():
    src, tgt = [[5, 6, 7], [8]], [[9], [10, 11, 12, 13]]
    batch = pad_batch(src, tgt, [0, 1])
    assert {k: v.shape for k, v in batch.items()} == {
        "src": (2, 4),
        "tgt_in": (2, 5),
        "tgt_out": (2, 5),
    }
    assert all(v.dtype == np.int32 for v in batch.values())
    assert batch["src"].tolist() == [[5, 6, 7, 2], [8, 2, 0, 0]]
    assert batch["tgt_in"].tolist() == [[1, 9, 0, 0, 0], [1, 10, 11, 12, 13]]
    assert batch["tgt_out"].tolist() == [[9, 2, 0, 0, 0], [10, 11, 12, 13, 2]]
    bucketed = pad_batch(src, tgt, [1, 0], length_multiple=8, batch_multiple=4)
    assert bucketed["src"].shape == (4, 8) and bucketed["tgt_in"].shape == (4, 8)
    assert (bucketed["src"][2:] == PAD_ID).all() and (bucketed["tgt_out"][2:] == PAD_ID).all()
    _check_row(bucketed, 0, [8], [10, 11, 12, 13])


def test_batches_follow_length_order_and_fill_the_budget():
    lengths = [3, 10, 5, 3, 7, 10, 2]
    batches = batch_by_tokens(lengths, lengths, TokenBudget(20), seed=None)
    assert [b.tolist() for b in batches] == [[6, 0, 3, 2], [4, 1], [5]]
    # [2, 3, 3, 5]: 4 * 5 = 20; then 7 and 10: 2 * 10 = 20; the last 10 alone
    with pytest.raises(ValueError, match="max_tokens=20"):
        batch_by_tokens([21], [1], TokenBudget(20))
    assert batch_by_tokens([21, 3], [1, 3], TokenBudget(20, skip_oversized=True))[0].tolist() == [1]
    capped = batch_by_tokens(lengths, lengths, TokenBudget(1000, max_batch_size=3), seed=None)
    assert [len(b) for b in capped] == [3, 3, 1]


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudget(max_tokens=0)
    with pytest.raises(ValueError, match="length_multiple"):
        TokenBudget(length_multiple=0)
    with pytest.raises(ValueError, match="src_lengths"):
        batch_by_tokens([1, 2], [1])
    with pytest.raises(ValueError, match="src and tgt"):
        TokenBatcher([[1]], [])


def test_epochs_reshuffle_batch_order_deterministically():
    src, tgt = _corpus(200, 30, seed=0)
    a = TokenBatcher(src, tgt, TokenBudget(128), seed=3)
    b = TokenBatcher(src, tgt, TokenBudget(128), seed=3)
    assert len(a) > 5
    assert [x.tolist() for x in a.batches] == [x.tolist() for x in b.batches]
    assert a.batch_order(0).tolist() == b.batch_order(0).tolist()
    assert a.batch_order(0).tolist() != a.batch_order(1).tolist()
    assert a.batch_order(0, shuffle=False).tolist() == list(range(len(a)))
    for x, y in zip(a.epoch(1), b.epoch(1), strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 60),
    max_len=st.integers(0, 20),
    max_tokens=st.integers(1, 200),
    length_multiple=st.sampled_from([1, 3, 8]),
    batch_multiple=st.sampled_from([1, 2, 4]),
    equal_lengths=st.booleans(),
    pad_to_budget=st.booleans(),
    seed=st.integers(0, 2**16),
    epoch=st.integers(0, 3),
)
def test_every_example_once_within_budget_correctly_padded(
    n, max_len, max_tokens, length_multiple, batch_multiple, equal_lengths, pad_to_budget, seed,
    epoch,
):  # fmt: skip
    src, tgt = _corpus(n, max_len, seed)
    width = round_up(max_len + 1, length_multiple) * batch_multiple
    max_tokens = max(max_tokens, width)  # the longest possible example fits alone
    budget = TokenBudget(max_tokens, length_multiple, batch_multiple)
    options = dict(seed=seed, equal_lengths=equal_lengths, pad_to_budget=pad_to_budget)
    batcher = TokenBatcher(src, tgt, budget, **options)
    order = batcher.batch_order(epoch)
    seen = np.concatenate([batcher.batches[b] for b in order])
    assert sorted(seen.tolist()) == list(range(n)) and batcher.num_examples == n
    for b, batch in zip(order, batcher.epoch(epoch), strict=True):
        idx = batcher.batches[b].tolist()
        rows, s = batch["src"].shape
        t = batch["tgt_in"].shape[1]
        assert batch["tgt_out"].shape == (rows, t)
        assert rows % batch_multiple == 0 and s % length_multiple == 0 and t % length_multiple == 0
        assert rows * max(s, t) <= max_tokens
        s_need = round_up(max(len(src[i]) for i in idx) + 1, length_multiple)
        t_need = round_up(max(len(tgt[i]) for i in idx) + 1, length_multiple)
        if equal_lengths:
            assert s == t == max(s_need, t_need)
        else:
            assert (s, t) == (s_need, t_need)
        if pad_to_budget:
            assert rows == max_tokens // max(s, t) // batch_multiple * batch_multiple
        else:
            assert rows == round_up(len(idx), batch_multiple)
        for r, i in enumerate(idx):
            _check_row(batch, r, src[i], tgt[i])
        for key in batch:
            assert (batch[key][len(idx) :] == PAD_ID).all()
    again = TokenBatcher(src, tgt, budget, **options)
    assert [x.tolist() for x in again.batches] == [x.tolist() for x in batcher.batches]
    assert again.batch_order(epoch).tolist() == order.tolist()


def test_padding_to_budget_bounds_the_number_of_shapes():
    src, tgt = _corpus(500, 60, seed=1)
    budget = TokenBudget(512, length_multiple=16, batch_multiple=2)
    batcher = TokenBatcher(src, tgt, budget, seed=0, equal_lengths=True, pad_to_budget=True)
    shapes = {batch["src"].shape for batch in batcher.epoch(0)}
    assert all(batch["tgt_in"].shape == batch["src"].shape for batch in batcher.epoch(0))
    assert 1 < len(shapes) and shapes <= {(512 // w // 2 * 2, w) for w in (16, 32, 48, 64)}
