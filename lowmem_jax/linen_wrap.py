"""A user's Linen model with another ``__call__``, without edits to its code: what
:func:`lowmem_jax.remat.remat_module` and :func:`lowmem_jax.factorization.factorize_module` do
to a Linen model (each ``call`` runs the model's own ``__call__`` under ``nn.intercept_methods``).

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

__all__ = ["fields", "with_call", "traced_init"]


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
