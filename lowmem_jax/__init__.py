"""lowmem_jax: how much memory does it take to train this network, and how to make it fit.

Each technique is a pure transform; :func:`make_train_step` composes them into one jitted step.

The public API is ``__all__`` (30 names: the plan, the train step, the workloads, the memory
report and the pieces a hand-written step composes). Everything else lives in a themed
subpackage, a folder per concept, each importing only those below it (the layers in
``pyproject.toml``'s import contract, checked in CI):

========================  =====================================================================
``lm.core``               the optimizer protocol, shared types, the Technique protocol, meshes
``lm.blocks``             ``ScannedBlocks``, block discovery, remat policies, per-block hooks
``lm.codecs``             quantization and stored formats shared by techniques
``lm.techniques.<name>``  one folder per technique: its descriptor and all of its code
``lm.models``             the benchmark models
``lm.compose``            ``Plan`` and the one jitted step
``lm.analysis``           compile-only memory analysis, FLOPs, inspection, verdicts
``lm.workloads``          named models and yours, the one builder
``lm.planning``           the budget planner and the accuracy envelopes
``lm.report``             ``lowmem report``
``lm.training``           the training loop, its configs and tasks, checkpoints
``lm.cli``                the ``lowmem`` command
========================  =====================================================================

The module paths of the flat layout before (``lm.remat``, ``lowmem_jax.loss_scale``, ...) are
aliases of their new homes for one release, with a ``DeprecationWarning``.

>>> import jax, optax, lowmem_jax as lm
>>> plan = lm.Plan(precision="mixed_fp16", microbatches=4, remat="full")
>>> model = plan.configure_model(lm.models.WideResNet(depth=10, width=1, num_classes=10))
"""

from lowmem_jax import (  # noqa: F401 -- the themed subpackages, reachable as lm.<name>
    _moved,
    analysis,
    blocks,
    codecs,
    compose,
    core,
    models,
    ops,
    planning,
    techniques,
    workloads,
)
from lowmem_jax.analysis.inspector import inspect
from lowmem_jax.analysis.memory import analyze
from lowmem_jax.analysis.verdicts import verdicts
from lowmem_jax.blocks.policy import compiler_options
from lowmem_jax.blocks.scanned import ScannedBlocks
from lowmem_jax.compose.nnx_split import split_nnx
from lowmem_jax.compose.plan import Plan
from lowmem_jax.compose.step import (
    TrainState,
    make_plain_train_step,
    make_train_step,
    model_params,
    scaled_grad_fn,
)
from lowmem_jax.core.base import Optimizer
from lowmem_jax.planning.planner import NoPlanFits, plan_for_budget
from lowmem_jax.techniques import sparsity
from lowmem_jax.techniques.factorize import FactorConfig
from lowmem_jax.techniques.loss_scale.scale import make_loss_scale
from lowmem_jax.techniques.microbatches.accumulate import accumulate_gradients
from lowmem_jax.techniques.optimizer_state.quantized import quantized_state
from lowmem_jax.techniques.precision.policy import cast_loss_fn
from lowmem_jax.training.skip_guard import NoProgressError, SkipGuard
from lowmem_jax.workloads.builder import analyze_model, build
from lowmem_jax.workloads.custom import custom_workload
from lowmem_jax.workloads.losses import classifier_loss_fn, translation_loss_fn
from lowmem_jax.workloads.registry import workload

__version__ = "0.1.0"

_moved.install()
__getattr__ = _moved.module_getattr

__all__ = [
    # the plan and the train step
    "Plan",
    "TrainState",
    "make_train_step",
    "make_plain_train_step",
    "model_params",
    "split_nnx",
    "classifier_loss_fn",
    "translation_loss_fn",
    # workloads and what they report
    "custom_workload",
    "workload",
    "build",
    "analyze",
    "analyze_model",
    "inspect",
    "verdicts",
    "plan_for_budget",
    "NoPlanFits",
    # techniques
    "FactorConfig",
    "quantized_state",
    "ScannedBlocks",
    "scaled_grad_fn",
    "accumulate_gradients",
    "make_loss_scale",
    "cast_loss_fn",
    "compiler_options",
    "Optimizer",
    "SkipGuard",
    "NoProgressError",
    # submodules
    "models",
    "sparsity",
]
