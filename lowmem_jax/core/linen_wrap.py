"""A user's Linen model with another ``__call__``, without edits to its code: what
:func:`lowmem_jax.techniques.remat.remat_module` and
:func:`lowmem_jax.techniques.factorize.factorize_module` do to a Linen model (each ``call`` runs the
model's own ``__call__`` under ``nn.intercept_methods``). :func:`swap_calls` is the same for an NNX
model's submodules (remat, :mod:`lowmem_jax.blocks.lazy_layers`).

:func:`with_call` makes an instance of a subclass of the model's class, with the model's fields
and ``call`` as its ``__call__`` (``isinstance`` still holds; parameters keep their names).
:func:`traced_init` traces such a model's ``init`` under an interceptor, to find the submodules
it calls before it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import flax.linen as nn
import jax

__all__ = ["fields", "with_call", "swap_calls", "traced_init"]


def fields(module: nn.Module) -> dict[str, Any]:
    """``module``'s dataclass fields (its configuration), without Linen's ``parent`` and
    ``name``: ``type(module)(**fields(module))`` is an unbound copy of it."""
    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(module)
        if f.name not in ("parent", "name")
    }


def with_call(module: nn.Module, call: Callable[..., Any], key: Hashable) -> nn.Module:
    """An instance of a subclass of ``type(module)`` (same name and ``__module__``) with
    ``module``'s :func:`fields` and ``call(self, *args, **kwargs)`` as its ``__call__``.

    ``key``: everything ``call`` depends on besides ``self`` (``call`` reads the module's
    fields from ``self``). The subclass is made once per ``(type(module), key)``, so wrapping
    equal modules twice gives equal, equally hashed models: what a search that configures the
    same model for many plans needs for its caches (traced variable shapes) to hit.
    """
    cls = type(module)
    wrapped = _SUBCLASSES.get((cls, key))
    if wrapped is None:
        wrapped = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__})
        _SUBCLASSES[cls, key] = wrapped
    return wrapped(**fields(module))


_SUBCLASSES: dict[tuple[type, Hashable], type] = {}


def swap_calls(modules: Iterable[Any], make_call: Callable[[type], Callable[..., Any]]) -> None:
    """Swaps the class of each NNX module in ``modules`` (in place) for a subclass whose
    ``__call__`` is ``make_call(cls)`` (made once per class, with the same name, module and
    qualified name), so ``nnx.split`` / ``nnx.merge`` keep the new call and ``isinstance``
    still holds."""
    swapped: dict[type, type] = {}
    for module in modules:
        cls = type(module)
        if cls not in swapped:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            swapped[cls] = type(cls.__name__, (cls,), {"__call__": make_call(cls), **namespace})
        module.__class__ = swapped[cls]


def traced_init(
    cls: type,
    attributes: dict[str, Any],
    rng_names: Iterable[str],
    args: tuple,
    kwargs: dict,
    interceptor: Callable[..., Any],
) -> Any:
    """The shapes of the variables ``cls(**attributes).init`` makes on ``args`` and ``kwargs``,
    traced (``jax.eval_shape``: nothing runs) under ``nn.intercept_methods(interceptor)``;
    ``rng_names``: the RNG streams it gets (``params`` always)."""
    rngs = {name: jax.random.key(0) for name in {"params", *rng_names}}
    with nn.intercept_methods(interceptor):
        return jax.eval_shape(lambda: cls(**attributes, parent=None).init(rngs, *args, **kwargs))
