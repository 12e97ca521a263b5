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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowmem_jax.codecs import leafwise
from lowmem_jax.codecs.quantization import Quantized
from lowmem_jax.codecs.state_format import SECOND_MOMENTS, names_second_moment
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict

__all__ = ["TECHNIQUE", "Factored", "FactoredState", "factored_second_moment"]

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


def _validate(plan) -> None:
    if plan.second_moment not in FORMATS:
        raise ValueError(
            f"Unknown second_moment={plan.second_moment!r}; allowed values: {list(FORMATS)}"
        )
    if plan.second_moment != "none" and plan.sparsity is not None:
        raise ValueError(
            f"second_moment={plan.second_moment!r} does not combine with sparsity: sparse "
            "training resets single entries of a regrown weight's optimizer slots, which a "
            "factored moment does not hold"
        )


def _second_moments(tx, params) -> int:
    """How many leaves of ``tx``'s state on ``params`` (arrays or shapes) would be factored."""
    shapes = jax.eval_shape(tx.init, params)
    found = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return sum(_factors(path, x) for path, x in found)


def _inner_optimizer(tx, plan, params):
    """Innermost, so that a stored format (``optimizer_state``) stores the factors."""
    if plan.second_moment == "none":
        return tx
    if params is not None and not _second_moments(tx, params):
        raise ValueError(
            f"second_moment={plan.second_moment!r}: the optimizer's state has no second moment "
            "of two or more axes to factor (a leaf under a field named "
            f"{' or '.join(SECOND_MOMENTS)}, as Adam's; SGD keeps none)"
        )
    return factored_second_moment(tx)


def _took_effect(evidence, plan):
    """How many second moments are stored factored, and their bytes against the dense ones."""
    if plan.second_moment == "none":
        return None
    found = factored_leaves(evidence.state.opt_state)
    # The factors as stored: float32, or in a low-bit state's format (codes and scales).
    stored = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(found))
    dense = sum(np.prod(_shape(f.rows)) * _shape(f.cols)[-1] for f in found) * 4
    return Verdict(
        "second_moment",
        bool(found),
        f"{len(found)} second moments stored factored: {dense / 2**20:.2f} MiB as "
        f"{stored / 2**20:.3f} MiB of row and column means",
    )


def _shape(factor) -> tuple[int, ...]:
    """A factor's shape, stored float32 or quantized (whose codes are flat)."""
    return factor.meta.shape if isinstance(factor, Quantized) else factor.shape


def _rows(context):
    """Its row in `lowmem report`, where the workload's optimizer keeps a second moment."""
    optimizer = context.optimizer
    probe = {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    if optimizer is None or not _second_moments(optimizer, probe):
        return []
    return [("second moment factored", {"second_moment": "factored"})]


TECHNIQUE = Technique(
    name="second_moment",
    # Order: acts on the user's optimizer, innermost (inside the stored format)
    order=55,
    fields=(
        PlanField(
            "second_moment",
            str,
            "none",
            "how the optimizer's second moments are stored: ``none`` (as the optimizer keeps "
            "them) or ``factored`` (each matrix as its row and column means, Adafactor's "
            "statistics; :mod:`lowmem_jax.techniques.second_moment`).",
            help="store the optimizer's second moments (Adam's nu) factored: each matrix as its "
            "row and column means (Adafactor's statistics), n x m floats as n + m; the update "
            "runs on the decoded moment",
            choices=FORMATS,
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.second_moment == "none" else "second moment factored",
    inner_optimizer=_inner_optimizer,
    # Not in the technical report; its accuracy is not measured here.
    envelope=EnvelopeRule(
        "second_moments",
        {"report": ("none",), "any": FORMATS},
        lambda config, limit: (
            None
            if config.get("second_moment", "none") in limit
            else f"second moment {config['second_moment']}"
        ),
        lambda limit: "second moments whole" if list(limit) == ["none"] else "",
    ),
    # A storage axis outside the default space: only searched where a search names it.
    axis=Axis(
        "second_moment",
        FORMATS,
        plan_fields=lambda value: {"second_moment": value},
        within=lambda value, limit, batch_size: value in limit,
        own_ratio=True,
        corner="last",
        in_default_space=False,
    ),
    report_rows=rows_of("optimizer state", 55, "second moment factored", _rows),
    took_effect=_took_effect,
)
