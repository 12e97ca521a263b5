"""The sparse optimizer wrapper: masks (or indices) as optimizer state around any optax transform.

:class:`SparseTraining` wraps an inner ``optax.GradientTransformation``; its ``init`` / ``update``
follow the optax protocol, so it drops into :func:`lowmem_jax.make_train_step` as the ``tx``.
``update(grads, state, params)``:

1. masks the gradient (masked storage) or gathers it at the stored indices (compressed
   storage), runs the inner transform, and masks its updates (pruned weights never move);
2. if the schedule says so (``lax.cond``, no host sync), rewires
   (:func:`~lowmem_jax.sparsity.algorithms.rewire`; compressed storage:
   :func:`~lowmem_jax.sparsity.algorithms.rewire_compressed`, per layer, selecting the same
   weights with small temporaries) from the weights *after* this update, the
   dense gradient and the momentum; the returned updates then zero the pruned weights exactly
   (``update = -w``), regrown weights start at 0, and every optimizer slot that mirrors the
   parameters (:mod:`~lowmem_jax.sparsity.slots`) is zeroed outside the surviving weights.

The train step keeps the old optimizer state on a non-finite step, so a skipped step changes no
mask, counter, threshold or slot. With microbatching the wrapper runs once per optimizer step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.sparsity import algorithms
from lowmem_jax.sparsity import masks as masks_lib
from lowmem_jax.sparsity import slots as slots_lib
from lowmem_jax.sparsity.config import DSR_PRUNED_FRACTION, SparseConfig
from lowmem_jax.sparsity.layout import Layout, make_layout, path_names

PyTree = Any

__all__ = ["SparseState", "SparseTraining", "sparse_training", "density_report"]


class SparseState(NamedTuple):
    """The wrapper's optimizer state (a pytree).

    Attributes:
      inner: the inner transform's state (its slots shaped like the stored parameters).
      masks: masked storage: ``{leaf_key: bool[*dense_shape]}``; compressed: ``{}``.
      indices: compressed storage: ``{leaf_key: int32[capacity]}``, flat positions in the dense
        leaf; unused capacity holds ``size`` (out of range: scatters drop it, gathers read 0);
        masked: ``{}``.
      count: int32 scalar, optimizer steps applied.
      threshold: float32 scalar, DSR's ``H`` (unused otherwise).
      rng: uint32 ``[2]`` raw key for random regrowth (``fold_in(rng, count)``).
    """

    inner: PyTree
    masks: dict[str, jax.Array]
    indices: dict[str, jax.Array]
    count: jax.Array
    threshold: jax.Array
    rng: jax.Array


def _by_key(tree: PyTree, keys) -> dict[str, jax.Array]:
    keys = set(keys)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        k = "/".join(path_names(path))
        if k in keys:
            out[k] = leaf
    return out


def _replace(tree: PyTree, new: dict[str, jax.Array]) -> PyTree:
    def fn(path, leaf):
        return new.get("/".join(path_names(path)), leaf)

    return jax.tree_util.tree_map_with_path(fn, tree)


def _scatter(size: int, idx: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.zeros((size,), values.dtype).at[idx].set(values, mode="drop")


def _gather(dense_flat: jax.Array, idx: jax.Array) -> jax.Array:
    return dense_flat.at[idx].get(mode="fill", fill_value=0)


class _Given(NamedTuple):
    """A transformation whose ``init`` returns a given state (for ``TrainState.create``)."""

    state: PyTree

    def init(self, params):
        del params
        return self.state


@dataclasses.dataclass(frozen=True)
class SparseTraining:
    """Dynamic (or static) sparse training around ``inner``; build with :func:`sparse_training`.

    Attributes:
      inner: any optax transformation (sgd, adam, adamw, ``inject_hyperparams(...)``, chains).
      config: the :class:`SparseConfig`.
      layout: the static per-leaf budgets and capacities (:func:`make_layout` of the dense
        parameters).
    """

    inner: optax.GradientTransformation
    config: SparseConfig
    layout: Layout

    @property
    def dsr_target_pruned(self) -> int:
        """DSR's ``N_p``: the config's, or ``DSR_PRUNED_FRACTION`` of the sparse weights."""
        if self.config.dsr_target_pruned is not None:
            return int(self.config.dsr_target_pruned)
        total = sum(s.size for s in self.layout.leaves)
        return max(1, round(DSR_PRUNED_FRACTION * total))

    @property
    def grads_in_stored_layout(self) -> bool:
        """Whether :meth:`update` takes gradients w.r.t. the stored (compressed) parameters.

        True for compressed storage unless the algorithm reads the dense gradient (RigL grows
        where ``|dense grad|`` is largest) or a leaf is stored at full size (capacity = size,
        where the two layouts would be indistinguishable). :func:`~lowmem_jax.make_train_step`
        then differentiates ``loss(materialize(stored))`` w.r.t. the stored parameters, so each
        microbatch's gradient and the accumulator hold only the kept weights.
        """
        return (
            self.config.compressed
            and self.config.algorithm != "rigl"
            and all(s.capacity < s.size for s in self.layout.leaves)
        )

    # --- initialisation -----------------------------------------------------------------

    def _caps(self) -> tuple[int, ...]:
        if self.config.compressed:
            return tuple(s.capacity for s in self.layout.leaves)
        return tuple(s.size for s in self.layout.leaves)

    def initial_masks(self, params: PyTree, grads: PyTree | None = None) -> dict[str, jax.Array]:
        """``{leaf_key: bool[*shape]}`` with exactly the layer budgets set (SNIP: the global
        top ``|w * g|``, per-layer counts capped by capacity when compressed).

        Raises:
          ValueError: ``init="snip"`` without ``grads``.
        """
        cfg = self.config
        leaves = _by_key(params, self.layout.keys)
        key = jax.random.PRNGKey(cfg.seed)
        out = {}
        if cfg.init == "snip":
            if grads is None:
                raise ValueError("init='snip' needs grads (the dense gradient of the loss)")
            g = _by_key(grads, self.layout.keys)
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

    def store(
        self, params: PyTree, masks: dict[str, jax.Array]
    ) -> tuple[PyTree, dict[str, jax.Array]]:
        """Stored parameters and indices for dense ``params`` under ``masks``.

        Masked storage: ``params * mask`` and ``{}``. Compressed: each sparse leaf becomes its
        values ``[capacity]`` (ascending positions, zero padded) and the indices are returned.
        """
        leaves = _by_key(params, self.layout.keys)
        if not self.config.compressed:
            return _replace(
                params, {k: jnp.where(masks[k], leaves[k], 0) for k in self.layout.keys}
            ), {}
        values, indices = {}, {}
        for s in self.layout.leaves:
            (idx,) = jnp.nonzero(masks[s.key].reshape(-1), size=s.capacity, fill_value=s.size)
            idx = idx.astype(jnp.int32)
            indices[s.key] = idx
            values[s.key] = _gather(leaves[s.key].reshape(-1), idx)
        return _replace(params, values), indices

    def init_from(
        self, stored: PyTree, masks: dict[str, jax.Array], indices: dict[str, jax.Array]
    ) -> SparseState:
        """The optimizer state for stored parameters (from :meth:`store`)."""
        return SparseState(
            inner=self.inner.init(stored),
            masks={k: jnp.asarray(v, bool) for k, v in masks.items()}
            if not self.config.compressed
            else {},
            indices=dict(indices),
            count=jnp.zeros((), jnp.int32),
            threshold=jnp.asarray(self.config.dsr_threshold, jnp.float32),
            rng=jax.random.PRNGKey(self.config.seed + 1),
        )

    def prepare(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, SparseState]:
        """Dense ``params`` -> ``(stored_params, opt_state)``: initial masks, storage, state."""
        masks = self.initial_masks(params, grads)
        stored, indices = self.store(params, masks)
        return stored, self.init_from(stored, masks, indices)

    def create_train_state(
        self,
        *,
        params: PyTree,
        plan,
        model_state=None,
        rng: jax.Array | None = None,
        grads: PyTree | None = None,
    ):
        """A :class:`~lowmem_jax.TrainState` holding the stored parameters and sparse state."""
        from lowmem_jax.train import TrainState

        params = plan.policy.cast_to_param(params)
        stored, opt_state = self.prepare(params, grads)
        return TrainState.create(
            params=stored, tx=_Given(opt_state), plan=plan, model_state=model_state, rng=rng
        )

    def init(self, params: PyTree) -> SparseState:
        """optax ``init`` (masked storage only): the initial masks of ``params``.

        Random and magnitude masks are recomputed from the seed / magnitudes, so ``init`` of the
        dense or of the already masked parameters gives the same masks; for SNIP the non-zeros
        of ``params`` are taken as the mask (call it on :meth:`prepare`'d parameters). The
        parameters themselves are not masked here: use :meth:`prepare` or
        :meth:`create_train_state`.

        Raises:
          ValueError: in compressed mode (the indices cannot be derived from the values).
        """
        if self.config.compressed:
            raise ValueError(
                "compressed=True: build the state with SparseTraining.prepare or "
                "create_train_state (init cannot recover indices from the stored values)"
            )
        if self.config.init == "snip":
            leaves = _by_key(params, self.layout.keys)
            masks = {k: leaves[k] != 0 for k in self.layout.keys}
        else:
            masks = self.initial_masks(params)
        return self.init_from(params, masks, {})

    # --- the step --------------------------------------------------------------------------

    def materialize(self, params: PyTree, opt_state: PyTree) -> PyTree:
        """The dense parameters the model sees (the ``materialize`` hook of
        :func:`~lowmem_jax.make_train_step`); identity for masked storage. ``opt_state`` is the
        :class:`SparseState` or any pytree containing one."""
        if not self.config.compressed:
            return params
        state = _find_state(opt_state)
        values = _by_key(params, self.layout.keys)
        dense = {
            s.key: _scatter(s.size, state.indices[s.key], values[s.key]).reshape(s.shape)
            for s in self.layout.leaves
        }
        return _replace(params, dense)

    def update(self, grads: PyTree, state: SparseState, params: PyTree | None = None):
        """optax ``update``: ``params`` as stored; ``grads`` w.r.t. the model's dense parameters,
        or (compressed storage, not RigL) w.r.t. the stored ones -- cheaper: see
        :attr:`grads_in_stored_layout`.

        Raises:
          ValueError: without ``params``, or for gradients of neither layout.
        """
        if params is None:
            raise ValueError("SparseTraining.update needs params")
        cfg, specs = self.config, self.layout.leaves
        keys = self.layout.keys
        g = {k: v.reshape(-1) for k, v in _by_key(grads, keys).items()}
        p = {k: v.reshape(-1) for k, v in _by_key(params, keys).items()}
        # The layout is told by the shapes: stored when every leaf has its capacity's length
        # and some leaf is shorter than dense (else the two layouts coincide: dense).
        stored = (
            cfg.compressed
            and all(g[s.key].shape[0] == s.capacity for s in specs)
            and any(s.capacity < s.size for s in specs)
        )
        if not stored and any(g[s.key].shape[0] != s.size for s in specs):
            raise ValueError(
                "grads must be w.r.t. the dense model parameters or (compressed storage) the "
                "stored ones: got sizes "
                f"{ {s.key: g[s.key].shape[0] for s in specs} }, dense "
                f"{ {s.key: s.size for s in specs} }, stored { {s.key: s.capacity for s in specs} }"
            )
        if stored and cfg.algorithm == "rigl":
            raise ValueError(
                "algorithm='rigl' grows where |dense grad| is largest: pass grads "
                "w.r.t. the dense model parameters"
            )
        if stored:
            live = {s.key: state.indices[s.key] < s.size for s in specs}
            inner_g = {s.key: jnp.where(live[s.key], g[s.key], 0) for s in specs}
        elif cfg.compressed:
            live = {s.key: state.indices[s.key] < s.size for s in specs}
            inner_g = {s.key: _gather(g[s.key], state.indices[s.key]) for s in specs}
        else:
            live = {k: state.masks[k].reshape(-1) for k in keys}
            inner_g = {k: jnp.where(live[k], g[k], 0) for k in keys}
        inner_grads = _replace(
            grads, {s.key: inner_g[s.key].reshape(_stored_shape(params, s.key)) for s in specs}
        )
        updates, inner = self.inner.update(inner_grads, state.inner, params)
        u = {k: jnp.where(live[k], v.reshape(-1), 0) for k, v in _by_key(updates, keys).items()}
        count = state.count + 1
        new_state = state._replace(inner=inner, count=count)
        if not cfg.dynamic:
            return _replace(updates, _shape_like(u, params)), new_state

        def keep(_):
            return u, inner, state.masks, state.indices, state.threshold

        def rewire(_):
            return self._rewire(state, inner, params, p, g, u, live, count)

        do = count >= cfg.start_step
        period = jnp.int32(cfg.periods[0][1])
        for from_step, p_i in cfg.periods[1:]:
            period = jnp.where(count >= from_step, jnp.int32(p_i), period)
        do &= count % period == 0
        if cfg.end_step is not None:
            do &= count <= cfg.end_step
        u, inner, masks, indices, threshold = jax.lax.cond(do, rewire, keep, None)
        new_state = new_state._replace(
            inner=inner, masks=masks, indices=indices, threshold=threshold
        )
        return _replace(updates, _shape_like(u, params)), new_state

    def _rewire(self, state, inner, params, p, g, u, live, count):
        cfg, specs = self.config, self.layout.leaves
        compressed = cfg.compressed
        momentum = None
        if cfg.algorithm == "snfs":
            mirrors = slots_lib.find_mirrors(inner, params)
            if not mirrors:
                raise ValueError(
                    "algorithm='snfs' needs an inner optimizer with a momentum slot "
                    "(a state subtree shaped like params), e.g. optax.sgd(lr, momentum=0.9)"
                )
            mom = _by_key(mirrors[0], self.layout.keys)
            momentum = [mom[s.key].reshape(-1) for s in specs]
        rng = jax.random.fold_in(state.rng, count)
        fraction = algorithms.drop_fraction(cfg.drop_fraction, count, cfg.end_step, cfg.anneal)
        common = dict(
            rng=rng,
            fraction=fraction,
            grads=[g[s.key] for s in specs] if cfg.algorithm == "rigl" else None,
            momentum=momentum,
            threshold=state.threshold,
            target_pruned=self.dsr_target_pruned,
        )
        new_u, keep, new_masks, new_indices = {}, {}, {}, {}
        if compressed:
            # Per layer, in the [capacity] slots; dense [n] temporaries one layer at a time.
            idx = state.indices
            out = algorithms.rewire_compressed(
                cfg.algorithm,
                values=[p[s.key] + u[s.key] for s in specs],
                indices=[idx[s.key] for s in specs],
                sizes=tuple(s.size for s in specs),
                **common,
            )
            for i, s in enumerate(specs):
                kept = out.survivors[i]
                # Survivors keep their slots; regrown weights fill the freed ones in order.
                (free_slot,) = jnp.nonzero(~kept, size=s.capacity, fill_value=s.capacity)
                new_indices[s.key] = (
                    jnp.where(kept, idx[s.key], s.size)
                    .at[free_slot]
                    .set(out.grown[i], mode="drop")
                    .astype(jnp.int32)
                )
                keep[s.key] = kept
        else:
            out = algorithms.rewire(
                cfg.algorithm,
                weights=[p[s.key] + u[s.key] for s in specs],
                masks=[live[s.key] for s in specs],
                caps=self._caps(),
                **common,
            )
            for i, s in enumerate(specs):
                keep[s.key] = out.survivors[i]
                new_masks[s.key] = out.masks[i].reshape(s.shape)
        for s in specs:
            new_u[s.key] = jnp.where(keep[s.key], u[s.key], -p[s.key])

        def reset(mirror):
            leaves = _by_key(mirror, self.layout.keys)
            return _replace(
                mirror,
                {
                    k: jnp.where(keep[k].reshape(v.shape), v, jnp.zeros_like(v))
                    for k, v in leaves.items()
                },
            )

        inner = slots_lib.map_mirrors(reset, inner, params)
        if compressed:
            return new_u, inner, state.masks, new_indices, out.threshold
        return new_u, inner, new_masks, state.indices, out.threshold


def _stored_shape(params: PyTree, key: str) -> tuple[int, ...]:
    return tuple(_by_key(params, [key])[key].shape)


def _shape_like(flat: dict[str, jax.Array], params: PyTree) -> dict[str, jax.Array]:
    leaves = _by_key(params, flat.keys())
    return {k: v.reshape(leaves[k].shape).astype(leaves[k].dtype) for k, v in flat.items()}


def _find_state(tree: PyTree) -> SparseState:
    if isinstance(tree, SparseState):
        return tree
    found = []
    jax.tree.map(
        lambda x: found.append(x) if isinstance(x, SparseState) else None,
        tree,
        is_leaf=lambda x: isinstance(x, SparseState),
    )
    if len(found) != 1:
        raise ValueError(f"expected exactly one SparseState in opt_state, found {len(found)}")
    return found[0]


def sparse_training(
    inner: optax.GradientTransformation, config: SparseConfig, params: PyTree
) -> SparseTraining:
    """Wraps ``inner`` for sparse training of (dense) ``params`` (arrays or shapes) under
    ``config``; the layout (which leaves, budgets, capacities) is fixed here.

    Raises:
      ValueError: if ``config.is_sparse`` selects no leaf.
    """
    if not isinstance(config, SparseConfig):
        raise ValueError(f"config must be a SparseConfig, got {type(config).__name__}")
    layout = make_layout(params, config)
    if not layout.leaves:
        raise ValueError("config.is_sparse selected no parameter leaf; nothing to sparsify")
    return SparseTraining(inner=inner, config=config, layout=layout)


def density_report(sparse: SparseTraining, params: PyTree, opt_state: PyTree) -> dict[str, Any]:
    """Per-layer and total non-zero counts of the current masks (host-side, for logging)."""
    state = _find_state(opt_state)
    layers = {}
    for s in sparse.layout.leaves:
        if sparse.config.compressed:
            nnz = int((state.indices[s.key] < s.size).sum())
        else:
            nnz = int(state.masks[s.key].sum())
        layers[s.key] = {"nnz": nnz, "size": s.size, "density": nnz / s.size}
    total = sum(v["nnz"] for v in layers.values())
    size = sum(v["size"] for v in layers.values())
    return {"layers": layers, "nnz": total, "size": size, "density": total / size}
