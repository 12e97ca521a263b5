"""Workloads: a named model (or yours) with its batch shapes and recipe, and the one builder of
its train step (:func:`build` -> :class:`Setup`).

:mod:`.definition` the :class:`Workload` value; :mod:`.registry` the named models;
:mod:`.builder` the builder; :mod:`.setup` what it returns; :mod:`.custom` your model as a
workload; :mod:`.recipes` and :mod:`.losses` the benchmarks' optimizers and losses.
"""

from lowmem_jax.workloads.builder import PLAIN_MODEL_FIELDS, analyze_model, build, build_plain
from lowmem_jax.workloads.definition import Workload
from lowmem_jax.workloads.registry import (
    CIFAR10_PIXEL_STATS,
    DYNAMICCONV_RECIPES,
    MODEL_NAMES,
    TASKS,
    WRN_RECIPE,
    translation_is_sparse,
    workload,
)
from lowmem_jax.workloads.setup import Setup, variable_shapes

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
    "TASKS",
    "WRN_RECIPE",
    "DYNAMICCONV_RECIPES",
    "CIFAR10_PIXEL_STATS",
    "PLAIN_MODEL_FIELDS",
]
