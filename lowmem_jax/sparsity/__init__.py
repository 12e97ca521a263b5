"""Dynamic sparse training as a masked optax transform, with storage that really shrinks.

Usage (masked storage; add ``compressed=True`` to the config and pass
``materialize=sparse.materialize`` to the step for compressed storage)::

    cfg = sparsity.SparseConfig(algorithm="rigl", density=0.1, distribution="erk",
                                update_period=100, end_step=7500)
    sparse = sparsity.sparse_training(optax.sgd(0.1, momentum=0.9), cfg, variables["params"])
    state = sparse.create_train_state(params=variables["params"], plan=plan,
                                      model_state={"batch_stats": variables["batch_stats"]})
    step = lm.make_train_step(loss_fn, sparse, plan, materialize=sparse.materialize)

Design
------
* **Composition.** :class:`SparseTraining` is an optax-protocol transformation (``init`` /
  ``update``) wrapping any inner one; its state :class:`SparseState` holds the inner state, the
  masks (or indices), a step counter, DSR's threshold and a PRNG key. It is the ``tx`` of
  :func:`lowmem_jax.make_train_step`, so it sits inside the one jitted step with precision
  policies, loss scaling (a skipped step keeps the old optimizer state: masks, counter,
  threshold and slots do not change), microbatching (gradients are accumulated first, so masks
  update once per optimizer step) and remat (in the model, untouched).
* **Mask updates** run in ``lax.cond`` inside the step on the schedule ``start_step``,
  ``update_period``, ``end_step`` with a cosine-annealed ``drop_fraction``; all selections are
  by ranking with exact, traced counts (no host sync, no data-dependent shapes). In compressed
  storage the update works per layer on the ``[capacity]`` slots
  (:func:`~.algorithms.rewire_compressed`: DSR's prune is a threshold compare, the others' one
  ``[capacity]`` sort; regrowth a ``lax.top_k`` over one layer's dense key at a time), selecting
  exactly what the masked-storage :func:`~.algorithms.rewire` selects, so its temporaries stay
  within what the dense step needs (WRN-28-2, batch 128, fp16, 64 microbatches, full remat,
  DSR 90%: XLA:CPU total 17.6 MiB against 19.8 MiB dense; it was 46.3 MiB with dense-sized
  sorts of every layer alive at once).
* **Per layer vs global.** A layer is one parameter leaf; a ``ScannedBlocks`` stack
  (``[n_blocks, ...]``) is one layer whose budget its blocks share (ERK scores its per-block
  shape). SET and RigL keep each layer's count; SNFS (mean ``|momentum|``) and DSR (surviving
  non-zeros, one global threshold) reallocate regrowth across layers, keeping the total. Pruned
  weights become exactly 0; regrown weights start at 0; every optimizer slot that mirrors the
  parameters (found structurally, :mod:`.slots`) is zeroed outside the surviving weights.
* **Sparse leaves** default to kernels with ndim >= 2 outside ``classifier``
  (:func:`default_is_sparse`); biases, BatchNorm and the last layer stay dense.
* **Compressed storage** (``compressed=True``): a sparse leaf is stored as its values
  ``[capacity]`` in the train state's ``params`` and int32 indices ``[capacity]`` in
  ``SparseState.indices``; the inner optimizer's slots are ``[capacity]`` too. The step's
  ``materialize`` hook scatters dense weights transiently before differentiation, so the
  gradient is dense and transient (RigL's growth criterion); the wrapper gathers it at the
  indices. Slots are stable: a surviving weight keeps its slot, a regrown weight takes a freed
  slot (whose optimizer slots are zeroed), so masked and compressed storage follow the same
  trajectory. Shapes are static, so each layer has a fixed **capacity**
  ``min(size, ceil(capacity_factor * budget))``: 1x for fixed-count algorithms (SET, RigL,
  static random/magnitude), 1.25x by default for the reallocating ones (DSR, SNFS) and SNIP.
  Cross-layer reallocation is capped by each layer's free capacity and the excess goes to layers
  with room, so the total stays exact; a layer can grow to at most ``capacity_factor`` times its
  initial budget (masked storage has no such cap, so DSR/SNFS trajectories coincide with masked
  storage only while no cap binds). Unused capacity holds index ``size`` and value 0.
  Stored bytes per sparse weight with SGD momentum: value 4 + index 4 + momentum 4 = 12 bytes
  per capacity slot, against 8 per dense weight. Measured for WRN-28-2 at 90% sparsity (ERK,
  params + optimizer state): 15.4% of dense by XLA:CPU argument bytes (batch excluded) with 1x
  capacity (SET / RigL / static), 19.0% with DSR's 1.25x; the analytic breakdown gives 15.3%
  and 18.9%. The gradient (and the microbatch accumulator) stays dense but transient.
* **Masked storage** keeps dense weights, dense slots and a bool mask (1 byte per weight): more
  than dense training; it is the reference the compressed mode is tested against.
"""

from lowmem_jax.sparsity import algorithms, layout, masks, slots
from lowmem_jax.sparsity.algorithms import drop_fraction, rewire, rewire_compressed
from lowmem_jax.sparsity.config import (
    ALGORITHMS,
    DISTRIBUTIONS,
    INITS,
    SparseConfig,
    default_is_sparse,
)
from lowmem_jax.sparsity.layout import Layout, LeafSpec, layer_densities, make_layout
from lowmem_jax.sparsity.slots import find_mirrors, map_mirrors
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
    "make_layout",
    "layer_densities",
    "Layout",
    "LeafSpec",
    "rewire",
    "rewire_compressed",
    "drop_fraction",
    "find_mirrors",
    "map_mirrors",
    "ALGORITHMS",
    "DISTRIBUTIONS",
    "INITS",
    "algorithms",
    "layout",
    "masks",
    "slots",
]
