"""The registry: every technique the library composes, in order
(:class:`~lowmem_jax.core.technique.Technique`).

Each package here is one technique: its ``__init__`` declares it (``TECHNIQUE``) and exports its
public names, its code lives beside it, and it imports no other technique (the import contract
in ``pyproject.toml``). :data:`TECHNIQUES` lists them in the order written below, once; the
order is meaning: layers are replaced before anything else configures them, the precision cast
comes before loss scaling, loss scaling before the microbatch loop, sparse training inside the
optimizer-state format, the layouts over devices last. ``Plan``'s fields, its validation, a
plan's label, the envelopes' limits, the CLI's flags and every hook read in this order.
"""

from __future__ import annotations

from lowmem_jax.core.report_hooks import ReportSection
from lowmem_jax.core.technique import Technique
from lowmem_jax.techniques import (
    activations,
    factorize,
    input_dtype,
    loss_chunk,
    loss_scale,
    microbatches,
    optimizer_state,
    pipeline,
    precision,
    remat,
    second_moment,
    shard,
    sparsity,
    weight_memory,
)

__all__ = ["TECHNIQUES", "technique", "report_sections"]

TECHNIQUES: tuple[Technique, ...] = (
    # the model's layers; first: the hooks after it copy an NNX model, and a copy loses the order
    # its layers were assigned in (which are the first and last)
    factorize.TECHNIQUE,
    # the model's compute dtype; the loss (casts in, float32 out)
    precision.TECHNIQUE,
    # the gradient (scale, unscale, skip, adjust): the step's core
    loss_scale.TECHNIQUE,
    # the gradient (lax.scan accumulation)
    microbatches.TECHNIQUE,
    # the model, per block
    remat.TECHNIQUE,
    # the model's output head (its logits a chunk of tokens at a time, with the loss)
    loss_chunk.TECHNIQUE,
    # the loss: the residuals its backward pass reads, stored compressed; around remat's
    # checkpoints (a block's saved input is compressed too)
    activations.TECHNIQUE,
    # the optimizer and the parameters' storage
    sparsity.TECHNIQUE,
    # the user's optimizer, innermost (inside the stored format)
    second_moment.TECHNIQUE,
    # the stored format of the user's transformation's state (inside sparse training)
    optimizer_state.TECHNIQUE,
    # the loss (its stacks traced as pipelines) and the step's layouts over the stages; after
    # every technique that changes the model's computation
    pipeline.TECHNIQUE,
    # the step's layouts over a device mesh; zero3's gathering
    shard.TECHNIQUE,
    # where the parameters live (the model's layouts, the state's)
    weight_memory.TECHNIQUE,
    # the batch's stored images (the data pipeline and the model)
    input_dtype.TECHNIQUE,
)


def technique(name: str) -> Technique:
    """The registered technique ``name``.

    Raises:
      ValueError: an unknown name, listing the registered ones.
    """
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise ValueError(f"Unknown technique {name!r}; registered: {[t.name for t in TECHNIQUES]}")


def report_sections() -> dict[str, ReportSection]:
    """The ``lowmem report`` sections the techniques declare (:class:`ReportSection`), by key,
    in the registry's order."""
    return {t.report.section.key: t.report.section for t in TECHNIQUES if t.report.section}
