"""Decompose, then fine-tune (Lebedev et al. 2015, Kim et al. 2016): a run of a factorized
model that starts from a trained dense model's variables (``lowmem train --decompose-from
DIR``), as the factorize technique's :class:`~lowmem_jax.core.technique.WarmStart`: the ranks
its ``rank_rule`` chooses from the dense weights, then the factors decomposed from them
(:func:`~lowmem_jax.techniques.factorize.convert.decompose_params`; BatchNorm statistics copied).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowmem_jax.core.technique_hooks import WarmStart
from lowmem_jax.techniques.factorize.convert import decompose_params
from lowmem_jax.techniques.factorize.ranks import select_ranks

__all__ = ["DECOMPOSE"]


def _check(plan: Any, source: str | None) -> None:
    factorize = plan.factorize
    if source and factorize is None:
        raise ValueError(
            "decompose_from needs a plan with factorized layers (--factorize cp|tucker|lowrank)"
        )
    if (
        factorize is not None
        and factorize.rank_rule != "compression"
        and not (source or factorize.ranks)
    ):
        raise ValueError(
            f"rank_rule={factorize.rank_rule!r} chooses ranks from a trained dense model: "
            "it needs decompose_from (--decompose-from DIR)"
        )


def _plan_with_ranks(work: Any, plan: Any, variables: dict[str, Any]) -> Any:
    """``plan`` with the ranks its ``rank_rule`` chooses from the dense ``variables`` (unchanged
    for ``compression``); where the factorized layers are comes from the model at compression
    ranks.

    Raises:
      ValueError: ``"not a dense <model>: ..."``, variables of another model.
    """
    factorize = plan.factorize
    if factorize is None or factorize.rank_rule == "compression":
        return plan
    placeholder = dataclasses.replace(factorize, rank_rule="compression")
    model = dataclasses.replace(plan, factorize=placeholder).configure_model(work.model)
    layer_shapes = work.variable_shapes(model)["params"]
    try:
        factorize = select_ranks(variables["params"], layer_shapes, factorize)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not a dense {work.name}: {err}") from None
    return dataclasses.replace(plan, factorize=factorize)


def _decomposed(setup: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """The factorized model's variables from the dense ``variables``.

    Raises:
      ValueError: ``"not a dense <model>: ..."``, variables of another model.
    """
    shapes = setup.abstract_variables()
    dense_state = {k: v for k, v in variables.items() if k != "params"}
    try:
        return {
            "params": decompose_params(variables["params"], shapes["params"], setup.plan.factorize),
            **decompose_params(
                dense_state, {k: v for k, v in shapes.items() if k != "params"}, None
            ),
        }
    except ValueError as err:
        raise ValueError(f"not a dense {setup.workload.name}: {err}") from None


def _describe(plan: Any, source: str) -> str:
    factorize = plan.factorize
    ranks = "" if factorize.rank_rule == "compression" else f", ranks by {factorize.rank_rule}"
    return f"decomposed {source} ({factorize.method}{ranks})"


#: The factorize technique's warm start.
DECOMPOSE = WarmStart(
    check=_check,
    plan=lambda work, plan, variables: (
        plan if plan.factorize is None else _plan_with_ranks(work, plan, variables)
    ),
    variables=_decomposed,
    describe=_describe,
)
