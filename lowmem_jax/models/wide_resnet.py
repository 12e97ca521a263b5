"""WideResNet (Zagoruyko & Komodakis, 2016), CIFAR layout, pre-activation basic blocks.

``WRN-d-k``: a 3x3 stem convolution to 16 channels, then 3 groups of ``n = (d - 4) / 6``
pre-activation basic blocks of widths ``16k, 32k, 64k`` and strides ``1, 2, 2``, then
BatchNorm + ReLU, global average pooling and a dense classifier. A block is

    o = relu(bn1(x))
    y = conv3x3(relu(bn2(conv3x3(o, stride))))
    return y + (conv1x1(o, stride) if the shape changes else x)

WRN-28-2 on 3-channel inputs has exactly 1,467,610 parameters.

Within a group, blocks 2..n have identical shapes: they run as one :class:`ScannedBlocks` stack
(``lax.scan``), so remat policies apply per block and compile once. The first block of each
group is a stack of length 1, so every block goes through the same remat mechanism.

Inputs: images ``[B, H, W, C]`` (any float dtype). Output: logits ``[B, num_classes]`` in
``dtype`` (the computation dtype; ``None`` follows the inputs and parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.blocks.policy import CONV_OUT, stack_policies
from lowmem_jax.blocks.scanned import ScannedBlocks, with_layout
from lowmem_jax.models.layers import BatchNorm
from lowmem_jax.techniques.factorize import FactorConfig, conv_layer, dense_layer

__all__ = ["WideResNet", "PreActBlock"]


class PreActBlock(nn.Module):
    """Pre-activation basic block; ``[B, H, W, C_in] -> [B, H/s, W/s, features]``."""

    features: int
    strides: int = 1
    dtype: Any = None
    bn_momentum: float = 0.9
    conv_impl: str = "auto"
    factorize: FactorConfig | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        norm = functools.partial(
            BatchNorm,
            use_running_average=not train,
            momentum=self.bn_momentum,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        conv = functools.partial(
            conv_layer, self.factorize, use_bias=False, dtype=self.dtype, impl=self.conv_impl
        )
        s = self.strides
        out = nn.relu(norm(name="bn1")(x))
        shortcut = x
        if x.shape[-1] != self.features or s != 1:
            shortcut = conv(
                features=self.features,
                kernel_size=(1, 1),
                strides=(s, s),
                padding="VALID",
                name="shortcut",
            )(out)
        # Explicit symmetric padding as in the reference PyTorch code (SAME would pad (0, 1)
        # for stride 2).
        y = conv(
            features=self.features,
            kernel_size=(3, 3),
            strides=(s, s),
            padding=((1, 1), (1, 1)),
            name="conv1",
        )(out)
        y = checkpoint_name(y, CONV_OUT)
        y = nn.relu(norm(name="bn2")(y))
        y = conv(
            features=self.features, kernel_size=(3, 3), padding=((1, 1), (1, 1)), name="conv2"
        )(y)
        y = checkpoint_name(y, CONV_OUT)
        return y + shortcut.astype(y.dtype)


class WideResNet(nn.Module):
    """WRN-``depth``-``width`` for 32x32 images.

    Attributes:
      depth: ``6n + 4`` (10, 16, 22, 28, ...).
      width: the widening factor ``k``.
      num_classes: size of the output layer.
      dtype: computation dtype (``None``: follow inputs and parameters).
      remat: remat policy name applied per block (see :mod:`lowmem_jax.blocks.policy`), or a
        ``blocks:`` schedule of ``3 * (depth - 4) // 6`` blocks, the groups in order.
      conv_impl: ``"auto" | "xla" | "loop_friendly"`` (see :mod:`lowmem_jax.ops.conv`).
      unroll: run the stacks of identical blocks as straight-line code instead of a loop (same
        parameters and results); ``None``: the stacks neither remat'd nor computing in float16
        unrolled, the others loops (:func:`lowmem_jax.blocks.scanned.straight_line`).
        ``conv_impl="xla", unroll=True`` is the plain Flax baseline.
      factorize: a :class:`~lowmem_jax.techniques.factorize.FactorConfig`: the blocks' convolutions
        (and, unless ``keep_first_last``, the stem and the classifier) are factorized.
      param_layout: applied to each block's parameters inside its stack's loop
        (:class:`~lowmem_jax.ScannedBlocks`; ZeRO-3 gathers them there).
      outer_param_layout: applied to the parameters of each layer outside the stacks (stem,
        final BatchNorm, classifier) where it runs (weight streaming moves them to the device).
      pixel_mean, pixel_std: per-channel statistics (one value, or one per channel) of integer
        images: an integer batch (raw pixels, e.g. uint8 ``[B, H, W, C]``) is normalised first,
        ``(x - pixel_mean) / pixel_std`` in float32, then cast to ``dtype``, so the batch is
        stored in 1 byte per pixel and only a microbatch's float copy exists at a time
        (``Plan(input_dtype="uint8")``). Floating images are taken as already normalised.
    """

    depth: int = 28
    width: int = 2
    num_classes: int = 10
    dtype: Any = None
    remat: str = "none"
    conv_impl: str = "auto"
    unroll: bool | None = None
    bn_momentum: float = 0.9
    factorize: FactorConfig | None = None
    param_layout: Callable[[Any], Any] | None = None
    outer_param_layout: Callable[[Any], Any] | None = None
    pixel_mean: tuple[float, ...] | None = None
    pixel_std: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.depth < 10 or (self.depth - 4) % 6:
            raise ValueError(
                f"depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, ...), got {self.depth}"
            )
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if (self.pixel_mean is None) != (self.pixel_std is None):
            raise ValueError("pixel_mean and pixel_std go together: give both or neither")
        if self.pixel_std is not None and min(self.pixel_std) <= 0:
            raise ValueError(f"pixel_std must be > 0, got {self.pixel_std}")
        super().__post_init__()

    def normalize(self, images: jax.Array) -> jax.Array:
        """Integer ``images`` -> ``(images - pixel_mean) / pixel_std`` (float32 arithmetic,
        the result in ``dtype``); floating ones unchanged."""
        if not jnp.issubdtype(images.dtype, jnp.integer):
            return images
        if self.pixel_mean is None:
            raise ValueError(
                f"images of dtype {images.dtype} need pixel_mean and pixel_std on the model "
                "(the raw pixels' statistics); or feed float images already normalised"
            )
        mean = jnp.asarray(self.pixel_mean, jnp.float32)
        std = jnp.asarray(self.pixel_std, jnp.float32)
        return ((images.astype(jnp.float32) - mean) / std).astype(self.dtype or jnp.float32)

    def block_stacks(self) -> list[int]:
        """The blocks of each scanned stack, in the order they run (a group's first block, then
        its other ``n - 1``): a ``blocks:`` remat schedule gives one policy per block."""
        n = (self.depth - 4) // 6
        return [1, n - 1] * 3 if n > 1 else [1] * 3

    @nn.compact
    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        n = (self.depth - 4) // 6
        block = functools.partial(
            PreActBlock,
            dtype=self.dtype,
            bn_momentum=self.bn_momentum,
            conv_impl=self.conv_impl,
            factorize=self.factorize,
        )
        ends = None if self.factorize is None or self.factorize.keep_first_last else self.factorize
        outer = functools.partial(
            with_layout, layout=self.outer_param_layout, initializing=self.is_initializing()
        )
        x = conv_layer(
            ends,
            outer,
            features=16,
            kernel_size=(3, 3),
            padding=((1, 1), (1, 1)),
            dtype=self.dtype,
            impl=self.conv_impl,
            name="stem",
        )(self.normalize(images))
        policies = iter(stack_policies(self.remat, self.block_stacks(), f"WRN-{self.depth}"))
        for g, (features, strides) in enumerate(zip((16, 32, 64), (1, 2, 2), strict=True)):
            features *= self.width
            first = functools.partial(block, features=features, strides=strides)
            stack = functools.partial(
                ScannedBlocks, unroll=self.unroll, param_layout=self.param_layout
            )
            x = stack(first, 1, next(policies), name=f"group{g}_first")(x, train=train)
            if n > 1:
                rest = functools.partial(block, features=features)
                x = stack(rest, n - 1, next(policies), name=f"group{g}_rest")(x, train=train)
        x = outer(BatchNorm)(
            use_running_average=not train,
            momentum=self.bn_momentum,
            epsilon=1e-5,
            dtype=self.dtype,
            name="bn_final",
        )(x)
        x = jnp.mean(nn.relu(x), axis=(1, 2))
        return dense_layer(ends, self.num_classes, outer, dtype=self.dtype, name="classifier")(x)
