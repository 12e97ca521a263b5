"""The sparse optimizer: a sparsity pattern as optimizer state around any optax transform.

:class:`SparseTraining` wraps an inner ``optax.GradientTransformation`` and is a
:class:`lowmem_jax.core.base.Optimizer`: besides ``init`` / ``update`` it stores the parameters
(:meth:`~SparseTraining.store`: masked or compressed, :mod:`.storage`) and builds the dense
ones the model sees (:meth:`~SparseTraining.materialize`), so the train step needs nothing
sparse-specific. ``update(grads, state, params)``:

1. brings the gradient to the stored layout (:meth:`.storage.Storage.gather`, or zeroes unused
   slots of a gradient already w.r.t. the stored values), runs the inner transform, and zeroes
   its updates off the pattern (pruned weights never move);
2. if the schedule says so (``lax.cond``, no host sync), rewires (:meth:`.storage.Storage.rewire`)
   from the weights *after* this update, the dense gradient (RigL) and the momentum (SNFS); the
   returned updates then zero the pruned weights exactly (``update = -w``), regrown weights
   start at 0, and every optimizer slot that mirrors the parameters (:mod:`.slots`) is zeroed
   outside the surviving weights.

The train step keeps the old optimizer state on a non-finite step, so a skipped step changes no
pattern, counter, threshold or slot. With microbatching the wrapper runs once per optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.core.base import Optimizer
from lowmem_jax.techniques.sparsity import algorithms
from lowmem_jax.techniques.sparsity import masks as masks_lib
from lowmem_jax.techniques.sparsity import slots as slots_lib
from lowmem_jax.techniques.sparsity.config import DSR_PRUNED_FRACTION, SparseConfig
from lowmem_jax.techniques.sparsity.layout import Layout, leaves_by_key, make_layout, replace_leaves
from lowmem_jax.techniques.sparsity.state import SparseState, find_state
from lowmem_jax.techniques.sparsity.storage import Storage

PyTree = Any

__all__ = ["SparseState", "SparseTraining", "sparse_training", "density_report"]


@dataclasses.dataclass(frozen=True)
class SparseTraining(Optimizer):
    """Dynamic (or static) sparse training around ``inner``; build with :func:`sparse_training`.

    Attributes:
      inner: any optax transformation (sgd, adam, adamw, ``inject_hyperparams(...)``, chains).
      config: the :class:`SparseConfig`.
      layout: the static per-leaf budgets and capacities (:func:`make_layout` of the dense
        parameters).
      stacked: ``stacked(path_names) -> bool`` picks the leaves whose leading axis indexes
        stacked blocks that the model densifies one block at a time (set by
        ``Plan.wrap_optimizer`` for the bundled models' scanned stacks); ``None``: none.
    """

    inner: optax.GradientTransformation
    config: SparseConfig
    layout: Layout
    stacked: Callable[[tuple[str, ...]], bool] | None = None

    @property
    def storage(self) -> Storage:
        return self.config.storage

    @property
    def dsr_target_pruned(self) -> int:
        """DSR's ``N_p``: the config's, or ``DSR_PRUNED_FRACTION`` of the sparse weights."""
        if self.config.dsr_target_pruned is not None:
            return int(self.config.dsr_target_pruned)
        total = sum(s.size for s in self.layout.leaves)
        return max(1, round(DSR_PRUNED_FRACTION * total))

    @property
    def grads_wrt_stored(self) -> bool:
        """Whether the step differentiates w.r.t. the stored (compressed) values.

        True when every sparse leaf is stored shorter than dense (compressed storage, capacity
        below size: otherwise the two layouts are indistinguishable) and the algorithm does not
        read the dense gradient (RigL grows where ``|dense grad|`` is largest). Each
        microbatch's gradient and the accumulator then hold only the kept weights.
        """
        return self.config.algorithm != "rigl" and all(
            self.storage.capacity(s) < s.size for s in self.layout.leaves
        )

    @property
    def needs_init_grads(self) -> bool:
        """SNIP's initial masks keep the largest ``|w * grad|``."""
        return self.config.init == "snip"

    # --- initialisation -----------------------------------------------------------------

    def _caps(self) -> tuple[int, ...]:
        return tuple(self.storage.capacity(s) for s in self.layout.leaves)

    def initial_masks(self, params: PyTree, grads: PyTree | None = None) -> dict[str, jax.Array]:
        """``{leaf_key: bool[*shape]}`` with exactly the layer budgets set (SNIP: the global
        top ``|w * g|``, per-layer counts capped by capacity when compressed).

        Raises:
          ValueError: ``init="snip"`` without ``grads``.
        """
        cfg = self.config
        leaves = leaves_by_key(params, self.layout.keys)
        key = jax.random.PRNGKey(cfg.seed)
        out = {}
        if cfg.init == "snip":
            if grads is None:
                raise ValueError("init='snip' needs grads (the dense gradient of the loss)")
            g = leaves_by_key(grads, self.layout.keys)
            scores = [
                jnp.abs(leaves[s.key] * g[s.key]).reshape(-1).astype(jnp.float32)
                for s in self.layout.leaves
            ]
            flat = jnp.concatenate(scores)
            top = masks_lib.top_k_mask(flat, self.layout.total_budget)
            bounds = [0]
            for s in self.layout.leaves:
                bounds.append(bounds[-1] + s.size)
            counts = jnp.stack(
                [top[a:b].sum(dtype=jnp.int32) for a, b in zip(bounds, bounds[1:], strict=False)]
            )
            caps = jnp.asarray(self._caps(), jnp.int32)
            counts = jnp.minimum(counts, caps)
            counts = masks_lib.greedy_fill(counts, caps, self.layout.total_budget - counts.sum())
            for i, s in enumerate(self.layout.leaves):
                m = masks_lib.largest(jnp.ones((s.size,), bool), scores[i], counts[i])
                out[s.key] = m.reshape(s.shape)
            return out
        for i, s in enumerate(self.layout.leaves):
            if cfg.init == "random":
                score = jax.random.uniform(jax.random.fold_in(key, i), (s.size,))
            else:
                score = jnp.abs(leaves[s.key]).reshape(-1).astype(jnp.float32)
            out[s.key] = masks_lib.top_k_mask(score, s.budget).reshape(s.shape)
        return out

    def _state(self, stored: PyTree, pattern: dict[str, jax.Array]) -> SparseState:
        return SparseState(
            inner_state=self.inner.init(stored),
            pattern=dict(pattern),
            count=jnp.zeros((), jnp.int32),
            threshold=jnp.asarray(self.config.dsr_threshold, jnp.float32),
            rng=jax.random.PRNGKey(self.config.seed + 1),
        )

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, SparseState]:
        """Dense ``params`` -> ``(stored params, state)``: initial masks, storage, state.

        ``grads``: the dense gradient at ``params``, needed by ``init="snip"`` only.
        """
        leaves = leaves_by_key(params, self.layout.keys)
        grads = None if grads is None else leaves_by_key(grads, self.layout.keys)
        # One compiled program for every sparse leaf's mask and storage (called op by op, a
        # model's first store compiled dozens of tiny programs per layer); the dense leaves are
        # not passed in, so they stay the caller's arrays, not copies.
        pattern, sparse = jax.jit(self._store_sparse)(leaves, grads)
        stored = replace_leaves(params, sparse)
        return stored, self._state(stored, pattern)

    def _store_sparse(self, leaves: dict[str, jax.Array], grads: dict[str, jax.Array] | None):
        """``({key: pattern}, {key: stored leaf})`` of the sparse leaves ``{key: leaf}``."""
        masks = self.initial_masks(leaves, grads)
        pattern, stored = {}, {}
        for s in self.layout.leaves:
            pattern[s.key] = self.storage.pattern(masks[s.key], s)
            stored[s.key] = self.storage.store(leaves[s.key], pattern[s.key], s)
        return pattern, stored

    def init(self, params: PyTree) -> SparseState:
        """optax ``init`` (masked storage only): the initial masks of ``params``.

        Random and magnitude masks are recomputed from the seed / magnitudes, so ``init`` of the
        dense or of the already masked parameters gives the same masks; for SNIP the non-zeros
        of ``params`` are taken as the mask (call it on :meth:`store`'d parameters). The
        parameters themselves are not masked here: use :meth:`store` (``TrainState.create``
        does).

        Raises:
          ValueError: in compressed mode (the indices cannot be derived from the values).
        """
        if self.config.compressed:
            raise ValueError(
                "compressed=True: build the state with SparseTraining.store or "
                "lm.TrainState.create (init cannot recover indices from the stored values)"
            )
        if self.config.init == "snip":
            leaves = leaves_by_key(params, self.layout.keys)
            masks = {k: leaves[k] != 0 for k in self.layout.keys}
        else:
            masks = self.initial_masks(params)
        return self._state(params, masks)

    def describe(self, state: PyTree | None = None, params: PyTree | None = None) -> dict:
        """``{"sparsity": ...}``: with ``state``, the configuration and the pattern's counts
        (``nnz``, ``budget``, ``size``, ``density``); with dense model ``params``, the measured
        ``density`` (non-zero fraction) of their sparse leaves. ``headline``: the density in a
        few words (``lowmem train``'s summary line prints each description's)."""
        cfg = self.config
        if params is not None:
            leaves = leaves_by_key(params, self.layout.keys)
            nnz = sum(int(jnp.count_nonzero(x)) for x in leaves.values())
            density = nnz / sum(s.size for s in self.layout.leaves)
            return {"sparsity": {"density": density, "headline": f"density {density:.4f}"}}
        report = density_report(self, state)
        return {
            "sparsity": {
                "algorithm": cfg.algorithm,
                "storage": self.storage.name,
                "target_density": cfg.density,
                "nnz": report["nnz"],
                "budget": self.layout.total_budget,
                "size": report["size"],
                "density": report["density"],
                "sparse_leaves": len(self.layout.leaves),
                "headline": f"density {report['density']:.4f}",
            }
        }

    # --- the step --------------------------------------------------------------------------

    def materialize(self, params: PyTree, state: PyTree, blockwise: bool = False) -> PyTree:
        """The dense parameters the model sees; ``state`` is the :class:`SparseState` or any
        pytree containing one. ``blockwise``: the :attr:`stacked` leaves as the storage's
        per-block form (compressed: :class:`~.storage.CompressedStack`, densified one block at
        a time by the model's block loop), the others in its lazy form (compressed:
        :class:`~.storage.CompressedLeaf`, densified where a layer reads it)."""
        pattern = find_state(state).pattern
        values = leaves_by_key(params, self.layout.keys)
        dense = {}
        for s in self.layout.leaves:
            stacked = (
                blockwise and self.stacked is not None and self.stacked(tuple(s.key.split("/")))
            )
            if stacked:
                build = self.storage.materialize_blockwise
            else:
                build = self.storage.materialize_lazy if blockwise else self.storage.materialize
            dense[s.key] = build(values[s.key], pattern[s.key], s)
        return replace_leaves(params, dense)

    def update(self, grads: PyTree, state: SparseState, params: PyTree | None = None):
        """optax ``update``: ``params`` as stored; ``grads`` w.r.t. the model's dense parameters,
        or (compressed storage, not RigL) w.r.t. the stored ones -- cheaper: see
        :attr:`grads_wrt_stored`.

        Raises:
          ValueError: without ``params``, or for gradients of neither layout.
        """
        if params is None:
            raise ValueError("SparseTraining.update needs params")
        cfg, specs, storage = self.config, self.layout.leaves, self.storage
        keys = self.layout.keys
        g = {k: v.reshape(-1) for k, v in leaves_by_key(grads, keys).items()}
        p = {k: v.reshape(-1) for k, v in leaves_by_key(params, keys).items()}
        caps = dict(zip(keys, self._caps(), strict=True))
        # The layout is told by the shapes: stored when every leaf has its capacity's length
        # and some leaf is shorter than dense (else the two layouts coincide: dense).
        stored = all(g[k].shape[0] == caps[k] for k in keys) and any(
            caps[s.key] < s.size for s in specs
        )
        if not stored and any(g[s.key].shape[0] != s.size for s in specs):
            raise ValueError(
                "grads must be w.r.t. the dense model parameters or (compressed storage) the "
                "stored ones: got sizes "
                f"{ {s.key: g[s.key].shape[0] for s in specs} }, dense "
                f"{ {s.key: s.size for s in specs} }, stored {caps}"
            )
        if stored and cfg.algorithm == "rigl":
            raise ValueError(
                "algorithm='rigl' grows where |dense grad| is largest: pass grads "
                "w.r.t. the dense model parameters"
            )
        live = {s.key: storage.live(state.pattern[s.key], s) for s in specs}
        inner_g = {
            s.key: jnp.where(live[s.key], g[s.key], 0)
            if stored
            else storage.gather(g[s.key], state.pattern[s.key], s)
            for s in specs
        }
        inner_grads = replace_leaves(grads, _shape_like(inner_g, params, cast=False))
        updates, inner_state = self.inner.update(inner_grads, state.inner_state, params)
        u = {
            k: jnp.where(live[k], v.reshape(-1), 0) for k, v in leaves_by_key(updates, keys).items()
        }
        count = state.count + 1
        new_state = state._replace(inner_state=inner_state, count=count)
        if not cfg.dynamic:
            return replace_leaves(updates, _shape_like(u, params)), new_state

        def keep(_):
            return u, inner_state, state.pattern, state.threshold

        def rewire(_):
            return self._rewire(state, inner_state, params, p, g, u, live, count)

        do = count >= cfg.start_step
        period = jnp.int32(cfg.periods[0][1])
        for from_step, p_i in cfg.periods[1:]:
            period = jnp.where(count >= from_step, jnp.int32(p_i), period)
        do &= count % period == 0
        if cfg.end_step is not None:
            do &= count <= cfg.end_step
        u, inner_state, pattern, threshold = jax.lax.cond(do, rewire, keep, None)
        new_state = new_state._replace(
            inner_state=inner_state, pattern=pattern, threshold=threshold
        )
        return replace_leaves(updates, _shape_like(u, params)), new_state

    def _rewire(self, state, inner_state, params, p, g, u, live, count):
        cfg, specs = self.config, self.layout.leaves
        momentum = None
        if cfg.algorithm == "snfs":
            mirrors = slots_lib.find_mirrors(inner_state, params)
            if not mirrors:
                raise ValueError(
                    "algorithm='snfs' needs an inner optimizer with a momentum slot "
                    "(a state subtree shaped like params), e.g. optax.sgd(lr, momentum=0.9)"
                )
            mom = leaves_by_key(mirrors[0], self.layout.keys)
            momentum = [slots_lib.values(mom[s.key]).reshape(-1) for s in specs]
        how = algorithms.Rewiring(
            cfg.algorithm,
            rng=jax.random.fold_in(state.rng, count),
            fraction=algorithms.drop_fraction(cfg.drop_fraction, count, cfg.end_step, cfg.anneal),
            grads=[g[s.key] for s in specs] if cfg.algorithm == "rigl" else None,
            momentum=momentum,
            threshold=state.threshold,
            target_pruned=self.dsr_target_pruned,
            regrow_pool=cfg.resolved_regrow_pool,
        )
        keep, pattern, threshold = self.storage.rewire(
            how,
            specs=specs,
            values=[p[s.key] + u[s.key] for s in specs],
            patterns=[state.pattern[s.key] for s in specs],
            live=[live[s.key] for s in specs],
        )
        keep = {s.key: k for s, k in zip(specs, keep, strict=True)}
        new_u = {s.key: jnp.where(keep[s.key], u[s.key], -p[s.key]) for s in specs}

        def reset(mirror):
            leaves = leaves_by_key(mirror, self.layout.keys)
            return replace_leaves(
                mirror,
                {k: slots_lib.zero_where(v, keep[k].reshape(v.shape)) for k, v in leaves.items()},
            )

        inner_state = slots_lib.map_mirrors(reset, inner_state, params)
        pattern = {s.key: x for s, x in zip(specs, pattern, strict=True)}
        return new_u, inner_state, pattern, threshold


def _shape_like(
    flat: dict[str, jax.Array], params: PyTree, cast: bool = True
) -> dict[str, jax.Array]:
    leaves = leaves_by_key(params, flat.keys())
    return {
        k: v.reshape(leaves[k].shape).astype(leaves[k].dtype)
        if cast
        else v.reshape(leaves[k].shape)
        for k, v in flat.items()
    }


def sparse_training(
    inner: optax.GradientTransformation,
    config: SparseConfig,
    params: PyTree,
    stacked: Callable[[tuple[str, ...]], bool] | None = None,
) -> SparseTraining:
    """Wraps ``inner`` for sparse training of (dense) ``params`` (arrays or shapes) under
    ``config``; the layout (which leaves, budgets, capacities) is fixed here. ``stacked``: see
    :attr:`SparseTraining.stacked`.

    Raises:
      ValueError: if ``config.is_sparse`` selects no leaf.
    """
    if not isinstance(config, SparseConfig):
        raise ValueError(f"config must be a SparseConfig, got {type(config).__name__}")
    layout = make_layout(params, config)
    if not layout.leaves:
        raise ValueError("config.is_sparse selected no parameter leaf; nothing to sparsify")
    return SparseTraining(inner=inner, config=config, layout=layout, stacked=stacked)


def density_report(sparse: SparseTraining, opt_state: PyTree) -> dict[str, Any]:
    """Per-layer and total non-zero counts of the current pattern (host-side, for logging)."""
    pattern = find_state(opt_state).pattern
    layers = {}
    for s in sparse.layout.leaves:
        nnz = int(sparse.storage.nnz(pattern[s.key], s))
        layers[s.key] = {"nnz": nnz, "size": s.size, "density": nnz / s.size}
    total = sum(v["nnz"] for v in layers.values())
    size = sum(v["size"] for v in layers.values())
    return {"layers": layers, "nnz": total, "size": size, "density": total / size}
