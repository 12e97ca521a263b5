"""Dynamic sparse training from scratch, with storage that really shrinks.

A plan with ``sparsity=SparseConfig(...)`` wraps the optimizer (``plan.wrap_optimizer``) in a
:class:`SparseTraining`, whose state holds the sparsity pattern; the train step and the memory
analysis need nothing else::

    plan = lm.Plan(microbatches=4, sparsity=sparsity.SparseConfig(
        algorithm="rigl", density=0.1, distribution="erk", update_period=100, end_step=7500,
        compressed=True))
    tx = plan.wrap_optimizer(optax.sgd(0.1, momentum=0.9), variables["params"])
    state = lm.TrainState.create(params=variables["params"], tx=tx, plan=plan, ...)
    step = lm.make_train_step(loss_fn, tx, plan)

Modules, one concept each:

* :mod:`.config`: :class:`SparseConfig` (algorithm, density, distribution, schedule, storage).
* :mod:`.layout`: which leaves are sparse, per-layer densities (uniform / ERK), budgets and
  capacities. A *layer* is one parameter leaf; a ``ScannedBlocks`` stack (``[n_blocks, ...]``)
  is one layer whose budget its blocks share.
* :mod:`.masks`: exact-count selection by ranking, and allocation of counts across layers.
* :mod:`.algorithms`: one prune-and-regrow update of SET, RigL, SNFS, DSR (dense masks, and on
  compressed slots selecting the same weights).
* :mod:`.storage`: masked (dense weights + bool mask) or compressed (values + int32 indices of
  a fixed per-layer capacity) storage, behind one interface.
* :mod:`.slots`: the optimizer slots that mirror the parameters (zeroed for regrown weights).
* :mod:`.transform`: :class:`SparseTraining`, the optimizer wrapper and its schedule.

Semantics: mask updates run in ``lax.cond`` inside the step on the schedule ``start_step``,
``update_period``, ``end_step`` with a cosine-annealed ``drop_fraction``, by ranking with
exact, traced counts (no host sync, no data-dependent shapes). SET and RigL keep each layer's
count; SNFS (mean ``|momentum|``) and DSR (surviving non-zeros, one global threshold)
reallocate regrowth across layers, keeping the total. Regrowth ranks every position the prune
did not keep, a just-pruned one included (RigL's Algorithm 1; ``regrow_pool="zeros_first"`` is
the named departure that takes old zeros first, DSR's default). Pruned weights become exactly 0;
regrown weights (a just-pruned one regrown too) start at 0 with zeroed optimizer slots. A
skipped (non-finite) step changes no pattern.
Sparse leaves default to kernels with ndim >= 2 outside ``classifier`` (:func:`default_is_sparse`).
With compressed storage each layer has a fixed capacity ``min(size, ceil(capacity_factor *
budget))`` (1x for fixed-count algorithms, 1.25x for the reallocating ones and SNIP): a layer can
grow to at most that, and the step builds the dense weights transiently. Measured bytes are in
``benchmarks/results/sparse_storage_*`` and ``experiments/results/memory_report``.
"""

from __future__ import annotations

from lowmem_jax.techniques.sparsity import algorithms, layout, masks, slots, storage
from lowmem_jax.techniques.sparsity.config import (
    ALGORITHMS,
    DISTRIBUTIONS,
    INITS,
    REGROW_POOLS,
    SparseConfig,
    default_is_sparse,
    report_sparsity,
)
from lowmem_jax.techniques.sparsity.storage import CompressedStorage, MaskedStorage
from lowmem_jax.techniques.sparsity.transform import (
    SparseState,
    SparseTraining,
    density_report,
    sparse_training,
)

__all__ = [
    "SparseConfig",
    "SparseTraining",
    "SparseState",
    "sparse_training",
    "density_report",
    "default_is_sparse",
    "report_sparsity",
    "MaskedStorage",
    "CompressedStorage",
    "ALGORITHMS",
    "DISTRIBUTIONS",
    "INITS",
    "REGROW_POOLS",
    "algorithms",
    "layout",
    "masks",
    "slots",
    "storage",
]

import argparse
import dataclasses

import jax

from lowmem_jax.blocks import lazy_layers
from lowmem_jax.blocks import policy as remat_policy
from lowmem_jax.blocks import scanned as scanned_blocks
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import Axis, EnvelopeRule, Flags, PlanField, Technique, Verdict
from lowmem_jax.core.technique_hooks import (
    ModelHooks,
    OptimizerHooks,
    ReportHooks,
    StepHooks,
    WorkloadHooks,
)
from lowmem_jax.core.units import MIB


def _validate(plan) -> None:
    if plan.sparsity is not None and not isinstance(plan.sparsity, SparseConfig):
        raise ValueError(
            f"sparsity must be a lowmem_jax.techniques.sparsity.SparseConfig or None, got "
            f"{type(plan.sparsity).__name__}"
        )


def _bind(work, plan, total_steps):
    """A sparse plan whose ``is_sparse`` is the default gets the workload's (e.g. the
    transformer's Linear kernels), and with the run's length, its default ``end_step`` (75% of
    the run; ``None``: an analysis, never stop)."""
    sparse = plan.sparsity
    if sparse is None:
        return work, plan
    if sparse.is_sparse is default_is_sparse:
        sparse = dataclasses.replace(sparse, is_sparse=work.is_sparse)
    if sparse.end_step is None and total_steps is not None:
        sparse = dataclasses.replace(sparse, end_step=int(0.75 * total_steps))
    return work, dataclasses.replace(plan, sparsity=sparse)


def _sparse_training(opt, plan, params):
    """Sparse training around the optimizer so far, told which leaves belong to scanned stacks
    (:func:`scanned_blocks.in_stack`): in compressed storage the step hands those to the model
    compressed, and each block densifies its own weights inside its remat."""
    if plan.sparsity is None:
        return opt
    if params is None:
        raise ValueError("a plan with sparsity needs params in wrap_optimizer(tx, params)")
    return sparse_training(opt, plan.sparsity, params, stacked=scanned_blocks.in_stack)


def _densifies_per_layer(plan) -> bool:
    """Compressed storage without remat: each layer that reads compressed weights runs under its
    own checkpoint (:mod:`lowmem_jax.blocks.lazy_layers`); under remat the blocks rebuild them."""
    return plan.sparsity is not None and plan.sparsity.compressed and not plan.remat.enabled


def _configure_model(model, plan):
    return lazy_layers.checkpoint_lazy_layers(model) if _densifies_per_layer(plan) else model


def _compiler_options(plan) -> dict[str, str]:
    """The per-layer checkpoints' XLA option (remat's: keep recomputations apart on CPU)."""
    return remat_policy.compiler_options("full") if _densifies_per_layer(plan) else {}


def _add_flags(parser: argparse.ArgumentParser, base) -> None:
    group = parser.add_argument_group("sparsity (lowmem_jax.techniques.sparsity)")
    group.add_argument(
        "--sparsity",
        type=float,
        default=0.0,
        help="fraction of zeros in the sparse weights (conv and dense kernels except the "
        "classifier; for translation the Linear kernels except DynamicConv's weight_linear, "
        "embeddings dense), e.g. 0.9; 0 = dense. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-algorithm", default="dsr", choices=ALGORITHMS, help="Default: %(default)s"
    )
    group.add_argument(
        "--sparse-distribution",
        default="uniform",
        choices=DISTRIBUTIONS,
        help="per-layer densities. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-init", default="random", choices=INITS, help="initial mask. Default: %(default)s"
    )
    group.add_argument(
        "--sparse-storage",
        default="compressed",
        choices=["compressed", "masked"],
        help="compressed: non-zero values + int32 indices, dense weights only transient inside "
        "the step; masked: dense weights + a mask (more memory than dense). Default: %(default)s",
    )
    group.add_argument(
        "--sparse-regrow-pool",
        default="auto",
        choices=REGROW_POOLS,
        help="where regrowth may land: not_kept = every position the prune did not keep (RigL's "
        "Algorithm 1), zeros_first = old zeros first (a departure); auto = not_kept, zeros_first "
        "for dsr. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-period",
        type=int,
        default=100,
        help="optimizer steps between mask updates. Default: %(default)s",
    )


def _fields(args: argparse.Namespace) -> dict:
    if not 0.0 <= args.sparsity < 1.0:
        raise ValueError(f"--sparsity must be in [0, 1) (fraction of zeros), got {args.sparsity}")
    if args.sparsity == 0.0:
        return {"sparsity": None}
    return {
        "sparsity": SparseConfig(
            algorithm=args.sparse_algorithm,
            density=1.0 - args.sparsity,
            distribution=args.sparse_distribution,
            init=args.sparse_init,
            update_period=args.sparse_period,
            compressed=args.sparse_storage == "compressed",
            regrow_pool=args.sparse_regrow_pool,
        )
    }


def _argv(plan) -> list[str]:
    sparse = plan.sparsity
    if sparse is None:
        return []
    flags = {
        "--sparse-algorithm": (sparse.algorithm, "dsr"),
        "--sparse-distribution": (sparse.distribution, "uniform"),
        "--sparse-init": (sparse.init, "random"),
        "--sparse-storage": ("compressed" if sparse.compressed else "masked", "compressed"),
        "--sparse-period": (sparse.update_period, 100),
        "--sparse-regrow-pool": (sparse.regrow_pool, "auto"),
    }
    argv = ["--sparsity", repr(round(1.0 - sparse.density, 12))]
    return argv + [a for flag, (v, d) in flags.items() if v != d for a in (flag, str(v))]


def _outside(config, limit):
    sparsity = (config.get("sparsity") or {}).get("sparsity", 0.0)
    return f"sparsity {sparsity:.0%} (> {limit:.0%})" if sparsity > limit + 1e-9 else None


def _took_effect(evidence, plan):
    """The weight leaves sparse training keeps sparse (its layout), and the stored
    parameters' bytes."""
    if plan.sparsity is None:
        return None
    opt = evidence.tx
    while not isinstance(opt, SparseTraining) and hasattr(opt, "inner"):
        opt = opt.inner
    leaves = opt.layout.leaves if isinstance(opt, SparseTraining) else ()
    stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(evidence.state.params))
    text = (
        f"{len(leaves)} weight leaves at {plan.sparsity.density:.0%} density, stored "
        f"{plan.sparsity.storage.name}: parameters {stored / MIB:.2f} MiB"
    )
    if _densifies_per_layer(plan):
        names = ("remat2", "checkpoint")
        layers = sum(1 for eqn, _ in evidence.equations() if eqn.primitive.name in names)
        text += f", {layers} layers densified inside checkpoints of their own"
    return Verdict("sparsity", bool(leaves), text)


# Its rows in `lowmem report`: (name, plan fields).
_ROWS = [(f"sparse {s:.0%} dsr", {"sparsity": report_sparsity(s)}) for s in (0.5, 0.7, 0.9)]


TECHNIQUE = Technique(
    name="sparsity",
    fields=(
        PlanField(
            "sparsity",
            SparseConfig | None,
            None,
            "a :class:`lowmem_jax.sparsity.SparseConfig` (sparse training, masked or compressed "
            "storage), or ``None`` for dense training.",
        ),
    ),
    validate=_validate,
    label=lambda plan: None if plan.sparsity is None else f"sparse {1 - plan.sparsity.density:.0%}",
    flags=Flags(
        add=_add_flags,
        fields=_fields,
        argv=_argv,
        given=lambda args: ["--sparsity"] if args.sparsity else [],
    ),
    # DSR kept WRN-28-2 within 0.3 points of dense up to 70-80% sparsity (Mostafa & Wang).
    envelope=EnvelopeRule(
        "max_sparsity",
        {"report": 0.7, "any": 0.99},
        _outside,
        lambda limit: f"at most {limit:.0%} sparsity",
    ),
    # A fraction of zeros: 0 is dense, else the report's sparse training (DSR, compressed).
    axis=Axis(
        "sparsity",
        (0.0, 0.5, 0.7, 0.9),
        plan_fields=lambda value: {"sparsity": report_sparsity(value) if value else None},
        within=lambda value, limit, batch_size: value <= limit + 1e-9,
        value_of=lambda plan: 0.0 if plan.sparsity is None else 1 - plan.sparsity.density,
        corner="last",
    ),
    model=ModelHooks(configure=_configure_model),
    optimizer=OptimizerHooks(wrap=_sparse_training),
    workload=WorkloadHooks(bind=_bind),
    step=StepHooks(compiler_options=_compiler_options),
    report=ReportHooks(
        rows=rows_of("sparsity", "sparse 70% dsr", _ROWS),
        verdict=_took_effect,
        # The rewiring compiles per sparse layer: WRN-28-2's dynamic-sparse report rows take about
        # 3x the others to analyse cold (benchmarks/results/report_time.md).
        compile_cost=lambda plan: (
            3.5 if plan.sparsity is not None and plan.sparsity.dynamic else 1.0
        ),
    ),
)
