"""lowmem_jax: how much memory does it take to train this network, and how to make it fit.

Each technique is a pure transform; :func:`make_train_step` composes them into one jitted step.

The public API is ``__all__`` (30 names: the plan, the train step, the workloads, the memory
report and the pieces a hand-written step composes). Everything else lives in its submodule, which
stays importable as an attribute: ``lm.loss_scale.all_finite``, ``lm.precision.get_policy``,
``lm.remat.parse_policy``, ``lm.base.as_optimizer``, ``lm.memory.MemoryReport``,
``lm.technique.Verdict``, ``lm.techniques.shard.state_shardings``, ...

>>> import jax, optax, lowmem_jax as lm
>>> plan = lm.Plan(precision="mixed_fp16", microbatches=4, remat="full")
>>> model = plan.configure_model(lm.models.WideResNet(depth=10, width=1, num_classes=10))
"""

# Submodules, reachable as ``lm.<submodule>.<name>``; only ``models`` and ``sparsity`` are in
# ``__all__``.
from lowmem_jax import (  # noqa: F401
    base,
    factorization,
    grad_compression,
    inspector,
    loss_scale,
    losses,
    memory,
    microbatch,
    models,
    nnx_split,
    ops,
    optimizer_state,
    pipeline,
    planner,
    precision,
    quantization,
    recipes,
    remat,
    remat_schedule,
    scanned_blocks,
    sharding,
    skip_guard,
    sparsity,
    technique,
    techniques,
    workloads,
)
from lowmem_jax.base import Optimizer
from lowmem_jax.custom import custom_workload
from lowmem_jax.factorization import FactorConfig
from lowmem_jax.inspector import inspect
from lowmem_jax.loss_scale import make_loss_scale
from lowmem_jax.losses import classifier_loss_fn, translation_loss_fn
from lowmem_jax.memory import analyze
from lowmem_jax.microbatch import accumulate_gradients
from lowmem_jax.nnx_split import split_nnx
from lowmem_jax.optimizer_state import quantized_state
from lowmem_jax.plan import Plan
from lowmem_jax.planner import NoPlanFits, plan_for_budget
from lowmem_jax.precision import cast_loss_fn
from lowmem_jax.remat import compiler_options
from lowmem_jax.scanned_blocks import ScannedBlocks
from lowmem_jax.skip_guard import NoProgressError, SkipGuard
from lowmem_jax.train import (
    TrainState,
    make_plain_train_step,
    make_train_step,
    model_params,
    scaled_grad_fn,
)
from lowmem_jax.verdicts import verdicts
from lowmem_jax.workloads import analyze_model, build, workload

__version__ = "0.1.0"

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
