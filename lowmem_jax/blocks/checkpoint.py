"""A block's call under its own checkpoint, with Flax's lifted remat (the parameters and
collections keep their structure), and whether a call is already inside one (:data:`INSIDE_BLOCK`:
a block inside a block, or a layer inside a checkpointed block, is not wrapped again)."""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["INSIDE_BLOCK", "checkpointed_call"]

# Set while a block's call runs under its checkpoint, so that a block inside a block is not
# wrapped again.
INSIDE_BLOCK = contextvars.ContextVar("lowmem_remat_inside_block", default=False)


def checkpointed_call(lifted_remat, module, cls: type, args: tuple, kwargs: dict, policy) -> Any:
    """``cls.__call__(module, *args, **kwargs)`` under Flax's lifted remat (``nn.remat`` or
    ``nnx.remat``: parameters and collections keep their structure); keyword arguments are
    closed over (static flags such as ``train``), positional ones traced."""

    def body(mdl, *positional):
        token = INSIDE_BLOCK.set(True)
        try:
            return cls.__call__(mdl, *positional, **kwargs)
        finally:
            INSIDE_BLOCK.reset(token)

    return lifted_remat(body, policy=policy)(module, *args)
