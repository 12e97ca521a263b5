"""Factorize the dense and convolution layers of any Linen or NNX model, without edits to its code.

:func:`factorize_module` replaces, in a copy of the model, each ``flax.linen.Dense`` /
``flax.linen.Conv`` (Linen) or ``nnx.Linear`` / ``nnx.Conv`` (NNX) layer it can by the factorized
layer of :mod:`lowmem_jax.techniques.factorize.layers` (dense: ``first [S, R]``, ``last [R, T]``;
convolutions by ``config.method``), with the layer's own stride, padding, bias, dtypes and
initializers. Which layers:

* the layer types above, 2-D convolutions without dilation, groups or masks, explicit
  precision or a custom ``dot_general`` / ``conv_general_dilated`` (those stay as they are);
* ``config.layers``: only those whose path one of the expressions matches;
* ``config.keep_first_last`` (default): the first and the last such layer the model runs stay
  dense (a stem and a classifier), unless the layer is a stack (``nn.scan`` / ``nnx.vmap``
  layers whose parameters carry a leading layer axis): a stack is many layers, not an end.

Linen: the copy is an instance of a subclass of the model's class with the same fields whose
``__call__`` runs under ``nn.intercept_methods`` (:mod:`lowmem_jax.core.linen_wrap`). At ``init`` it
first traces the model once (``jax.eval_shape``, nothing runs) to find the layers in the order
they run, then creates the chosen layers' factors in their place (spectral initialisation from
the layer's ``kernel_init``): ``Dense_0/{first,last}/kernel`` instead of ``Dense_0/kernel``. At
``apply`` the stored parameters decide: a layer with factors runs factorized, one with a
``kernel`` dense. Only ``__call__`` is intercepted (``apply(..., method=...)`` runs unchanged).

NNX: an ``nnx.clone`` whose chosen layers are factorized modules holding the decomposition of
the layer's current kernel (:func:`~lowmem_jax.techniques.factorize.factorize_kernel`; a stacked
kernel per layer, ``vmap``-ed), so a trained model is decomposed in place; "first" and "last"
follow the order in which the layers were assigned (``__init__``), the order most models run
them in.

A model in which no layer can be factorized is refused (``ValueError`` naming why), never
returned unchanged.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax.core import linen_wrap
from lowmem_jax.techniques.factorize.config import FactorConfig, layer_method
from lowmem_jax.techniques.factorize.layers import (
    FACTOR_NAMES,
    FactorizedConv,
    LowRankDense,
    NNXFactorized,
    factor_names,
    factor_shapes,
    factorize_kernel,
)

__all__ = ["factorize_module"]

LINEN_LAYERS = (nn.Dense, nn.Conv)
# Settings a factorized layer does not reproduce, and their defaults (Linen: None; NNX: these).
_DEFAULTS = {
    "precision": None,
    "dot_general": jax.lax.dot_general,
    "dot_general_cls": None,
    "conv_general_dilated": jax.lax.conv_general_dilated,
    "conv_general_dilated_cls": None,
    "mask": None,
    "preferred_element_type": None,
}
NNX_LAYERS = (nnx.Linear, nnx.Conv)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One dense / convolution layer of a model: its path, its class, whether it is a stack,
    and why it cannot be factorized (``None``: it can)."""

    path: str
    kind: str
    stacked: bool
    unsupported: str | None


def factorize_module(module: Any, config: FactorConfig) -> Any:
    """A copy of ``module`` (Linen or NNX) with its dense and convolution layers factorized
    by ``config`` (module docstring).

    Raises:
      ValueError: no layer of the model can be factorized (NNX: here; Linen: at ``init``),
        naming the layers it has and why each stays dense.
    """
    if type(module) in LINEN_LAYERS + NNX_LAYERS:
        raise ValueError(
            f"factorize replaces the layers inside a model; {type(module).__name__} is one layer, "
            "its first and last (factorize it with keep_first_last=False inside a model)"
        )
    if isinstance(module, nnx.Module):
        return _factorize_nnx(module, config)
    return _factorize_linen(module, config)


# --- which layers -------------------------------------------------------------------------------


def _pairs(value: Any, n: int = 2) -> tuple | None:
    if value is None:
        return (1,) * n
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value if len(value) == n else None


def _padding(padding: Any) -> Any:
    """``padding`` as :func:`factorized_conv` takes it, or ``None`` when it cannot."""
    if isinstance(padding, str):
        return padding.upper() if padding.upper() in ("SAME", "VALID") else None
    if isinstance(padding, int):
        return ((padding, padding),) * 2
    pads = tuple(_pairs(p) for p in padding)
    return pads if len(pads) == 2 and None not in pads else None


def _unsupported(layer: Any) -> str | None:
    """Why ``layer`` (a Dense / Linear / Conv of either API) stays dense; ``None``: it can be
    factorized."""
    custom = [
        name
        for name, default in _DEFAULTS.items()
        if getattr(layer, name, None) not in (None, default)
    ]
    if custom:
        return f"custom {', '.join(custom)}"
    if not hasattr(layer, "kernel_size"):
        return None
    if isinstance(layer.kernel_size, int) or len(layer.kernel_size) != 2:
        return f"kernel_size {layer.kernel_size} (2-D convolutions only)"
    if getattr(layer, "feature_group_count", 1) != 1:
        return f"feature_group_count {layer.feature_group_count}"
    for name in ("input_dilation", "kernel_dilation"):
        if _pairs(getattr(layer, name, None)) != (1, 1):
            return f"{name} {getattr(layer, name)}"
    if _pairs(layer.strides) is None:
        return f"strides {layer.strides}"
    if _padding(layer.padding) is None:
        return f"padding {layer.padding!r}"
    return None


def _chosen(
    layers: Sequence[_Layer], config: FactorConfig, model: str, others: Sequence[str] = ()
) -> list[str]:
    """The paths of ``layers`` (in the order the model runs them) to factorize.

    Raises:
      ValueError: none, with each layer's reason.
    """
    ends = {layers[0].path, layers[-1].path} if config.keep_first_last and layers else set()
    why: dict[str, str] = {}
    for layer in layers:
        if layer.unsupported:
            why[layer.path] = layer.unsupported
        elif layer.path in ends and not layer.stacked:
            why[layer.path] = "first or last layer"
        elif config.layers and not any(re.search(p, layer.path) for p in config.layers):
            why[layer.path] = f"not matched by layers={list(config.layers)}"
    chosen = [layer.path for layer in layers if layer.path not in why]
    if not chosen:
        kept = "; ".join(f"{path}: {reason}" for path, reason in why.items())
        raise ValueError(
            f"factorize found no layer of {model} to factorize: "
            + (kept if kept else "it has no Dense / Linear / Conv layer")
            + (
                f" (layers of other classes are not replaced: {', '.join(others)})"
                if others
                else ""
            )
        )
    return chosen


# --- Linen --------------------------------------------------------------------------------------


def _linen_layer_call(target: nn.Module, config: FactorConfig, args, kwargs):
    """``target``'s call as its factorized layer, in ``target``'s own scope (its parameters
    ``first`` / ... / ``last`` [+ ``bias``] where the ``kernel`` was)."""
    common = dict(
        use_bias=target.use_bias,
        dtype=target.dtype,
        param_dtype=target.param_dtype,
        kernel_init=target.kernel_init,
        bias_init=target.bias_init,
        config=config,
        name=target.name,
    )
    if isinstance(target, nn.Conv):
        layer = FactorizedConv(
            features=target.features,
            kernel_size=tuple(target.kernel_size),
            strides=_pairs(target.strides),
            padding=_padding(target.padding),
            **common,
        )
    else:
        layer = LowRankDense(target.features, **common)
    nn.share_scope(target, layer)
    return layer(*args, **kwargs)


def _linen_layers(
    base: type, fields: dict, rng_names, args, kwargs
) -> tuple[list[_Layer], list[str]]:
    """The Dense / Conv layers ``base(**fields)`` runs on ``args``, in order (traced by
    ``jax.eval_shape``: nothing runs), and the other classes whose modules hold a ``kernel``
    parameter (a model's own dense layer, such as GPT-2's ``FlaxConv1D``)."""
    seen: dict[str, tuple[nn.Module, str]] = {}
    classes: dict[str, str] = {}

    def recorder(next_fun, args, kwargs, context):
        target = context.module
        path = "/".join(target.path)
        if context.method_name == "__call__":
            classes.setdefault(path, type(target).__name__)
            if type(target) in LINEN_LAYERS:
                unsupported = _unsupported(target)
                if not target.path:  # its own .apply inside the model: a tied weight
                    path = f"{type(target).__name__}.apply"
                    unsupported = "applied to parameters the model passes it (a tied weight)"
                seen.pop(path, None)  # ordered by the last call: a reused layer runs last there
                seen[path] = (target, unsupported)
        return next_fun(*args, **kwargs)

    shapes = linen_wrap.traced_init(base, fields, rng_names, args, kwargs, recorder)
    params = nn.meta.unbox(shapes.get("params", {}))
    layers = []
    for path, (target, unsupported) in seen.items():
        node = params
        for key in path.split("/"):
            node = node.get(key, {}) if isinstance(node, dict) else {}
        kernel = node.get("kernel") if isinstance(node, dict) else None
        rank = 2 + (len(target.kernel_size) if isinstance(target, nn.Conv) else 0)
        stacked = kernel is not None and kernel.ndim > rank
        layers.append(_Layer(path, type(target).__name__, stacked, unsupported))
    kernels = {
        "/".join(str(getattr(k, "key", k)) for k in where[:-1])
        for where, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        if str(getattr(where[-1], "key", "")) == "kernel"
    }
    others = sorted({classes[p] for p in kernels - set(seen) if p in classes})
    return layers, others


def _factorize_linen(module: nn.Module, config: FactorConfig) -> nn.Module:
    base = type(module)

    def call(self, *args, **kwargs):
        fields = linen_wrap.fields(self)
        chosen: set[str] | None = None
        if self.is_initializing():
            found = _linen_layers(base, fields, tuple(self.scope.rngs), args, kwargs)
            chosen = set(_chosen(*found[:1], config, base.__name__, found[1]))

        def interceptor(next_fun, args, kwargs, context):
            target = context.module
            if context.method_name != "__call__" or type(target) not in LINEN_LAYERS:
                return next_fun(*args, **kwargs)
            if chosen is None:  # apply: the stored parameters say which layers are factorized
                factored = "first" in target.variables.get("params", {})
            else:
                factored = "/".join(target.path) in chosen
            if not factored:
                return next_fun(*args, **kwargs)
            return _linen_layer_call(target, config, args, kwargs)

        with nn.intercept_methods(interceptor):
            return base.__call__(self, *args, **kwargs)

    return linen_wrap.with_call(module, call, ("factorize", config))


# --- NNX ----------------------------------------------------------------------------------------


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` of an NNX graph node (a module, an ``nnx.List``, ...) in the order they
    were assigned; ``[]`` for a leaf."""
    if not nnx.graph.is_node(node):
        return []
    children = nnx.graph.get_node_impl(node).node_dict(node)
    order = {key: i for i, key in enumerate(getattr(node, "__dict__", {}))}

    def assigned(key):
        return order.get(key, order.get(str(key), len(order))), str(key)

    return [(key, children[key]) for key in sorted(children, key=assigned)
            if not str(key).startswith("_pytree__")]  # fmt: skip


def _nnx_layers(module: nnx.Module) -> list[tuple[str, Any, Any, nnx.Module]]:
    """``(path, parent, key, layer)`` of every ``nnx.Linear`` / ``nnx.Conv`` in assignment
    order (each layer once)."""
    found: list[tuple[str, Any, Any, nnx.Module]] = []
    seen: set[int] = set()

    def walk(node, path):
        for key, child in _children(node):
            if id(child) in seen or not nnx.graph.is_node(child):
                continue
            seen.add(id(child))
            where = (*path, str(key))
            if type(child) in NNX_LAYERS:
                found.append(("/".join(where), node, key, child))
            else:
                walk(child, where)

    walk(module, ())
    return found


def _nnx_factorized(layer: nnx.Module, config: FactorConfig, path: str) -> NNXFactorized:
    kernel = layer.kernel[...]
    conv = isinstance(layer, nnx.Conv)
    rank = 4 if conv else 2
    lead = kernel.shape[: kernel.ndim - rank]
    shape = kernel.shape[kernel.ndim - rank :]
    method = layer_method(config.method, shape)
    ranks = config.ranks_for(shape, path)
    key = jax.random.key(zlib.crc32(path.encode()))

    def decompose(k):
        return factorize_kernel(config, method, k.astype(jnp.float32), ranks, key)

    for _ in lead:
        decompose = jax.vmap(decompose)
    factors = {
        name: value.astype(kernel.dtype)
        for name, value in decompose(kernel).items()
        if name in factor_shapes(method, shape, ranks)
    }
    bias = layer.bias if getattr(layer, "use_bias", False) else None
    metadata = _factor_metadata(layer.kernel, method, len(lead))
    if not conv:
        return NNXFactorized(method, factors, bias, dtype=layer.dtype, metadata=metadata)
    return NNXFactorized(
        method,
        factors,
        bias,
        metadata=metadata,
        kernel_size=tuple(layer.kernel_size),
        strides=_pairs(layer.strides),
        padding=_padding(layer.padding),
        dtype=layer.dtype,
    )


def _factor_metadata(kernel: nnx.Param, method: str, stacked: int) -> dict[str, dict]:
    """Each factor's ``nnx.Param`` metadata: the kernel's, with its partitioning names
    (``out_sharding``, from ``nnx.with_partitioning``) mapped to the factors by
    :func:`~lowmem_jax.techniques.factorize.layers.factor_names` (a layer axis keeps its name)."""
    metadata = {k: v for k, v in kernel.get_metadata().items() if k not in ("hijax", "ref")}
    names = metadata.get("out_sharding")
    if names is None:
        return dict.fromkeys(FACTOR_NAMES[method], metadata)
    lead, inner = tuple(names[:stacked]), tuple(names[stacked:])
    return {
        name: {**metadata, "out_sharding": (*lead, *factor)}
        for name, factor in factor_names(method, inner).items()
    }


def _factorize_nnx(module: nnx.Module, config: FactorConfig) -> nnx.Module:
    order = [path for path, *_ in _nnx_layers(module)]  # a copy's attributes are sorted
    module = nnx.clone(module)  # the user's module stays as it was
    by_path = {entry[0]: entry for entry in _nnx_layers(module)}
    found = [by_path[path] for path in order]
    layers = [
        _Layer(
            path,
            type(layer).__name__,
            layer.kernel[...].ndim > (4 if isinstance(layer, nnx.Conv) else 2),
            _unsupported(layer)
            or (
                None
                if isinstance(nnx.graph.get_node_impl(parent), nnx.graph.GraphNodeImpl)
                else f"held in a {type(parent).__name__}"
            ),  # fmt: skip
        )
        for path, parent, _, layer in found
    ]
    chosen = set(_chosen(layers, config, type(module).__name__))
    for path, parent, key, layer in found:
        if path in chosen:
            nnx.graph.get_node_impl(parent).set_key(
                parent, key, _nnx_factorized(layer, config, path)
            )
    return module
