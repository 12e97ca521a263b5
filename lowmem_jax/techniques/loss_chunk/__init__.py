"""The output head's logits a chunk of tokens at a time (``loss_chunk``): a language model's
cross-entropy that never holds the ``[B, T, V]`` logits (:mod:`.cross_entropy`, its math).

A model takes part by a ``loss_chunk`` field and, given ``targets``, returning its per-token
``(nll, correct)`` (the bundled :class:`~lowmem_jax.models.Llama`); the bundled LM loss
(:func:`lowmem_jax.lm_loss_fn`) then asks for them. A model without the field is refused in one
line; a loss of one's own calls :func:`chunked_token_losses` on the head's input and kernel
(``lm.techniques.loss_chunk.chunked_token_losses``).
"""

import dataclasses
import math

import flax.linen as nn
import jax

from lowmem_jax.core.technique import PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import ModelHooks, ReportHooks
from lowmem_jax.core.units import MIB
from lowmem_jax.techniques.loss_chunk.cross_entropy import chunked_token_losses

__all__ = ["TECHNIQUE", "chunked_token_losses"]

FIELD = "loss_chunk"


def _validate(plan) -> None:
    chunk = plan.loss_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"loss_chunk must be an int >= 0 (0: whole logits), got {chunk!r}")


def _takes_part(model) -> bool:
    """A Linen model with a ``loss_chunk`` field."""
    return (
        isinstance(model, nn.Module)
        and dataclasses.is_dataclass(model)
        and FIELD in {f.name for f in dataclasses.fields(model)}
    )


def _configure_model(model, plan):
    """The model's ``loss_chunk`` set; a model without one refused."""
    if not plan.loss_chunk:
        return model
    if not _takes_part(model):
        raise ValueError(
            f"loss_chunk={plan.loss_chunk}: {type(model).__name__} computes its loss from whole "
            "logits (it has no loss_chunk field, as lowmem_jax.models.Llama has); a loss of "
            "your own can call lm.techniques.loss_chunk.chunked_token_losses(hidden, kernel, "
            "labels, chunk)"
        )
    return model.clone(loss_chunk=plan.loss_chunk)


def _took_effect(evidence, plan):
    """A loop whose body projects ``[loss_chunk, V]`` logits, and no projection to ``V`` of a
    whole microbatch's tokens (``[B, T, V]`` or ``[B T, V]``) anywhere in the step."""
    c = plan.loss_chunk
    if not c:
        return None
    tokens = jax.tree.leaves(evidence.batch)[0].size // plan.microbatches
    if tokens <= c:
        return Verdict(FIELD, False, f"a microbatch's {tokens} tokens fit one chunk of {c}: "
                       "the logits are whole")  # fmt: skip
    dots = [(eqn.outvars[0].aval.shape, loops) for eqn, loops in evidence.equations()
            if eqn.primitive.name == "dot_general"]  # fmt: skip
    vocab = max((s[1] for s, loops in dots if loops and len(s) == 2 and s[0] == c), default=None)
    if vocab is None:
        return Verdict(FIELD, False, f"no loop computes the logits of {c} tokens")
    whole = [s for s, _ in dots if s[-1] == vocab and math.prod(s[:-1]) == tokens]
    if whole:
        return Verdict(FIELD, False, f"logits {list(whole[0])} are still computed whole")
    mib = c * vocab * 4 / MIB
    return Verdict(FIELD, True, f"logits {c} tokens at a time: [{c}, {vocab}] ({mib:.1f} MiB "
                   "float32) in a loop, recomputed in the backward pass")  # fmt: skip


TECHNIQUE = Technique(
    name=FIELD,
    fields=(
        PlanField(
            FIELD,
            int,
            0,
            "tokens per chunk of the output head's logits (``0``: whole): the LM cross-entropy "
            "over chunks, each chunk's ``[c, V]`` logits recomputed in the backward pass, so the "
            "``[B, T, V]`` logits never exist; for a model with a ``loss_chunk`` field (the "
            "bundled Llama).",
            help="compute the LM head's logits and cross-entropy C tokens at a time, recomputed "
            "in the backward pass (0: whole logits)",
            omit_default=True,
        ),
    ),
    validate=_validate,
    # The same loss and gradient (float32 rounding): inside every envelope.
    envelope=None,
    # Not searched yet: only the bundled decoder takes part.
    axis=None,
    label=lambda plan: f"loss chunk {plan.loss_chunk}" if plan.loss_chunk else None,
    model=ModelHooks(configure=_configure_model),
    report=ReportHooks(verdict=_took_effect),
)
