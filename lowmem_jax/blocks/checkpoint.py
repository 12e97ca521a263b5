"""A block's call under its own checkpoint, with Flax's lifted remat (the parameters and
collections keep their structure), and whether a call is already inside one (:data:`INSIDE_BLOCK`:
a block inside a block, or a layer inside a checkpointed block, is not wrapped again)."""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

import jax
import numpy as np

__all__ = ["INSIDE_BLOCK", "checkpointed_call"]

# Set while a block's call runs under its checkpoint, so that a block inside a block is not
# wrapped again.
INSIDE_BLOCK = contextvars.ContextVar("lowmem_remat_inside_block", default=False)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def checkpointed_call(lifted_remat, module, cls: type, args: tuple, kwargs: dict, policy) -> Any:
    """``cls.__call__(module, *args, **kwargs)`` under Flax's lifted remat (``nn.remat`` or
    ``nnx.remat``: parameters and collections keep their structure).

    Only arrays are traced: keyword arguments are closed over, and so are the Python values and
    NumPy scalars among the positional ones (``deterministic``, ``init_cache``, ``None``: what
    a model's own checkpointing declares with ``static_argnums``, as transformers' BERT does),
    so a block may branch on its flags however it is called.

    Raises:
      ValueError: the block converts a traced argument to a Python value (a flag passed as an
        array), naming its scalar array arguments.
    """
    leaves, tree = jax.tree.flatten(args)
    traced = [i for i, x in enumerate(leaves) if _is_array(x)]

    def body(mdl, *arrays):
        merged = list(leaves)
        for i, x in zip(traced, arrays, strict=True):
            merged[i] = x
        token = INSIDE_BLOCK.set(True)
        try:
            return cls.__call__(mdl, *jax.tree.unflatten(tree, merged), **kwargs)
        except jax.errors.ConcretizationTypeError as e:
            raise ValueError(_traced_flag_message(cls, module, args)) from e
        finally:
            INSIDE_BLOCK.reset(token)

    return lifted_remat(body, policy=policy)(module, *(leaves[i] for i in traced))


def _traced_flag_message(cls: type, module: Any, args: tuple) -> str:
    try:
        bound = inspect.signature(cls.__call__).bind_partial(module, *args).arguments
    except TypeError:
        bound = {f"argument {i}": a for i, a in enumerate(args, start=1)}
    scalars = [name for name, a in bound.items() if _is_array(a) and np.ndim(a) == 0]
    return (
        f"remat of {cls.__name__}: its call needs a Python value where it got an array "
        f"(scalar array arguments: {', '.join(scalars) or 'none'}); pass flags such as "
        "`deterministic` as Python bools"
    )
