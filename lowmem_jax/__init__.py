"""lowmem_jax: how much memory does it take to train this network, and how to make it fit.

Each technique is a pure transform; :func:`make_train_step` composes them into one jitted step.

>>> import jax, optax, lowmem_jax as lm
>>> plan = lm.Plan(precision="mixed_fp16", microbatches=4, remat="full")
>>> model = plan.configure_model(lm.models.WideResNet(depth=10, width=1, num_classes=10))
"""

from lowmem_jax import (
    factorization,
    loss_scale,
    losses,
    memory,
    microbatch,
    models,
    nnx_split,
    ops,
    optimizer_state,
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
    workloads,
)
from lowmem_jax.base import Optimizer, as_optimizer, differentiated_loss
from lowmem_jax.custom import custom_workload
from lowmem_jax.factorization import FactorConfig
from lowmem_jax.inspector import Inspection, inspect
from lowmem_jax.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    make_loss_scale,
    select_tree,
)
from lowmem_jax.losses import classifier_loss_fn, translation_loss_fn
from lowmem_jax.memory import MemoryReport, analyze
from lowmem_jax.microbatch import accumulate_gradients
from lowmem_jax.nnx_split import SplitNNX, split_nnx
from lowmem_jax.optimizer_state import QuantizedState, quantized_state
from lowmem_jax.plan import Plan
from lowmem_jax.planner import BudgetPlan, NoPlanFits, plan_for_budget
from lowmem_jax.precision import Policy, cast_floating, cast_loss_fn, get_policy
from lowmem_jax.remat import compiler_options, parse_policy
from lowmem_jax.scanned_blocks import ScannedBlocks
from lowmem_jax.skip_guard import NoProgressError, SkipGuard
from lowmem_jax.technique import Verdict
from lowmem_jax.techniques.shard import state_shardings
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
    "Plan",
    "Verdict",
    "verdicts",
    "TrainState",
    "make_train_step",
    "make_plain_train_step",
    "model_params",
    "scaled_grad_fn",
    "state_shardings",
    "Optimizer",
    "as_optimizer",
    "differentiated_loss",
    "split_nnx",
    "SplitNNX",
    "classifier_loss_fn",
    "translation_loss_fn",
    "workload",
    "custom_workload",
    "build",
    "Policy",
    "get_policy",
    "cast_floating",
    "cast_loss_fn",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "make_loss_scale",
    "all_finite",
    "select_tree",
    "accumulate_gradients",
    "FactorConfig",
    "quantized_state",
    "QuantizedState",
    "parse_policy",
    "compiler_options",
    "ScannedBlocks",
    "SkipGuard",
    "NoProgressError",
    "analyze",
    "analyze_model",
    "inspect",
    "Inspection",
    "MemoryReport",
    "plan_for_budget",
    "BudgetPlan",
    "NoPlanFits",
    "factorization",
    "loss_scale",
    "losses",
    "memory",
    "microbatch",
    "models",
    "nnx_split",
    "ops",
    "optimizer_state",
    "planner",
    "precision",
    "quantization",
    "recipes",
    "remat",
    "remat_schedule",
    "scanned_blocks",
    "sharding",
    "skip_guard",
    "sparsity",
    "workloads",
]
