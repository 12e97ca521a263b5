"""Token cross-entropy from the output projection's input, a chunk of tokens at a time.

For hidden states ``h [N, C]``, the head's kernel ``W [C, V]`` and targets ``y [N]``,

    logits_n = h_n W,    nll_n = logsumexp(logits_n) - logits_n[y_n]

is computed over chunks of ``c`` tokens in a ``lax.map`` whose body is a ``jax.checkpoint``: the
forward pass keeps only each chunk's inputs, and the backward pass recomputes that chunk's
``[c, V]`` logits, forms ``softmax - onehot``, and adds its share to ``dW`` (``h_c^T dlogits``, a
``[C, V]`` float32 sum carried by the loop) and to ``dh_c`` (``dlogits W^T``). The ``[N, V]``
logits never exist: at most one chunk's logits and their cotangent, ``2 c V`` float32 values,
live at once (Cut Cross-Entropy's and Liger's fused linear cross-entropy's idea, in pure JAX:
every backend, no kernel). The chunks are computed in the loop's order, so the result equals the
whole-logits computation within float32 rounding (``tests/test_loss_chunk.py``: loss and
gradients to 1e-5 relative).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["chunked_token_losses"]


def chunked_token_losses(
    hidden: jax.Array, kernel: jax.Array, labels: jax.Array, chunk: int, *, dtype: Any = None
) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(nll, correct)`` of ``softmax(hidden @ kernel)`` against ``labels``.

    Args:
      hidden: ``[..., C]``, the head's input (any float dtype).
      kernel: ``[C, V]``, the head's kernel (no bias).
      labels: ``[...]`` int, in ``[0, V)``.
      chunk: tokens per chunk, ``>= 1`` (the last chunk is padded and the padding dropped).
      dtype: the projection's computation dtype (``None``: ``hidden`` and ``kernel``'s result
        type); logits are taken to float32 for the softmax.

    Returns:
      ``nll`` float32 ``[...]`` and ``correct`` bool ``[...]`` (``argmax(logits) == label``).

    Raises:
      ValueError: ``chunk < 1``, or shapes that do not match.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    if kernel.ndim != 2 or hidden.shape[-1] != kernel.shape[0] or hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden [..., C], kernel [C, V] and labels [...] do not match: {hidden.shape}, "
            f"{kernel.shape}, {labels.shape}"
        )
    lead, width = labels.shape, hidden.shape[-1]
    n = labels.size
    chunk = min(chunk, n)  # never more than the tokens there are
    pad = -n % chunk
    dtype = dtype or jnp.result_type(hidden, kernel)
    h = jnp.pad(hidden.reshape(n, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    y = jnp.pad(labels.reshape(n), (0, pad)).reshape(-1, chunk)
    w = kernel.astype(dtype)

    @jax.checkpoint  # the chunk's logits are recomputed in the backward pass, not saved
    def one(h_c: jax.Array, y_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.dot(h_c.astype(dtype), w, preferred_element_type=jnp.float32)
        target = jnp.take_along_axis(logits, y_c[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target
        return nll, jnp.argmax(logits, axis=-1) == y_c

    nll, correct = jax.lax.map(lambda xs: one(*xs), (h, y))
    return nll.reshape(-1)[:n].reshape(lead), correct.reshape(-1)[:n].reshape(lead)
