"""A factored second moment (``second_moment="factored"``): the optimizer's second moment of each
matrix (and of each stack of matrices) stored as its row and column means, Adafactor's
statistics (Shazeer & Stern 2018), around any optax transformation that keeps one.

For a second moment ``V`` of shape ``[..., n, m]`` (its last two axes; a convolution kernel's
``[H, W, C_in, C_out]`` gives ``C_in x C_out`` per tap) the stored form is
:class:`Factored`::

    rows = mean(V, axis=-1)  [..., n, 1]        cols = mean(V, axis=-2)  [..., 1, m]
    V_hat = rows * cols / mean(rows, axis=-2)   [..., n, m]   (rank one per matrix)

``n * m`` float32 numbers become ``n + m``. The update is Li, Chen and Zhu's (2023, Algorithm 1)
compression framework with this factorization as its compression: the inner optimizer runs on
the decoded state (``V_hat``), and its new second moment is stored factored again::

    V_t = beta2 * V_hat_{t-1} + (1 - beta2) * g_t**2      (the inner optimizer's own rule)
    update from V_t;  store rows(V_t), cols(V_t)

Row and column means are linear and ``V_hat`` keeps its factors' means, so the stored
statistics are exactly Adafactor's and the 4-bit paper's (``rows_t = beta2 * rows_{t-1} +
(1 - beta2) * mean(g_t**2, -1)``). Adafactor and the paper's factored AdamW divide by ``V_hat_t``
(the factored new moment) instead of ``V_t``: a wrapper cannot, since only the inner optimizer
knows ``beta2``; the two differ by ``(1 - beta2) * (g_t**2 - its rank-one part)`` under the
square root. Where the second moment is rank one (``g_t = s_t * a b^T``) the step equals the
inner optimizer's, exactly.

A leaf is a second moment when its path in the state names one of
:data:`lowmem_jax.codecs.state_format.SECOND_MOMENTS` (optax's ``nu``, Adagrad's
``sum_of_squares``), as the low-bit state reads them; it is factored when
it has two or more axes and ``n + m < n * m``. An optimizer with none (SGD) is refused in one
line. Sparse training resets single entries of a regrown weight's slots, which a factored moment
does not hold: refused too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.codecs import leafwise
from lowmem_jax.codecs.state_format import names_second_moment

__all__ = [
    "FORMATS",
    "Factored",
    "FactoredState",
    "factored_second_moment",
    "factored_leaves",
    "second_moments",
]


FORMATS = ("none", "factored")


@leafwise.unit  # one parameter's moment: a low-bit state updates it with its parameter's group
class Factored(NamedTuple):
    """A second moment ``V`` of shape ``[..., n, m]`` as ``rows`` (``[..., n, 1]``, the mean of
    each row) and ``cols`` (``[..., 1, m]``, of each column), float32."""

    rows: jax.Array
    cols: jax.Array

    def decode(self) -> jax.Array:
        """``rows * cols / mean(rows)`` per matrix: ``[..., n, m]``, rank one, with the stored
        row and column means (zero where the moment is zero)."""
        mean = jnp.mean(self.rows, axis=-2, keepdims=True)
        return self.rows * self.cols / jnp.maximum(mean, jnp.finfo(jnp.float32).tiny)


class FactoredState(NamedTuple):
    """``inner_state``: the inner optimizer's state, each factored second moment a
    :class:`Factored`."""

    inner_state: Any


def _factors(path, x) -> bool:
    if not (hasattr(x, "ndim") and x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)):
        return False
    n, m = x.shape[-2:]
    return names_second_moment(path) and n + m < n * m


def _encode(state: Any) -> Any:
    def leaf(path, x):
        if not _factors(path, x):
            return x
        x = x.astype(jnp.float32)
        return Factored(jnp.mean(x, axis=-1, keepdims=True), jnp.mean(x, axis=-2, keepdims=True))

    return jax.tree_util.tree_map_with_path(leaf, state)


def _decode(stored: Any) -> Any:
    is_factored = lambda x: isinstance(x, Factored)  # noqa: E731
    return jax.tree.map(lambda x: x.decode() if is_factored(x) else x, stored, is_leaf=is_factored)


def factored_second_moment(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its second moments stored factored (module docstring); an optax
    transformation whose state is a :class:`FactoredState`."""

    def init(params):
        return FactoredState(_encode(tx.init(params)))

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, _decode(state.inner_state), params)
        return updates, FactoredState(_encode(inner))

    return optax.GradientTransformation(init, update)


def factored_leaves(state: Any) -> list[Factored]:
    """The :class:`Factored` nodes of a (stored) state."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Factored))
    return [x for x in leaves if isinstance(x, Factored)]


def second_moments(tx, params) -> int:
    """How many leaves of ``tx``'s state on ``params`` (arrays or shapes) would be factored."""
    shapes = jax.eval_shape(tx.init, params)
    found = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return sum(_factors(path, x) for path, x in found)
