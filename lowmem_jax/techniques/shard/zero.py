"""ZeRO's stages (Rajbhandari et al. 2020, "ZeRO"): what each partitions over a mesh of ``N``
devices with axis ``"data"`` (:data:`lowmem_jax.core.mesh.AXIS`).

=========  ======================================================================================
``none``   one device; nothing is partitioned
``dp``     data parallelism: each device computes on ``B / N`` examples; parameters, gradients
           and optimizer state replicated (gradients all-reduced)
``zero1``  ``dp`` + the optimizer state partitioned: each device updates its ``1/N`` slice
``zero2``  ``zero1`` + the gradients partitioned (XLA:CPU all-reduces, then slices them)
``zero3``  ``zero2`` + the parameters partitioned (gathered where a layer uses them)
=========  ======================================================================================
"""

from __future__ import annotations

import dataclasses

from lowmem_jax.core.base import choose

__all__ = ["STAGES", "Stage", "stage"]

STAGES = ("none", "dp", "zero1", "zero2", "zero3")


@dataclasses.dataclass(frozen=True)
class Stage:
    """What a stage partitions over the ``data`` axis (the batch always, from ``dp`` on)."""

    name: str
    optimizer_state: bool
    gradients: bool
    parameters: bool

    @property
    def parallel(self) -> bool:
        return self.name != "none"


_STAGES = {
    "none": Stage("none", False, False, False),
    "dp": Stage("dp", False, False, False),
    "zero1": Stage("zero1", True, False, False),
    "zero2": Stage("zero2", True, True, False),
    "zero3": Stage("zero3", True, True, True),
}


def stage(name: str) -> Stage:
    """The :class:`Stage` called ``name``.

    Raises:
      ValueError: naming ``shard`` and the allowed values.
    """
    return choose(_STAGES, name, "shard")
