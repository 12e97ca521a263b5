"""Ops with loop-friendly backward passes."""

from lowmem_jax.ops.conv import Conv, conv2d

__all__ = ["Conv", "conv2d"]
