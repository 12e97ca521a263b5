"""Weight streaming's code: a parameter's move to the device where the model reads it
(:class:`ToDevice`, the bundled models' layouts; :class:`StreamedLeaf`, any other model's
reads), the reads of a model without layouts boxed (:func:`read_where_used`), and the units the
step moves at once (:func:`units`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax.blocks.scanned import STACK, in_stack
from lowmem_jax.core import base, linen_wrap
from lowmem_jax.core.base import LazyLeaf, cast_floating

__all__ = ["ToDevice", "StreamedLeaf", "read_where_used", "units"]


@dataclasses.dataclass(frozen=True)
class ToDevice:
    """One block's parameters moved to the device, then their floating leaves cast to
    ``dtype`` (``None``: as stored): the ``param_layout`` of weight streaming
    (:mod:`lowmem_jax.techniques.weight_memory`), the stacks kept in host memory and cast, as
    the loss casts the parameters it holds, once on the device."""

    dtype: Any = None
    #: Applied to a lone block's stacked parameters before they are indexed, so nothing indexes
    #: them in host memory (what :class:`~lowmem_jax.ScannedBlocks` asks a layout).
    moves_memory = True

    def __call__(self, block_params: Any) -> Any:
        moved = jax.device_put(block_params, jax.memory.Space.Device)
        return moved if self.dtype is None else cast_floating(moved, self.dtype)


@jax.tree_util.register_pytree_node_class
class StreamedLeaf(LazyLeaf):
    """A parameter in host memory, moved to the device and cast to ``compute_dtype`` where a
    layer reads it (weight streaming of a model without layouts: Linen's ``self.param`` unboxes
    it, NNX and ``jnp`` code convert it through ``__jax_array__``); its gradient, the move's
    transpose, goes back to host memory. ``value`` is the only child: a transform that maps over
    its leading axis (``nn.scan``, ``lax.scan``) slices it to a block's. Read again by a layer's
    backward pass when the layer runs under its own checkpoint
    (:func:`lowmem_jax.blocks.lazy_layers.checkpoint_lazy_layers`)."""

    def __init__(self, value: jax.Array, compute_dtype: Any = None):
        self.value, self.compute_dtype = value, compute_dtype

    shape = property(lambda self: tuple(jnp.shape(self.value)))

    @property
    def dtype(self):  # the moved array's: floating values cast to ``compute_dtype``
        stored = jnp.result_type(self.value)
        cast = self.compute_dtype is not None and jnp.issubdtype(stored, jnp.floating)
        return jnp.dtype(self.compute_dtype) if cast else stored

    def tree_flatten(self):
        return (self.value,), self.compute_dtype

    @classmethod
    def tree_unflatten(cls, compute_dtype, children):
        return cls(children[0], compute_dtype)

    def dense(self) -> jax.Array:
        return ToDevice(self.compute_dtype)(self.value)

    def __getattr__(self, name: str) -> Any:
        """An array's public attributes (``.T``, ``.reshape``, ...) of the moved array, for a
        model that reads its variables without unboxing them (GPT-2's tied output layer)."""
        if name.startswith("_") or name in ("value", "compute_dtype"):
            raise AttributeError(name)
        return getattr(self.dense(), name)

    def add_axis(self, index, params):
        return self

    def remove_axis(self, index, params):
        return self

    def sliceable(self) -> StreamedLeaf:
        return self


def _boxed(plan):
    """``box(x)``: a :class:`StreamedLeaf` of ``x`` in host memory
    (moved and cast to the compute dtype where a layer reads it), ``x`` elsewhere."""
    dtype = plan.policy.compute_dtype
    return lambda x: StreamedLeaf(x, dtype) if base.in_host_memory(x) else x


def read_where_used(model, plan):
    """A Linen or NNX ``model`` without layouts whose parameters in host memory reach its
    layers boxed (:func:`_read_where_used_linen`, :func:`_read_where_used_nnx`)."""
    if isinstance(model, nnx.Module):
        return _read_where_used_nnx(model, plan)
    return _read_where_used_linen(model, plan)


def _read_where_used_linen(model, plan):
    """A Linen ``model`` without layouts whose parameters in host memory reach its layers as
    :class:`StreamedLeaf` boxes, each moved to the device and cast
    where a layer reads it (Flax's ``nn.map_variables`` over the model's call, not while
    initialising, so the stored parameters and their paths are the model's own)."""
    cls, box = type(model), _boxed(plan)

    def boxed(params):
        return jax.tree.map(box, params)

    def call(self, *args, **kwargs):
        if self.is_initializing():
            return cls.__call__(self, *args, **kwargs)

        def body(module, *positional):  # keyword arguments (``train``) closed over, as static
            return cls.__call__(module, *positional, **kwargs)

        return nn.map_variables(body, "params", trans_in_fn=boxed)(self, *args)

    return linen_wrap.with_call(model, call, ("weight streaming", plan.policy.compute_dtype))


def _read_where_used_nnx(model, plan):
    """An NNX ``model`` (a copy) whose call boxes its ``nnx.Param`` values in host memory as
    :func:`read_where_used` does (each ``Param`` holds the box during the call, its array
    again after it)."""
    module, box = nnx.clone(model), _boxed(plan)

    def make_call(cls):
        def call(self, *args, **kwargs):
            params = [value for _, sub in nnx.iter_graph(self) if isinstance(sub, nnx.Module)
                      for value in vars(sub).values() if isinstance(value, nnx.Param)]  # fmt: skip
            arrays = [param.get_raw_value() for param in params]
            for param, array in zip(params, arrays, strict=True):
                param.set_raw_value(box(array))
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                for param, array in zip(params, arrays, strict=True):
                    param.set_raw_value(array)

        return call

    linen_wrap.swap_calls([module], make_call)
    return module


def units(params, stacks_only: bool = False) -> dict[str, int]:
    """Bytes of each unit the step moves to the device at once: one block of each stack (its
    leaves' bytes over the blocks), each layer outside the stacks (a top-level entry; none with
    ``stacks_only``), by path."""
    sizes: dict[str, int] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(key, "key", None) for key in path]
        if in_stack(names):
            unit, blocks = names[: names.index(STACK)], x.shape[0]
        elif stacks_only:
            continue
        else:
            unit, blocks = names[:1], 1
        key = "/".join(map(str, unit))
        sizes[key] = sizes.get(key, 0) + x.size * x.dtype.itemsize // blocks
    return sizes
