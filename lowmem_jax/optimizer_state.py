"""The optimizer state's stored format: float32 arithmetic, 16-, 8- or 4-bit storage.

:func:`quantized_state` wraps any optimizer (an optax transformation, or an
:class:`lowmem_jax.base.Optimizer` such as sparse training) so that its state is *stored* in a
chosen format and every update runs in float32::

    inner = decode(state.inner_state)                  float32, as the inner optimizer made it
    updates, inner = inner_opt.update(f32(grads), inner, f32(params))
    return cast(updates, params' dtypes), QuantizedState(encode(inner))

Formats (``format``), per floating leaf of the inner state:

============  =================================================================================
``auto``      float32 slots for float32 parameters; bfloat16 for 16-bit parameters (the
              technical report's all-16-bit count; float16 would flush Adam's second moment,
              ``g**2 < 6e-8``, to zero); the arithmetic is float32
``fp32``      float32
``bf16``      bfloat16
``int8``      block-wise dynamic quantization (Dettmers et al., 2022): blocks of 2048, a float32
              absmax per block, the signed dynamic map for first moments and the unsigned one
              for second moments (:mod:`lowmem_jax.quantization`)
``int4``      Li, Chen, Zhu (2023): first moments block-wise (blocks of 128, 4-bit signed
              dynamic map); second moments rank-1 normalized with the zero-free linear map
============  =================================================================================

Leaves with fewer than ``min_size`` elements (4096, as bitsandbytes) are stored in float32 by
every format but ``auto``; non-floating leaves (step counts, masks, indices) as they are. A leaf
is a *second moment* when its path in the state names one of ``second_moments`` (Adam's ``nu``,
Adagrad's ``sum_of_squares``). The state's structure and dtypes never change between steps, so
it can be donated, checkpointed and selected leafwise (a skipped step keeps the old state).

Wrapping a sparse optimizer quantizes the compressed values' slots; its reset of the slots of
regrown weights runs on the float32 state, so it carries over to the quantized state (with the
zero-free map, a reset second moment decodes to the smallest code, ``scale / 16``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax import quantization
from lowmem_jax.base import Optimizer, PyTree, as_optimizer, cast_floating

__all__ = [
    "FORMATS",
    "QUANTIZED_FORMATS",
    "QuantizedState",
    "QuantizedStateOptimizer",
    "quantized_state",
]

FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
#: The formats whose leaves are codes + scales rather than float arrays of the slots' shapes.
QUANTIZED_FORMATS = ("int8", "int4")
_FLOAT_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
_DEFAULT_BLOCK = {"int8": 2048, "int4": 128}


class QuantizedState(NamedTuple):
    """``inner_state``: the inner optimizer's state with its leaves in the stored format
    (:class:`lowmem_jax.quantization.Quantized` for int8/int4 leaves); ``rng``: the stochastic
    rounding key (uint32[2]), or ``None``."""

    inner_state: PyTree
    rng: jax.Array | None


def _is_quantized(x: Any) -> bool:
    return isinstance(x, quantization.Quantized)


def _path_names(path) -> set[str]:
    return {str(getattr(k, "name", None) or getattr(k, "key", "")) for k in path}


class QuantizedStateOptimizer(Optimizer):
    """``inner`` with its state stored in ``format``; build with :func:`quantized_state`.

    Forwards the storage of the parameters (``store``, ``materialize``, ``grads_wrt_stored``)
    to ``inner``, so it wraps a sparse optimizer as well as a plain optax transformation, and
    is itself an optax transformation (``init`` / ``update``; usable in ``optax.chain``).
    """

    def __init__(
        self,
        inner: Optimizer,
        format: str,
        block_size: int,
        min_size: int,
        stochastic_rounding: bool,
        second_moments: tuple[str, ...],
        seed: int,
    ):
        self.inner = inner
        self.format = format
        self.block_size = block_size
        self.min_size = min_size
        self.stochastic_rounding = stochastic_rounding
        self.second_moments = second_moments
        self.seed = seed

    # -- encoding -----------------------------------------------------------------------------

    def _encode_new(self, path, x):
        """The stored form of a fresh (``init``) leaf."""
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if self.format == "auto":  # half slots in bfloat16: float16 squares underflow
            return x.astype(jnp.bfloat16) if jnp.dtype(x.dtype).itemsize < 4 else x
        if x.size < self.min_size or self.format in _FLOAT_DTYPES:
            dtype = jnp.float32 if x.size < self.min_size else _FLOAT_DTYPES[self.format]
            return x.astype(dtype)
        second = bool(_path_names(path) & set(self.second_moments))
        if self.format == "int8":
            book, rank1 = ("dynamic_unsigned" if second else "dynamic"), False
        else:  # int4: first moments block-wise DE, second moments rank-1 + zero-free linear
            book, rank1 = ("linear" if second else "dynamic"), second
        bits = 8 if self.format == "int8" else 4
        return quantization.quantize(x, book, bits, block_size=self.block_size, rank1=rank1)

    def _encode_like(self, old, new, key):
        """``new`` (float32) stored as ``old`` was: same code book and blocks, or same dtype."""
        if _is_quantized(old):
            meta = old.meta
            return quantization.quantize(
                new,
                meta.code_book,
                meta.bits,
                block_size=meta.block_size or self.block_size,
                rank1=meta.block_size == 0,
                key=key,
            )
        if hasattr(old, "dtype") and jnp.issubdtype(old.dtype, jnp.floating):
            return new.astype(old.dtype)
        return new

    def encode(self, state: PyTree) -> PyTree:
        """A fresh inner state -> its stored form (``state.inner_state`` of :meth:`init`)."""
        return jax.tree_util.tree_map_with_path(self._encode_new, state)

    @staticmethod
    def decode(stored: PyTree) -> PyTree:
        """The stored inner state -> the inner state with float32 floating leaves."""

        def leaf(x):
            if _is_quantized(x):
                return quantization.dequantize(x)
            return cast_floating(x, jnp.float32)

        return jax.tree.map(leaf, stored, is_leaf=_is_quantized)

    def _wrap(self, inner_state: PyTree) -> QuantizedState:
        rng = jax.random.PRNGKey(self.seed) if self.stochastic_rounding else None
        return QuantizedState(self.encode(inner_state), rng)

    # -- the optax protocol and the storage of the parameters ---------------------------------

    def init(self, params: PyTree) -> QuantizedState:
        return self._wrap(self.inner.init(params))

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, QuantizedState]:
        stored, inner_state = self.inner.store(params, grads)
        return stored, self._wrap(inner_state)

    def update(self, grads, state: QuantizedState, params=None):
        """``grads`` and ``params`` cast to float32, the inner update on the decoded state,
        ``updates`` cast to the dtypes of ``params`` (of ``grads`` without them), the new inner
        state encoded as the old one was."""
        reference = grads if params is None else params
        inner_state = self.decode(state.inner_state)
        params32 = None if params is None else cast_floating(params, jnp.float32)
        updates, inner_state = self.inner.update(
            cast_floating(grads, jnp.float32), inner_state, params32
        )
        updates = jax.tree.map(lambda u, r: u.astype(r.dtype), updates, reference)
        old, treedef = jax.tree.flatten(state.inner_state, is_leaf=_is_quantized)
        new = treedef.flatten_up_to(inner_state)
        rng, keys = state.rng, [None] * len(old)
        if rng is not None:
            rng, sub = jax.random.split(rng)
            keys = list(jax.random.split(sub, max(len(old), 1)))
        leaves = [self._encode_like(o, x, k) for o, x, k in zip(old, new, keys, strict=False)]
        return updates, QuantizedState(jax.tree.unflatten(treedef, leaves), rng)

    def materialize(self, params: PyTree, state: QuantizedState, blockwise: bool = False) -> PyTree:
        # The storage's own state (e.g. a sparse pattern: integers) is not quantized.
        return self.inner.materialize(params, state.inner_state, blockwise)

    @property
    def grads_wrt_stored(self) -> bool:
        return self.inner.grads_wrt_stored

    @property
    def needs_init_grads(self) -> bool:
        return self.inner.needs_init_grads

    def describe(self, state: PyTree | None = None, params: PyTree | None = None) -> dict:
        """The inner optimizer's facts plus ``{"optimizer_state": {"format", "quantized_leaves",
        "stored_bytes"}}`` (with ``state``)."""
        out = dict(self.inner.describe(None if state is None else state.inner_state, params))
        facts: dict[str, Any] = {"format": self.format}
        if state is not None:
            leaves = jax.tree.leaves(state.inner_state, is_leaf=_is_quantized)
            facts["quantized_leaves"] = sum(_is_quantized(x) for x in leaves)
            facts["stored_bytes"] = sum(
                int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)
            )
        out["optimizer_state"] = facts
        return out

    def __repr__(self) -> str:
        return f"quantized_state({self.inner!r}, format={self.format!r})"


def quantized_state(
    tx: optax.GradientTransformation | Optimizer,
    format: str = "int8",
    *,
    block_size: int | None = None,
    min_size: int = 4096,
    stochastic_rounding: bool = False,
    second_moments: tuple[str, ...] = ("nu", "sum_of_squares"),
    seed: int = 0,
) -> QuantizedStateOptimizer:
    """``tx`` with its state stored in ``format`` (see the module docstring).

    Args:
      tx: any optax transformation (``adam``, ``sgd``, ``chain``, ``inject_hyperparams``...)
        or a :class:`lowmem_jax.base.Optimizer`.
      format: one of :data:`FORMATS`.
      block_size: elements per absmax block (default 2048 for int8, 128 for int4).
      min_size: leaves with fewer elements are stored in float32.
      stochastic_rounding: round quantized codes stochastically (unbiased) instead of to the
        nearest; the key lives in the state.
      second_moments: state field names whose leaves are non-negative second moments.
      seed: the stochastic rounding key's seed.

    Raises:
      ValueError: an unknown format, or a block size that is not an even integer >= 2.
    """
    check_format(format)
    block = _DEFAULT_BLOCK.get(format, 2048) if block_size is None else block_size
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"block_size must be an even integer >= 2, got {block_size!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    return QuantizedStateOptimizer(
        as_optimizer(tx), format, block, min_size, stochastic_rounding, tuple(second_moments), seed
    )


def check_format(format: str) -> None:
    """Raises ``ValueError`` unless ``format`` is one of :data:`FORMATS`."""
    if format not in FORMATS:
        raise ValueError(f"Unknown optimizer_state={format!r}; allowed values: {list(FORMATS)}")
