"""A factored second moment (``second_moment="factored"``): the optimizer's second moment of each
matrix stored as its row and column means, Adafactor's statistics, around any optax
transformation that keeps one (:mod:`.factored`, its math)."""

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.codecs.quantization import Quantized
from lowmem_jax.codecs.state_format import SECOND_MOMENTS
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import OptimizerHooks, ReportHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.second_moment.factored import (
    FORMATS,
    Factored,
    FactoredState,
    factored_leaves,
    factored_second_moment,
    second_moments,
)

__all__ = ["TECHNIQUE", "FORMATS", "Factored", "FactoredState", "factored_second_moment"]


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


def _inner_optimizer(tx, plan, params):
    """Innermost, so that a stored format (``optimizer_state``) stores the factors."""
    if plan.second_moment == "none":
        return tx
    if params is not None and not second_moments(tx, params):
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
        f"{len(found)} second moments stored factored: {dense / MIB:.2f} MiB as "
        f"{stored / MIB:.3f} MiB of row and column means",
    )


def _shape(factor) -> tuple[int, ...]:
    """A factor's shape, stored float32 or quantized (whose codes are flat)."""
    return factor.meta.shape if isinstance(factor, Quantized) else factor.shape


def _rows(context):
    """Its row in `lowmem report`, where the workload's optimizer keeps a second moment."""
    optimizer = context.optimizer
    probe = {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    if optimizer is None or not second_moments(optimizer, probe):
        return []
    return [("second moment factored", {"second_moment": "factored"})]


TECHNIQUE = Technique(
    name="second_moment",
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
    optimizer=OptimizerHooks(inner=_inner_optimizer),
    report=ReportHooks(
        rows=rows_of("optimizer state", "second moment factored", _rows),
        verdict=_took_effect,
    ),
)
