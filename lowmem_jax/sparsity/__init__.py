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

from lowmem_jax.sparsity import algorithms, layout, masks, slots, storage
from lowmem_jax.sparsity.config import (
    ALGORITHMS,
    DISTRIBUTIONS,
    INITS,
    REGROW_POOLS,
    SparseConfig,
    default_is_sparse,
    report_sparsity,
)
from lowmem_jax.sparsity.storage import CompressedStorage, MaskedStorage
from lowmem_jax.sparsity.transform import (
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
