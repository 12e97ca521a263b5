"""Block-wise and rank-1 quantization against their definitions (lowmem_jax.codecs.quantization)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowmem_jax.codecs import quantization as q

# The property tests' quantize and dequantize jitted: one program per shape, not one per
# operation and shape (what the optimizer step runs is jitted too).
_quantize = jax.jit(q.quantize, static_argnums=(1, 2), static_argnames=("block_size", "rank1"))
_dequantize = jax.jit(q.dequantize)


def test_dynamic_map_is_bitsandbytes_create_dynamic_map():
    signed, unsigned = q.dynamic_map(True), q.dynamic_map(False)
    for book in (signed, unsigned):
        assert book.shape == (256,) and len(np.unique(book)) == 256
        assert np.all(np.diff(book) > 0) and 0.0 in book and book[-1] == 1.0
    assert unsigned.min() == 0.0 and signed.min() == pytest.approx(-0.99296875)
    # Exponent e spends 2**e (signed) / 2**(e+1) (unsigned) midpoints of linspace(0.1, 1) on
    # [0.1, 1] * 10**(e - 6): the smallest non-zero magnitude is 0.55e-6 / 0.325e-6.
    assert signed[signed > 0].min() == pytest.approx(0.55e-6)
    assert unsigned[unsigned > 0].min() == pytest.approx(0.325e-6)
    for e in range(7):
        lo, hi = 0.1 * 10.0 ** (e - 6), 10.0 ** (e - 6)
        assert ((signed > lo) & (signed < hi)).sum() == 2**e
        assert ((unsigned > lo) & (unsigned < hi)).sum() == 2 ** (e + 1)
    four = q.dynamic_map(True, total_bits=4)
    np.testing.assert_allclose(
        four[four > 0], [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0], rtol=1e-6
    )
    np.testing.assert_array_equal(q.linear_map(4), np.arange(1, 17) / 16)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        q.code_book("dynamic", 3)
    with pytest.raises(ValueError, match="allowed values"):
        q.code_book("nf4", 4)


def _neighbours(book, v):
    """The codes just below and above each normalized value (clipped to the book's range)."""
    hi = np.clip(np.searchsorted(book, v), 1, len(book) - 1)
    return book[hi - 1], book[hi]


def _check_blockwise(x, book_name, bits, block_size):
    qx = _quantize(jnp.asarray(x), book_name, bits, block_size=block_size)
    book = q.code_book(book_name, bits)
    n = x.size
    nb = -(-n // block_size)
    blocks = np.pad(x.reshape(-1), (0, nb * block_size - n)).reshape(nb, block_size)
    np.testing.assert_array_equal(np.asarray(qx.scales), np.abs(blocks).max(axis=1))
    assert qx.codes.dtype == jnp.uint8
    assert qx.codes.shape == ((nb * block_size) // (8 // bits),)
    y = np.asarray(_dequantize(qx))
    assert y.shape == x.shape
    s = np.repeat(np.asarray(qx.scales), block_size)[:n]
    v = np.where(s > 0, x.reshape(-1) / np.where(s > 0, s, 1), 0)
    lo, hi = _neighbours(book, v)
    # Nearest rounding: within half the gap between the two codes around x / absmax.
    bound = (hi - lo) / 2 * s + 1e-6 * np.abs(x.reshape(-1)) + 1e-12
    assert np.all(np.abs(y.reshape(-1) - x.reshape(-1)) <= bound)
    # The absmax element of every non-zero block is exact (code +-1 or 1).
    for b in range(nb):
        if blocks[b].any():
            i = b * block_size + np.argmax(np.abs(blocks[b]))
            if i < n and x.reshape(-1)[i] > 0:
                assert y.reshape(-1)[i] == pytest.approx(x.reshape(-1)[i], rel=1e-6)
    return qx, y


@pytest.mark.parametrize(
    "book_name,bits,block_size", [("dynamic", 8, 2048), ("dynamic", 8, 64), ("dynamic", 4, 128)]
)
def test_blockwise_round_trip_on_normal_heavy_tailed_and_zero_blocks(book_name, bits, block_size):
    rng = np.random.default_rng(0)
    normal = rng.normal(size=(37, 91)).astype(np.float32)
    heavy = rng.standard_cauchy(size=(5000,)).astype(np.float32)
    zeros = np.zeros((3 * block_size + 5,), np.float32)
    for x in (normal, heavy, zeros):
        qx, y = _check_blockwise(x, book_name, bits, block_size)
    assert not y.any() and not np.asarray(qx.scales).any()  # all-zero blocks decode to zeros
    # A block of zeros among non-zero blocks has scale 0 and decodes to 0.
    mixed = np.concatenate([normal.reshape(-1)[:block_size], zeros[:block_size]])
    qx, y = _check_blockwise(mixed, book_name, bits, block_size)
    assert not y[block_size:].any()


def test_unsigned_map_for_non_negative_values_is_finer_than_signed():
    x = np.random.default_rng(1).exponential(size=(4096,)).astype(np.float32) ** 2
    err = {}
    for name in ("dynamic", "dynamic_unsigned"):
        _, y = _check_blockwise(x, name, 8, 2048)
        err[name] = np.abs(y - x).mean()
    assert err["dynamic_unsigned"] < 0.75 * err["dynamic"]


@settings(max_examples=6, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    block_size=st.sampled_from([2, 6, 64, 128]),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_blockwise_any_shape_not_divisible_by_the_block(shape, block_size, bits, seed):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 10.0 ** (seed % 7 - 3)
    _check_blockwise(x, "dynamic", bits, block_size)


@settings(max_examples=5, deadline=None)
@given(
    shape=st.lists(st.integers(1, 30), min_size=2, max_size=4).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_rank1_scales_are_per_axis_maxima_and_bound_every_element(shape, seed):
    x = np.random.default_rng(seed).exponential(size=shape).astype(np.float32) ** 2
    x[tuple(0 for _ in shape)] = 0.0  # an exact zero: the zero-free map rounds it up
    qx = _quantize(jnp.asarray(x), "linear", 4, rank1=True)
    assert qx.meta.block_size == 0 and len(qx.scales) == len(shape)
    for axis, m in enumerate(qx.scales):
        others = tuple(a for a in range(x.ndim) if a != axis)
        np.testing.assert_array_equal(np.asarray(m), x.max(axis=others))
    s = np.ones(shape, np.float32) * np.inf
    for axis, m in enumerate(qx.scales):
        view = [1] * x.ndim
        view[axis] = shape[axis]
        s = np.minimum(s, np.asarray(m).reshape(view))
    assert np.all(x <= s)
    y = np.asarray(_dequantize(qx))
    assert qx.codes.shape == (-(-x.size // 2),)  # two 4-bit codes a byte
    # Zero-free linear map: every value decodes to between s/16 and s, within s/32 of x.
    assert np.all(y >= s / 16 * (1 - 1e-6)) and np.all(y <= s * (1 + 1e-6))
    assert np.all(np.abs(y - np.maximum(x, s / 16)) <= s / 32 * (1 + 1e-5) + 1e-30)


def test_rank1_falls_back_to_blocks_for_vectors():
    x = jnp.abs(jax.random.normal(jax.random.PRNGKey(0), (300,)))
    qx = q.quantize(x, "linear", 4, rank1=True, block_size=128)
    assert qx.meta.block_size == 128 and qx.scales.shape == (3,)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbouring_code():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(256,)), jnp.float32)
    book = q.code_book("dynamic", 4)

    def draw(key):
        return q.dequantize(q.quantize(x, "dynamic", 4, block_size=256, key=key))

    samples = np.asarray(jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(0), 400)))
    s = float(np.abs(x).max())
    v = np.asarray(x) / s
    lo, hi = _neighbours(book, v)
    on_a_neighbour = np.isclose(samples, lo * s, atol=1e-6) | np.isclose(samples, hi * s, atol=1e-6)
    assert on_a_neighbour.all()
    # Inside the book's range the mean of 400 draws is within 4 standard errors of x
    # (Bernoulli between the neighbours); below its lowest code (-0.8875) it saturates.
    inside = (v >= book[0]) & (v <= book[-1])
    p = np.clip((v - lo) / (hi - lo), 0, 1)
    stderr = (hi - lo) * s * np.sqrt(p * (1 - p) / 400) + 1e-6
    assert inside.sum() > 200
    assert np.all(np.abs(samples.mean(0) - np.asarray(x))[inside] <= 4 * stderr[inside])
    assert np.all(samples[:, ~inside] == pytest.approx(book[0] * s))


@settings(max_examples=8, deadline=None)
@given(
    shape=st.lists(st.integers(1, 24), min_size=1, max_size=3).map(tuple),
    book=st.sampled_from(["dynamic", "dynamic_unsigned", "linear"]),
    bits=st.sampled_from([4, 8]),
    rank1=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_zero_where_resets_only_the_elements_not_kept(shape, book, bits, rank1, seed):
    """Kept elements decode as before; the others to the book's least magnitude times their
    scale (0 in the dynamic maps), whatever the packing (two 4-bit codes a byte) and padding."""
    if book == "linear" and bits == 8:
        bits = 4  # the zero-free map is the 4-bit second moments'
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32)
    if book != "dynamic":
        x = np.abs(x)
    keep = rng.random(shape) < 0.5
    qx = _quantize(jnp.asarray(x), book, bits, block_size=8, rank1=rank1)
    before = np.asarray(_dequantize(qx))
    after = np.asarray(_dequantize(q.zero_where(qx, jnp.asarray(keep))))
    np.testing.assert_array_equal(after[keep], before[keep])
    least = np.abs(q.code_book(book, bits)).min()
    ones = _dequantize(qx._replace(codes=jnp.full_like(qx.codes, 0xFF)))
    scale = np.asarray(ones) / q.code_book(book, bits).max()  # each element's scale
    np.testing.assert_allclose(after[~keep], least * scale[~keep], rtol=1e-6)
    if book != "linear":
        assert not after[~keep].any()


def test_quantize_validates_and_counts_bytes():
    x = jnp.ones((1000,))
    with pytest.raises(ValueError, match="block_size"):
        q.quantize(x, block_size=3)
    assert q.quantized_nbytes(q.quantize(x, block_size=256)) == 1024 + 4 * 4
    assert q.quantized_nbytes(q.quantize(x, "dynamic", 4, block_size=128)) == 512 + 8 * 4
