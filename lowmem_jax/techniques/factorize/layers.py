"""Factorized Flax layers: drop-ins for a convolution (:class:`FactorizedConv`) and a dense layer
(:class:`LowRankDense`), their NNX counterpart (:class:`NNXFactorized`), and the kernel <->
factors maps that define their parameters.

Parameters (each factor a submodule with a ``kernel``, so weight decay and sparse training that
select ``kernel`` leaves reach the factors), for a dense kernel ``[KH, KW, S, T]`` (``[S, T]``
for a dense layer):

==========  ===============================================================================
method      factors, applied in this order to ``x [B, H, W, S]``
==========  ===============================================================================
lowrank     ``first [KH, KW, S, R]`` (``[S, R]`` dense) conv with the layer's stride and
            padding, ``last [R, T]`` pointwise
tucker      ``first [S, R1]`` pointwise, ``core [KH, KW, R1, R2]`` conv (stride, padding),
            ``last [R2, T]`` pointwise
cp          ``first [S, R]`` pointwise, ``vertical [KH, R]`` depthwise along H, ``horizontal
            [KW, R]`` depthwise along W (each with its axis' stride and padding), ``last [R, T]``
            pointwise
==========  ===============================================================================

plus ``bias [T]`` when ``use_bias``. The outputs between factors are tagged
:data:`~lowmem_jax.techniques.factorize.FACTOR_HIDDEN` (``checkpoint_name``): a remat policy that
does not save them recomputes them (the CTDR combination). Pointwise factors are matmuls, depthwise
ones shifted multiply-adds with a backward that keeps only the input (no per-tap copies), and the
spatial convolutions go through :func:`lowmem_jax.ops.conv2d` (``impl`` as the models use it).

Initialisation from scratch is spectral (Khodak et al. 2021): a dense kernel is drawn from the
layer's ``kernel_init`` and decomposed (:func:`factorize_kernel`), so training from scratch and
decompose-and-fine-tune start from the same map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen.dtypes import promote_dtype
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.ops.conv import Conv, conv2d, explicit_padding
from lowmem_jax.techniques.factorize import decompose
from lowmem_jax.techniques.factorize.config import FACTOR_HIDDEN, FactorConfig, layer_method

__all__ = [
    "FactorizedConv",
    "LowRankDense",
    "NNXFactorized",
    "FACTOR_NAMES",
    "factor_shapes",
    "factorize_kernel",
    "reconstruct_kernel",
    "conv_layer",
    "dense_layer",
    "apply_dense",
]

#: The factor submodules of each method, in the order they are applied.
FACTOR_NAMES = {
    "lowrank": ("first", "last"),
    "tucker": ("first", "core", "last"),
    "cp": ("first", "vertical", "horizontal", "last"),
}


def factorize_kernel(
    config: FactorConfig,
    method: str,
    kernel: jax.Array,
    ranks: Sequence[int],
    key: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The factors (float32, the layout of the module docstring) that approximate ``kernel``
    (``[KH, KW, S, T]`` or ``[S, T]``) at ``ranks``; ``key`` seeds CP's extra columns."""
    if method == "lowrank":
        first, last = decompose.low_rank(kernel, ranks[0])
        return {"first": first, "last": last}
    if method == "tucker":
        u, core, v = decompose.tucker2(kernel, tuple(ranks), config.hooi_iterations)
        return {"first": u, "core": core, "last": v.T}
    weights, (vertical, horizontal, first, last) = decompose.cp(
        kernel, ranks[0], config.cp_iterations, config.cp_tolerance, key
    )
    # The (non-negative) weights spread evenly over the four factors: balanced scales.
    root = weights**0.25
    return {
        "first": first * root,
        "vertical": vertical * root,
        "horizontal": horizontal * root,
        "last": (last * root).T,
    }


def reconstruct_kernel(method: str, factors: dict[str, jax.Array]) -> jax.Array:
    """The dense kernel the ``factors`` represent (``[KH, KW, S, T]``, or ``[S, T]``)."""
    if method == "lowrank":
        return decompose.low_rank_to_tensor(factors["first"], factors["last"])
    if method == "tucker":
        return decompose.tucker2_to_tensor(factors["first"], factors["core"], factors["last"].T)
    return jnp.einsum(
        "ir,jr,sr,rt->ijst",
        factors["vertical"],
        factors["horizontal"],
        factors["first"],
        factors["last"],
    )


def _pointwise(x: jax.Array, m: jax.Array) -> jax.Array:
    return jnp.einsum("...s,sr->...r", x, m)


def _strided(x: jax.Array, strides: tuple[int, int], pads) -> jax.Array:
    """What a 1x1 convolution with ``strides`` and ``pads`` reads of NHWC ``x``."""
    if strides == (1, 1) and pads == ((0, 0), (0, 0)):
        return x
    zero = jnp.zeros((), x.dtype)
    x = lax.pad(x, zero, [(0, 0, 0), (*pads[0], 0), (*pads[1], 0), (0, 0, 0)])
    ends = [(n - 1) // s * s + 1 for n, s in zip(x.shape[1:3], strides, strict=True)]
    return lax.slice(x, (0, 0, 0, 0), (x.shape[0], *ends, x.shape[3]), (1, *strides, 1))


def _depthwise_taps(x, taps, axis, stride, pad):
    zero = jnp.zeros((), x.dtype)
    cfg = [(0, 0, 0)] * x.ndim
    cfg[axis] = (*pad, 0)
    x = lax.pad(x, zero, cfg)
    k = taps.shape[0]
    out = (x.shape[axis] - k) // stride + 1
    return sum(
        lax.slice_in_dim(x, i, i + (out - 1) * stride + 1, stride, axis) * taps[i] for i in range(k)
    )


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _depthwise(x: jax.Array, taps: jax.Array, axis: int, stride: int, pad: tuple[int, int]):
    """``y[.., o, .., c] = sum_k x[.., o * stride + k - lo, .., c] * taps[k, c]`` along ``axis``."""
    return _depthwise_taps(x, taps, axis, stride, pad)


def _depthwise_fwd(x, taps, axis, stride, pad):
    return _depthwise_taps(x, taps, axis, stride, pad), (x, taps)


def _depthwise_bwd(axis, stride, pad, residuals, dy):
    # The shifted slices are recomputed from x here instead of stored (one copy per tap).
    _, vjp = jax.vjp(lambda x, t: _depthwise_taps(x, t, axis, stride, pad), *residuals)
    return vjp(dy)


_depthwise.defvjp(_depthwise_fwd, _depthwise_bwd)


def factor_shapes(
    method: str, kernel_shape: tuple[int, ...], ranks: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """The factors' shapes (module docstring) for a dense kernel of ``kernel_shape``."""
    *spatial, s, t = kernel_shape
    if method == "lowrank":
        return {"first": (*spatial, s, ranks[0]), "last": (ranks[0], t)}
    if method == "tucker":
        r1, r2 = ranks
        return {"first": (s, r1), "core": (*spatial, r1, r2), "last": (r2, t)}
    (r,) = ranks
    return {"first": (s, r), "vertical": (spatial[0], r), "horizontal": (spatial[1], r),
            "last": (r, t)}  # fmt: skip


def factor_names(
    method: str, kernel_names: Sequence[str | None]
) -> dict[str, tuple[str | None, ...]]:
    """The partitioning names of the factors (:func:`factor_shapes`'s layout) of a dense kernel
    whose axes are named ``kernel_names`` (``nn.with_partitioning`` or
    ``nn.with_logical_partitioning`` of the layer's ``kernel_init``): a factor's input and
    output axes keep the kernel's names, a rank axis is unnamed (replicated)."""
    *spatial, s, t = kernel_names
    if method == "lowrank":
        return {"first": (*spatial, s, None), "last": (None, t)}
    if method == "tucker":
        return {"first": (s, None), "core": (*spatial, None, None), "last": (None, t)}
    return {"first": (s, None), "vertical": (spatial[0], None),
            "horizontal": (spatial[1], None), "last": (None, t)}  # fmt: skip


class _Factor(nn.Module):
    """One factor: the parameter ``kernel``, initialised to ``value`` (computed by the parent;
    ``None`` outside initialisation, where Flax only checks the shape), in ``box`` (the layer's
    kernel's ``nn.Partitioned`` metadata with this factor's names) when the layer has one."""

    shape: tuple[int, ...]
    param_dtype: Any
    box: nn.Partitioned | None = None

    @nn.compact
    def __call__(self, value: jax.Array | None) -> jax.Array:
        def init(_):
            if value is None:
                out = jnp.zeros(self.shape, self.param_dtype)
            else:
                out = value.astype(self.param_dtype)
            return out if self.box is None else self.box.replace_boxed(out)

        return self.param("kernel", init)


def _unboxed_kernel(kernel: Any, layer: str) -> tuple[jax.Array, nn.Partitioned | None]:
    """A ``kernel_init`` draw as an array and its partitioning box (``None``: unboxed).

    Raises:
      ValueError: metadata other than ``nn.Partitioned`` (and its subclasses), whose meaning
        for the factors' shapes is unknown.
    """
    if isinstance(kernel, nn.Partitioned):
        return kernel.unbox(), kernel
    if isinstance(kernel, nn.meta.AxisMetadata):
        raise ValueError(
            f"factorize: layer {layer}'s kernel_init returns {type(kernel).__name__} metadata; "
            "only nn.Partitioned / nn.LogicallyPartitioned boxes carry over to the factors"
        )
    return kernel, None


def _factors(module: nn.Module, method: str, shape: tuple[int, ...]) -> list[jax.Array]:
    """The factor parameters of ``module`` for a dense kernel of ``shape``: created from a
    spectral initialisation at the config's ranks on init; read back (their shapes as stored)
    on apply, so a copy of the layer applied to its own parameters needs no ranks."""
    names = FACTOR_NAMES[method]
    stored = nn.meta.unbox(module.variables.get("params", {}))
    values, boxes = None, dict.fromkeys(names)
    if all(name in stored for name in names):
        shapes = {name: stored[name]["kernel"].shape for name in names}
    else:
        ranks = module.config.ranks_for(shape, module.name)
        shapes = factor_shapes(method, shape, ranks)
        if module.is_initializing():
            key = module.make_rng("params")
            dense, box = _unboxed_kernel(module.kernel_init(key, shape, jnp.float32), module.name)
            values = factorize_kernel(
                module.config, method, dense, ranks, jax.random.fold_in(key, 1)
            )
            if box is not None:
                named = factor_names(method, box.names)
                boxes = {name: box.replace(names=named[name]) for name in names}
    return [
        _Factor(shapes[name], module.param_dtype, boxes[name], name=name)(values and values[name])
        for name in names
    ]


class FactorizedConv(Conv):
    """Drop-in for :class:`lowmem_jax.ops.Conv` (its fields; 2D, NHWC ``[..., H, W, S] ->
    [..., H', W', features]``) with the kernel factorized by ``config`` (module docstring).
    Inputs and factors are cast to ``dtype`` (None: their promoted dtype)."""

    config: FactorConfig = FactorConfig()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        shape = (*self.kernel_size, inputs.shape[-1], self.features)
        method = layer_method(self.config.method, shape)
        factors = _factors(self, method, shape)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        x, *factors = promote_dtype(inputs, *factors, dtype=self.dtype)
        f = dict(zip(FACTOR_NAMES[method], factors, strict=True))
        y = factorized_conv(x, method, f, self.kernel_size, self.strides, self.padding, self.impl)
        return y if bias is None else y + bias.astype(y.dtype)


def factorized_conv(
    inputs: jax.Array,
    method: str,
    factors: dict[str, jax.Array],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    padding: Any,
    impl: str = "auto",
) -> jax.Array:
    """The convolution of ``inputs`` (NHWC ``[..., H, W, S]``) with the kernel that ``factors``
    of ``method`` represent (the module docstring's layout; ``lowrank`` for a 1x1 kernel),
    ``[..., H', W', T]``: the factors applied in turn, not the kernel rebuilt. ``padding``:
    ``"SAME"``, ``"VALID"`` or ``[(lo, hi), (lo, hi)]``. No bias, no casts."""
    x = inputs.reshape(-1, *inputs.shape[-3:])
    strides = tuple(strides)
    pads = explicit_padding(padding, x.shape[1:3], tuple(kernel_size), strides)
    f = factors
    hidden = partial(checkpoint_name, name=FACTOR_HIDDEN)
    if method == "lowrank" and tuple(kernel_size) == (1, 1):
        h = hidden(_pointwise(_strided(x, strides, pads), f["first"][0, 0]))
    elif method == "lowrank":
        h = hidden(conv2d(x, f["first"], strides, pads, impl))
    elif method == "tucker":
        h = hidden(_pointwise(x, f["first"]))
        h = hidden(conv2d(h, f["core"], strides, pads, impl))
    else:
        h = hidden(_pointwise(x, f["first"]))
        h = hidden(_depthwise(h, f["vertical"], 1, strides[0], pads[0]))
        h = hidden(_depthwise(h, f["horizontal"], 2, strides[1], pads[1]))
    y = _pointwise(h, f["last"])
    return y.reshape(*inputs.shape[:-3], *y.shape[1:])


def factorized_dense(inputs: jax.Array, first: jax.Array, last: jax.Array) -> jax.Array:
    """``(inputs @ first) @ last``: ``[..., S] -> [..., T]`` through ``R`` (``first [S, R]``,
    ``last [R, T]``), the hidden ``[..., R]`` tagged :data:`FACTOR_HIDDEN`."""
    return _pointwise(checkpoint_name(_pointwise(inputs, first), FACTOR_HIDDEN), last)


class LowRankDense(nn.Module):
    """Drop-in for ``flax.linen.Dense``: ``[..., S] -> [..., features]`` as ``(x @ first) @
    last (+ bias)`` with ``first [S, R]``, ``last [R, features]``, ``R`` from ``config``."""

    features: int
    config: FactorConfig
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        shape = (inputs.shape[-1], self.features)
        factors = _factors(self, "lowrank", shape)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        x, first, last, bias = promote_dtype(inputs, *factors, bias, dtype=self.dtype)
        y = factorized_dense(x, first, last)
        return y if bias is None else y + bias


def conv_layer(
    config: FactorConfig | None, wrap: Callable[[type], type] | None = None, **kwargs: Any
) -> nn.Module:
    """:class:`lowmem_jax.ops.Conv` (``config=None``) or :class:`FactorizedConv` with ``kwargs``;
    ``wrap``: applied to the class first (e.g. :func:`lowmem_jax.blocks.scanned.with_layout`)."""
    wrap = wrap or (lambda cls: cls)
    if config is None:
        return wrap(Conv)(**kwargs)
    return wrap(FactorizedConv)(config=config, **kwargs)


def apply_dense(params: dict, x: jax.Array, dtype: Any = None) -> jax.Array:
    """A dense layer (``nn.Dense`` or :class:`LowRankDense`) applied to ``x`` with its stored
    ``params`` (``kernel`` [+ ``bias``], or ``first`` / ``last`` [+ ``bias``])."""
    names = ("kernel",) if "kernel" in params else ("first", "last")
    kernels = [params[n] if n == "kernel" else params[n]["kernel"] for n in names]
    x, *kernels, bias = promote_dtype(x, *kernels, params.get("bias"), dtype=dtype)
    for kernel in kernels:
        x = _pointwise(x, kernel)
    return x if bias is None else x + bias


def dense_layer(
    config: FactorConfig | None,
    features: int,
    wrap: Callable[[type], type] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """``flax.linen.Dense`` (``config=None``) or :class:`LowRankDense` with ``kwargs``; ``wrap``
    as :func:`conv_layer`'s."""
    wrap = wrap or (lambda cls: cls)
    if config is None:
        return wrap(nn.Dense)(features, **kwargs)
    return wrap(LowRankDense)(features, config=config, **kwargs)


class _NNXFactor(nnx.Module):
    """One factor: the ``nnx.Param`` ``kernel`` (the Linen layers' layout, ``first/kernel``: what
    sparse training and weight decay select by the name ``kernel`` reach it)."""

    def __init__(self, value: jax.Array, metadata: dict | None = None):
        self.kernel = nnx.Param(value, **(metadata or {}))


class NNXFactorized(nnx.Module):
    """A factorized ``nnx.Linear`` (``kernel_size=None``) or 2-D ``nnx.Conv``: the factors of
    the module docstring, each a submodule with a ``kernel`` named as there (``first``,
    ``core``, ``vertical``, ``horizontal``, ``last``; a layer axis first when the layer is a
    stack), the layer's ``bias``, ``[..., S] -> [..., T]`` (convolutions NHWC). Inputs and
    factors are cast to ``dtype`` (None: their promoted dtype). ``metadata``: each factor's
    ``nnx.Param`` metadata (the kernel's partitioning names mapped to the factor)."""

    def __init__(
        self,
        method: str,
        factors: dict[str, jax.Array],
        bias: nnx.Param | None,
        *,
        kernel_size: tuple[int, int] | None = None,
        strides: tuple[int, int] = (1, 1),
        padding: Any = "SAME",
        dtype: Any = None,
        metadata: dict[str, dict] | None = None,
    ):
        self.method = method
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.dtype = dtype
        for name in FACTOR_NAMES[method]:
            setattr(self, name, _NNXFactor(factors[name], (metadata or {}).get(name)))
        self.bias = bias

    def __call__(self, inputs: jax.Array) -> jax.Array:
        names = FACTOR_NAMES[self.method]
        bias = None if self.bias is None else self.bias[...]
        x, *factors, bias = promote_dtype(
            inputs, *(getattr(self, n).kernel[...] for n in names), bias, dtype=self.dtype
        )
        if self.kernel_size is None:
            y = factorized_dense(x, *factors)
        else:
            f = dict(zip(names, factors, strict=True))
            y = factorized_conv(x, self.method, f, self.kernel_size, self.strides, self.padding)
        return y if bias is None else y + bias
