"""Workloads: a named model (or yours) with its batch shapes and recipe, and the one builder of
its train step (:func:`build` -> :class:`Setup`).

:mod:`.workload` the :class:`Workload` value; :mod:`.registry` the named models;
:mod:`.build` the builder; :mod:`.setup` what it returns; :mod:`.custom` your model as a
workload; :mod:`.recipes` and :mod:`.losses` the benchmarks' optimizers and losses.
"""

from lowmem_jax.workloads.registry import (
    MODEL_NAMES,
    Setup,
    Workload,
    analyze_model,
    build,
    build_plain,
    translation_is_sparse,
    variable_shapes,
    workload,
)

__all__ = [
    "Workload",
    "Setup",
    "workload",
    "build",
    "build_plain",
    "variable_shapes",
    "analyze_model",
    "translation_is_sparse",
    "MODEL_NAMES",
]
