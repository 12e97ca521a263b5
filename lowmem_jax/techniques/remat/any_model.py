"""Remat for a model without a ``remat`` attribute (any Linen or NNX model): every call of its
blocks under its own checkpoint (:func:`remat_module`), and the check that a ``save:`` policy
names tags the model makes (:func:`check_saved_names`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import flax.linen as nn
from flax import nnx

from lowmem_jax.blocks import discovery as blocks_lib
from lowmem_jax.blocks.checkpoint import INSIDE_BLOCK, checkpointed_call
from lowmem_jax.blocks.policy import RematSpec, parse_policy
from lowmem_jax.core import linen_wrap
from lowmem_jax.core.jaxprs import traced_equations

__all__ = ["remat_module", "tagged_names", "check_saved_names", "ModuleT"]

ModuleT = TypeVar("ModuleT", nn.Module, nnx.Module)


def remat_module(module: ModuleT, remat: str | RematSpec, blocks: Sequence[str] = ()) -> ModuleT:
    """Any Linen or NNX module (one without a ``remat`` attribute) with the policy ``remat``.

    ``blocks=()``: the module's whole ``__call__`` under one ``jax.checkpoint``. With a single
    checkpointed region the backward pass recomputes the forward and then holds every residual
    it needs at once, so this alone costs compute without lowering peak memory; it is the
    building block, not the saving. ``blocks=("Block", ...)``: every call of a submodule whose
    class is named in ``blocks`` runs under its own checkpoint (Flax's lifted ``nn.remat`` via
    ``nn.intercept_methods`` for Linen, ``nnx.remat`` for NNX): only the blocks' inputs (and
    what the policy saves) stay between forward and backward, as with the bundled models'
    per-block remat. A block called inside another named block is not checkpointed again.
    Of a checkpointed call's arguments only the arrays are traced: flags such as ``train`` or
    ``deterministic`` stay Python values, passed by keyword or positionally
    (:func:`~lowmem_jax.blocks.checkpoint.checkpointed_call`). ``blocks="auto"``
    (:data:`lowmem_jax.blocks.discovery.AUTO_BLOCKS`, what ``Plan`` uses when ``remat_blocks``
    is empty): the model's repeated blocks, found by
    :func:`lowmem_jax.blocks.discovery.repeated_blocks`
    (Linen: from the calls of a traced forward, each time the model is traced; NNX: from its
    graph, here); where it has none, the whole forward with a warning that it lowers nothing.

    Parameters, BatchNorm statistics and dropout keys keep their structure and values. Linen:
    the result is an instance of a subclass of ``type(module)`` with the same fields. NNX: a
    copy (``nnx.clone``) whose named submodules (or the module itself) are instances of such
    subclasses; ``module`` is left as it was.

    Raises:
      ValueError: for a segmenting policy (``every:K``, ``sqrt``) or a ``blocks:`` schedule,
        which need stacks of blocks (:class:`~lowmem_jax.ScannedBlocks`); for a name in
        ``blocks`` that is not the class of a submodule the model has (NNX: here) or calls
        (Linen: when it is called).
    """
    spec = parse_policy(remat)
    if not spec.enabled:
        return module
    if spec.segment or spec.schedule:
        raise ValueError(
            f"remat={spec.name!r} needs the scanned block stacks of a model with a `remat` "
            f"attribute; {type(module).__name__} has none (use full, dots or save:NAME)"
        )
    auto = isinstance(blocks, str) and blocks == blocks_lib.AUTO_BLOCKS
    if isinstance(module, nnx.Module):
        names = blocks_lib.nnx_blocks(module) if auto else tuple(blocks)
        if auto and not names:
            warnings.warn(
                blocks_lib.no_blocks_warning(type(module).__name__, spec.name), stacklevel=3
            )
        return _remat_nnx_module(module, spec.policy, names)
    cls, names = type(module), () if auto else tuple(blocks)

    if auto:

        def call(self, *args, **kwargs):
            fields = linen_wrap.fields(self)
            found = blocks_lib.linen_blocks(cls, fields, tuple(self.scope.rngs), args, kwargs)
            if not found:
                warnings.warn(blocks_lib.no_blocks_warning(cls.__name__, spec.name), stacklevel=2)
                return checkpointed_call(nn.remat, self, cls, args, kwargs, spec.policy)
            return _call_with_blocks(self, cls, found, spec.policy, args, kwargs)

    elif names:

        def call(self, *args, **kwargs):
            return _call_with_blocks(self, cls, names, spec.policy, args, kwargs)

    else:

        def call(self, *args, **kwargs):
            return checkpointed_call(nn.remat, self, cls, args, kwargs, spec.policy)

    return linen_wrap.with_call(module, call, ("remat", str(spec), names, auto))


def _call_with_blocks(module, cls: type, names: tuple[str, ...], policy, args, kwargs):
    """``cls.__call__(module, ...)`` with every call of a submodule whose class is in ``names``
    under its own checkpoint (Flax's lifted ``nn.remat``, via ``nn.intercept_methods``)."""
    called: set[str] = set()

    def interceptor(next_fun, a, k, context):
        target = context.module
        called.add(type(target).__name__)
        if (
            context.method_name != "__call__"
            or type(target).__name__ not in names
            or INSIDE_BLOCK.get()
        ):
            return next_fun(*a, **k)
        return checkpointed_call(nn.remat, target, type(target), a, k, policy)

    with nn.intercept_methods(interceptor):
        out = cls.__call__(module, *args, **kwargs)
    _check_block_names(names, cls.__name__, called - {cls.__name__}, "calls")
    return out


def _check_block_names(names: tuple[str, ...], model: str, classes: set[str], verb: str) -> None:
    missing = [n for n in names if n not in classes]
    if missing:  # else the policy would silently checkpoint nothing
        raise ValueError(
            f"remat_blocks names {missing}, which {model} never {verb}; its submodule "
            f"classes: {sorted(classes)}"
        )


def _remat_nnx_module(module: nnx.Module, policy, names: tuple[str, ...]) -> nnx.Module:
    """An ``nnx.clone`` of ``module`` whose submodules of the classes in ``names`` (or, for
    ``names=()``, the module itself) run ``__call__`` under ``nnx.remat``.

    The instances' classes are swapped for subclasses
    (:func:`lowmem_jax.core.linen_wrap.swap_calls`)."""
    module = nnx.clone(module)
    submodules = [s for path, s in nnx.iter_graph(module) if path and isinstance(s, nnx.Module)]
    _check_block_names(names, type(module).__name__, {type(s).__name__ for s in submodules}, "has")
    targets = [s for s in submodules if type(s).__name__ in names] if names else [module]

    def make_call(cls):
        def call(self, *args, **kwargs):
            if INSIDE_BLOCK.get():
                return cls.__call__(self, *args, **kwargs)
            return checkpointed_call(nnx.remat, self, cls, args, kwargs, policy)

        return call

    linen_wrap.swap_calls(targets, make_call)
    return module


def tagged_names(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The names ``fn(*args)`` tags with ``checkpoint_name`` (traced)."""
    return {e.params["name"] for e in traced_equations(fn, *args) if e.primitive.name == "name"}


def check_saved_names(remat: str | RematSpec, tagged: set[str]) -> None:
    """Raises ValueError when a ``save:`` policy names a tag that ``tagged`` (the model's, see
    :func:`tagged_names`) lacks: such a policy would silently save nothing, i.e. act as
    ``full``."""
    spec = parse_policy(remat)
    missing = [n for n in spec.saved_names if n not in tagged]
    if missing:
        raise ValueError(
            f"remat={spec.name!r} keeps {missing}, which the model never tags "
            f"with checkpoint_name; the model tags: {sorted(tagged) or 'nothing'}"
        )
