"""Benchmark models of the technical report, written for the remat and precision transforms."""

from lowmem_jax.models.wide_resnet import PreActBlock, WideResNet

__all__ = ["WideResNet", "PreActBlock"]
