"""Layers that read compressed weights, each under its own checkpoint.

A :class:`~lowmem_jax.core.base.LazyLeaf` (compressed sparse weights,
:class:`~lowmem_jax.techniques.sparsity.storage.CompressedLeaf`) becomes dense where a layer reads
it. A layer's backward pass reads its weights (``dx = dy W^T``), and autodiff keeps what the
backward pass reads from the forward pass: without remat every layer's dense weights stay alive from
the forward pass to the backward pass, so the stored form saves argument bytes but raises temp by
about the dense bytes. :func:`checkpoint_lazy_layers` runs each layer whose own parameters
include a lazy leaf under its own ``jax.checkpoint`` that saves nothing but the layer's inputs
(its activation and the compressed leaf): the backward pass densifies the layer's weights again
where it reaches the layer, one layer at a time. JAX recomputes only what the backward pass
reads, so a dense or convolution layer's output is not computed twice, only its dense weights.

A layer called inside a block that :func:`lowmem_jax.techniques.remat.remat_module` already
checkpoints
is left as it is (the block's backward pass rebuilds it). On XLA:CPU the checkpoints need
:func:`lowmem_jax.blocks.policy.compiler_options`, or CSE merges each recomputation into the forward
pass. Inside a loop over stacked blocks (Linen's ``nn.scan``, ``nnx.scan``) a layer reads its
block of a stacked leaf (:class:`~lowmem_jax.techniques.sparsity.storage.CompressedBlock`) and is
checkpointed the same way.
"""

from __future__ import annotations

from typing import Any, TypeVar

import flax.linen as nn
from flax import nnx

from lowmem_jax.blocks import checkpoint
from lowmem_jax.core import linen_wrap
from lowmem_jax.core.base import LazyLeaf

__all__ = ["checkpoint_lazy_layers", "reads_lazy_leaf"]

ModuleT = TypeVar("ModuleT")


def reads_lazy_leaf(module: nn.Module | nnx.Module) -> bool:
    """Whether one of ``module``'s own parameters (not its submodules') is a :class:`LazyLeaf`
    (Linen: a bound module's ``params``; NNX: its ``nnx.Param`` attributes)."""
    if isinstance(module, nnx.Module):
        values = [v.get_raw_value() for v in vars(module).values() if isinstance(v, nnx.Param)]
    elif module.scope is None:
        return False
    else:
        values = list(module.scope.variables().get("params", {}).values())
    return any(isinstance(v, LazyLeaf) for v in values)


def checkpoint_lazy_layers(module: ModuleT) -> ModuleT:
    """Any Linen or NNX module whose layers, when they read a :class:`LazyLeaf`, run under
    their own checkpoint (module docstring); the same parameters, results and structure.

    Linen: an instance of a subclass of ``type(module)`` with the same fields whose
    ``__call__`` runs the model's under ``nn.intercept_methods`` (``nn.remat`` per layer). NNX:
    an ``nnx.clone`` whose submodules holding parameters are instances of subclasses that check,
    per call, whether they read a lazy leaf (``nnx.remat``); ``module`` is left as it was.
    """
    if isinstance(module, nnx.Module):
        return _checkpoint_nnx_layers(module)
    cls = type(module)

    def call(self, *args, **kwargs):
        with nn.intercept_methods(_checkpoint_linen_layer):
            return cls.__call__(self, *args, **kwargs)

    return linen_wrap.with_call(module, call, "checkpoint_lazy_layers")


def _checkpoint_linen_layer(next_fun, args, kwargs, context) -> Any:
    module = context.module
    if (
        context.method_name != "__call__"
        or checkpoint.INSIDE_BLOCK.get()
        or not reads_lazy_leaf(module)
    ):
        return next_fun(*args, **kwargs)
    return checkpoint.checkpointed_call(nn.remat, module, type(module), args, kwargs, None)


def _checkpoint_nnx_layers(module: nnx.Module) -> nnx.Module:
    module = nnx.clone(module)
    layers = [
        sub
        for _, sub in nnx.iter_graph(module)
        if isinstance(sub, nnx.Module) and any(isinstance(v, nnx.Param) for v in vars(sub).values())
    ]

    def make_call(cls):
        def call(self, *args, **kwargs):
            if checkpoint.INSIDE_BLOCK.get() or not reads_lazy_leaf(self):
                return cls.__call__(self, *args, **kwargs)
            return checkpoint.checkpointed_call(nnx.remat, self, cls, args, kwargs, None)

        return call

    linen_wrap.swap_calls(layers, make_call)
    return module
