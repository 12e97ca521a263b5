"""Rematerialization: the ``remat`` policy (:mod:`lowmem_jax.blocks.policy`, parsed once into a
:class:`~lowmem_jax.blocks.policy.RematSpec`) and ``remat_blocks``.

A model with a ``remat`` attribute (the bundled ones, their :class:`~lowmem_jax.ScannedBlocks`
stacks) applies the policy per block itself; any other Linen or NNX model gets
:func:`remat_module` (:mod:`.any_model`). The planner's per-block schedules: :mod:`.schedule`.
"""

import jax
from flax import nnx

from lowmem_jax.blocks.checkpoint import INSIDE_BLOCK, checkpointed_call
from lowmem_jax.blocks.discovery import AUTO_BLOCKS
from lowmem_jax.blocks.policy import (
    POLICY_NAMES,
    SCHEDULE_POLICIES,
    RematSpec,
    compiler_options,
    parse_policy,
    schedule_name,
    stack_policies,
)
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks, StepHooks, WorkloadHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.remat.any_model import check_saved_names, remat_module, tagged_names
from lowmem_jax.techniques.remat.schedule import BLOCKS

__all__ = [
    "TECHNIQUE",
    "RematSpec",
    "parse_policy",
    "POLICY_NAMES",
    "SCHEDULE_POLICIES",
    "compiler_options",
    "remat_module",
    "checkpointed_call",
    "INSIDE_BLOCK",
    "tagged_names",
    "check_saved_names",
    "schedule_name",
    "stack_policies",
]


def _validate(plan) -> None:
    if not isinstance(plan.remat_blocks, tuple) or not all(
        isinstance(n, str) and n for n in plan.remat_blocks
    ):
        raise ValueError(f"remat_blocks must be a tuple of class names, got {plan.remat_blocks!r}")


def _configure_model(model, plan):
    """A Linen model with a ``remat`` attribute (the bundled ones) applies the policy per block
    itself; any other model gets :func:`remat_module` (per block of the classes in
    ``remat_blocks``, else of the repeated blocks it finds)."""
    if isinstance(model, nnx.Module) or not hasattr(model, "remat"):
        blocks = plan.remat_blocks or AUTO_BLOCKS
        return remat_module(model, plan.remat, blocks)
    if plan.remat_blocks:
        raise ValueError(
            f"remat_blocks={plan.remat_blocks} is for models without a `remat` attribute; "
            f"{type(model).__name__} applies remat={plan.remat!r} itself"
        )
    return model.clone(remat=plan.remat)


def _check_saved_names(setup) -> None:
    """A ``save:`` policy names tags the built model makes (else it would save nothing: act as
    ``full``)."""
    if not setup.plan.remat.saved_names:
        return
    variables = setup.abstract_variables()
    model_state = {k: v for k, v in variables.items() if k != "params"}
    tagged = tagged_names(setup.loss_fn, variables["params"], model_state,
                          setup.workload.batch, jax.random.PRNGKey(0))  # fmt: skip
    check_saved_names(setup.plan.remat, tagged)


def _took_effect(evidence, plan):
    """The checkpointed regions of the step (``jax.checkpoint``), how many sit in loops, and,
    with the step's loss, the residuals one microbatch's forward pass saves with them and with
    them inlined (analytic): no region, or no fewer bytes, is no effect; so is a single region
    outside any loop (the whole forward of a model without repeated blocks): the backward pass
    recomputes it and then holds its residuals at once, so the peak does not fall although the
    residuals saved between the passes do."""
    if not plan.remat.enabled:
        return None
    names = ("remat2", "checkpoint")
    regions = [depth for eqn, depth in evidence.equations() if eqn.primitive.name in names]
    looped = sum(1 for depth in regions if depth)
    took_effect = bool(regions)
    text = f"{len(regions)} checkpointed regions in the step ({looped} inside loops)"
    before = None
    if evidence.saved_residuals is not None:
        before = evidence.saved_residuals(False)
        if before is None:
            text += ", saved residuals not weighed (a checkpoint inside a custom derivative)"
    if before is not None:
        after = evidence.saved_residuals(True)
        took_effect = took_effect and after < before
        text += (
            f", saved residuals {before / MIB:.2f} -> {after / MIB:.2f} MiB per "
            "microbatch (analytic)"
        )
    if len(regions) == 1 and not looped:
        took_effect = False
        text += (
            "; one region outside any loop is recomputed whole in the backward pass, which then "
            "holds its residuals at once: no peak falls (name the model's blocks in remat_blocks)"
        )
    return Verdict("remat", took_effect, f"{text}, policy {plan.remat}")


def _rows(context):
    """Its rows in `lowmem report`: (name, plan fields); ``save:`` keeps the model's tag."""
    policies = ("dots", f"save:{context.saved_name}", "full", "every:2", "sqrt")
    return [(f"remat {p}", {"remat": p}) for p in policies]


TECHNIQUE = Technique(
    name="remat",
    fields=(
        PlanField(
            "remat",
            RematSpec,
            RematSpec("none"),
            "a :mod:`lowmem_jax.blocks.policy` policy (its text, parsed once into a "
            ":class:`~lowmem_jax.blocks.policy.RematSpec`), applied per block by the model (its "
            "``remat`` attribute), or, for a model without one, by :func:`remat_module`.",
            help="rematerialization policy per block: none, full (save block inputs), dots (save "
            "conv/matmul outputs), save:NAME[,NAME] (save tagged activations, e.g. "
            "save:conv_out), offload:NAME[,NAME] (keep them in host memory instead), every:K "
            "(checkpoint segments of K blocks), sqrt, blocks:P*K,... (one of none/dots/full per "
            "block, in the order the model runs them, e.g. blocks:full*4,dots*8; what lowmem "
            "plan chooses)",
            parse=parse_policy,
        ),
        PlanField(
            "remat_blocks",
            tuple,
            (),
            "for a model without a ``remat`` attribute: the class names of the submodules "
            'checkpointed one by one (e.g. ``("Block",)``); ``()``: the whole forward under one '
            "checkpoint (no peak-memory saving by itself, see ``remat_module``).",
            omit_default=True,
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.remat == "none" else f"remat {plan.remat}",
    envelope=None,  # numerically exact: no accuracy limit
    # "blocks": the per-block schedules the planner finds (.schedule).
    axis=Axis(
        "remat",
        ("none", "dots", "full", "sqrt", "blocks"),
        plan_fields=lambda value: {"remat": value},
        within=lambda value, limit, batch_size: True,
        compute=True,
        family=BLOCKS,
        value_of=lambda plan: "blocks" if plan.remat.schedule else plan.remat,
        parts=("activations",),
    ),
    model=ModelHooks(configure=_configure_model),
    step=StepHooks(compiler_options=lambda plan: compiler_options(plan.remat)),
    workload=WorkloadHooks(check=_check_saved_names),
    report=ReportHooks(verdict=_took_effect, rows=rows_of("remat", "remat full", _rows)),
)
