"""What the techniques and the composer share: the optimizer protocol and common type aliases.

An :class:`Optimizer` is an optax transformation (``init`` / ``update``) that also owns the form
in which the parameters it updates are *stored* in the train state, which may differ from the
form the model *sees*:

    stored, opt_state = opt.store(params)             once, from the model's parameters
    model_params = opt.materialize(stored, opt_state) inside every step (transient)
    updates, opt_state = opt.update(grads, opt_state, stored)

Compressed sparse storage (:mod:`lowmem_jax.techniques.sparsity`) keeps each sparse kernel as its
non-zero values and builds the dense kernel inside the step; a plain optax transformation stores the
parameters as they are (:func:`as_optimizer`). The train step (:func:`lowmem_jax.make_train_step`)
and the memory analysis (:func:`lowmem_jax.analyze`) read the storage from here, so a technique
that stores parameters differently needs no hook in either.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core import meta

PyTree = Any
#: ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``.
LossFn = Callable[[PyTree, PyTree, PyTree, Any], tuple[jax.Array, tuple[PyTree, PyTree]]]

__all__ = [
    "BlockwiseLeaf",
    "LazyLeaf",
    "Optimizer",
    "OptaxOptimizer",
    "Wrapper",
    "as_optimizer",
    "differentiated_loss",
    "cast_floating",
    "shapes",
    "choose",
    "PyTree",
    "LossFn",
]


class BlockwiseLeaf:
    """A parameter of a stack of ``L`` identical blocks (leading axis: the block) held in a form
    other than its dense ``[L, *block_shape]`` array, which the block loop densifies one block
    at a time (:class:`~lowmem_jax.ScannedBlocks`): inside the block's remat, so only one
    block's dense weights exist at a time, in the forward pass and again in the backward.

    Subclasses are pytrees (their arrays are children, so casts and gradients reach them) and
    implement :meth:`block`.
    """

    shape: tuple[int, ...]  # the dense shape, [L, *block_shape]
    dtype: Any  # the dense weights' dtype

    def block(self, index: jax.Array) -> jax.Array:
        """The dense ``[*block_shape]`` weights of block ``index`` (a traced int32 scalar)."""
        raise NotImplementedError

    def dense(self) -> jax.Array:
        """All blocks' dense weights, ``[L, *block_shape]``."""
        raise NotImplementedError


class LazyLeaf(meta.AxisMetadata):
    """A parameter held in a form other than its dense array, densified where the model reads
    it (Linen's ``self.param`` unboxes it as a ``flax.core.meta.AxisMetadata``; NNX indexes it,
    ``kernel[...]``; plain ``jnp`` code converts it through ``__jax_array__``): inside the
    layer, so a layer run under remat rebuilds its dense weights in the backward pass instead
    of keeping them from the forward.

    Subclasses are pytrees (their arrays are children) and implement :meth:`dense` and the
    transforms' ``add_axis`` / ``remove_axis``.
    """

    shape: tuple[int, ...]  # the dense shape
    dtype: Any  # the dense weights' dtype

    def dense(self) -> jax.Array:
        """The dense ``[*shape]`` weights."""
        raise NotImplementedError

    def unbox(self) -> jax.Array:
        return self.dense()

    def __jax_array__(self) -> jax.Array:
        return self.dense()

    def __getitem__(self, index) -> jax.Array:
        return self.dense()[index]

    def replace_boxed(self, val: jax.Array) -> jax.Array:
        return val

    def sliceable(self) -> LazyLeaf | None:
        """The same weights as a leaf whose array children all have the dense leading axis
        ``shape[0]``, so a transform that slices a parameter's arrays (``nnx.scan``,
        ``jax.vmap``, ``jax.lax.scan``) hands each iteration its block; ``None`` where there is
        no such form."""
        return None


class Optimizer:
    """An optax-protocol transformation that owns the stored form of the parameters.

    Subclasses implement :meth:`init` and :meth:`update` (the optax protocol) and, when they
    store parameters in another form than the model sees, :meth:`store`, :meth:`materialize`
    and :attr:`grads_wrt_stored`. The defaults store the parameters as they are.
    """

    #: Whether :meth:`update` itself returns the old state where the step is skipped (a
    #: non-finite gradient, update or new parameter), so the step does not select it (e.g. a
    #: state the device never reads: :class:`lowmem_jax.techniques.shard.offload.HostUpdate`).
    selects_state: bool = False

    #: Whether the step calls ``apply(grads, state, params) -> (params, state, grads_finite,
    #: update_finite)`` instead of :meth:`update` and ``optax.apply_updates``: the parameters
    #: updated where the state lives, the skip rule applied there
    #: (:class:`lowmem_jax.techniques.shard.offload.HostUpdate`).
    applies_updates: bool = False

    def init(self, params: PyTree) -> PyTree:
        """optax ``init`` on the stored parameters."""
        raise NotImplementedError

    def update(
        self, grads: PyTree, state: PyTree, params: PyTree | None = None
    ) -> tuple[PyTree, PyTree]:
        """optax ``update``: ``grads`` (model or stored layout, see :attr:`grads_wrt_stored`),
        ``state`` and the stored ``params`` -> ``(updates, state)`` in the stored layout."""
        raise NotImplementedError

    def store(self, params: PyTree, grads: PyTree | None = None) -> tuple[PyTree, PyTree]:
        """The model's parameters -> ``(stored parameters, initial optimizer state)``.

        ``grads``: the loss's gradient at ``params``, for an optimizer whose initial state
        depends on it (:attr:`needs_init_grads`); ignored here.
        """
        del grads
        return params, self.init(params)

    @property
    def needs_init_grads(self) -> bool:
        """Whether :meth:`store` needs the loss's gradient (e.g. SNIP's initial masks)."""
        return False

    def materialize(self, params: PyTree, state: PyTree, blockwise: bool = False) -> PyTree:
        """The stored parameters (and the state that locates them) -> the model's parameters.

        Runs inside the step, so what it builds is transient. ``blockwise``: leaves of stacked
        blocks may come back as :class:`BlockwiseLeaf`, others as :class:`LazyLeaf` (the step's
        loss asks for it; everything else gets dense arrays)."""
        del state, blockwise
        return params

    @property
    def grads_wrt_stored(self) -> bool:
        """Whether the step differentiates ``loss(materialize(stored))`` w.r.t. the stored
        parameters (gradients, and the microbatch accumulator, take the stored size) instead of
        ``loss`` w.r.t. the materialized ones."""
        return False

    def describe(self, state: PyTree | None = None, params: PyTree | None = None) -> dict:
        """JSON-able facts for a run's summary, keyed by technique (``{}`` here): of the
        optimizer ``state``, or measured on model ``params`` (e.g. an average of checkpoints)."""
        del state, params
        return {}


class OptaxOptimizer(Optimizer):
    """A plain optax transformation as an :class:`Optimizer`: parameters stored as they are."""

    def __init__(self, tx: optax.GradientTransformation):
        self.tx = tx

    def init(self, params: PyTree) -> PyTree:
        return self.tx.init(params)

    def update(self, grads, state, params=None):
        return self.tx.update(grads, state, params)

    def __repr__(self) -> str:
        return f"OptaxOptimizer({self.tx!r})"


class Wrapper(Optimizer):
    """An :class:`Optimizer` around ``self.inner`` (an :class:`Optimizer`) whose state keeps
    the inner one's in ``state.inner_state``: the parameters' storage (``materialize``,
    ``grads_wrt_stored``, ``needs_init_grads``) and ``describe`` are the inner one's."""

    inner: Optimizer

    def materialize(self, params: PyTree, state: Any, blockwise: bool = False) -> PyTree:
        return self.inner.materialize(params, state.inner_state, blockwise)

    @property
    def grads_wrt_stored(self) -> bool:
        return self.inner.grads_wrt_stored

    @property
    def needs_init_grads(self) -> bool:
        return self.inner.needs_init_grads

    def describe(self, state: Any = None, params: PyTree | None = None) -> dict:
        return self.inner.describe(None if state is None else state.inner_state, params)


def choose(table: dict[str, Any], name: str, parameter: str) -> Any:
    """``table[name]``.

    Raises:
      ValueError: an unknown ``name``, in one line naming ``parameter`` and the allowed values.
    """
    if name not in table:
        raise ValueError(f"Unknown {parameter}={name!r}; allowed values: {list(table)}")
    return table[name]


def check_int(value: Any, parameter: str, least: int, meaning: str = "") -> int:
    """``value``, an int (not a bool) >= ``least``.

    Raises:
      ValueError: otherwise, in one line naming ``parameter`` (and ``meaning``, e.g.
        ``" (0: all visible)"``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{parameter} must be an int >= {least}{meaning}, got {value!r}")
    return value


def as_optimizer(tx: optax.GradientTransformation | Optimizer) -> Optimizer:
    """``tx`` itself if it is an :class:`Optimizer`, else :class:`OptaxOptimizer` ``(tx)``."""
    return tx if isinstance(tx, Optimizer) else OptaxOptimizer(tx)


def differentiated_loss(
    loss_fn: LossFn, opt: Optimizer, params: PyTree, opt_state: PyTree
) -> tuple[LossFn, PyTree]:
    """``(loss, wrt)``: the loss as the train step differentiates it and what it is
    differentiated w.r.t., for stored ``params`` and ``opt_state``.

    ``(loss_fn, materialize(params))``, or with :attr:`Optimizer.grads_wrt_stored`
    ``(loss_fn o materialize, params)``. The memory analysis calls it too, so it counts what the
    step differentiates.
    """
    if opt.grads_wrt_stored:

        def loss(stored, model_state, batch, rng):  # the dense weights exist per microbatch
            params = opt.materialize(stored, opt_state, blockwise=True)
            args = (model_state, batch, rng)
            if not reads_lazy_leaves(loss_fn, params, *args):
                params = sliceable_lazy_leaves(params)
            if not reads_lazy_leaves(loss_fn, params, *args):
                warnings.warn(
                    "the model cannot read its compressed sparse weights where its layers use "
                    "them, so they are densified before it runs, all at once (not inside each "
                    "block, even under remat)",
                    stacklevel=2,
                )
                params = densify_lazy_leaves(params)
            return loss_fn(params, *args)

        return loss, params
    return loss_fn, opt.materialize(params, opt_state)


def _is_lazy(x: Any) -> bool:
    return isinstance(x, LazyLeaf)


def densify_lazy_leaves(params: PyTree) -> PyTree:
    """``params`` with every :class:`LazyLeaf` replaced by its dense array."""
    return jax.tree.map(lambda x: x.dense() if _is_lazy(x) else x, params, is_leaf=_is_lazy)


def sliceable_lazy_leaves(params: PyTree) -> PyTree:
    """``params`` with every :class:`LazyLeaf` that has a :meth:`LazyLeaf.sliceable` form
    replaced by it."""

    def sliceable(x):
        return (x.sliceable() or x) if _is_lazy(x) else x

    return jax.tree.map(sliceable, params, is_leaf=_is_lazy)


def reads_lazy_leaves(loss_fn: LossFn, params: PyTree, *args: Any) -> bool:
    """Whether ``loss_fn(params, *args)`` traces with ``params``' :class:`LazyLeaf` leaves as
    they are (abstractly: nothing runs). ``True`` when there are none. A model that maps over
    a leaf's leading axis by slicing its arrays (``nnx.scan``, ``jax.vmap``; Linen's ``nn.scan``
    asks the leaf for its blocks instead) slices the compressed arrays instead of the dense
    weights and fails here: it then gets their :meth:`LazyLeaf.sliceable` forms
    (:func:`sliceable_lazy_leaves`), or, failing that too, dense weights."""
    if not any(_is_lazy(x) for x in jax.tree.leaves(params, is_leaf=_is_lazy)):
        return True
    try:
        jax.eval_shape(loss_fn, params, *args)
    except Exception:  # noqa: BLE001 -- any failure means: give this model dense weights
        return False
    return True


def shapes(tree: PyTree) -> PyTree:
    """``tree``'s arrays (or abstract values, tracers) as ``jax.ShapeDtypeStruct`` with no
    sharding; other leaves unchanged. For traces on shapes alone (``jax.eval_shape``), where a
    leaf lives does not matter: a state kept in host memory would otherwise mix memory spaces
    in one traced operation, an error."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.Array | jax.ShapeDtypeStruct)
            else x
        ),
        tree,
    )


def in_host_memory(x: Any) -> bool:
    """Whether the array (or tracer) ``x`` lives in host memory (its aval's ``memory_space``):
    a parameter streamed from there (``Plan.weight_memory``)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Casts every floating-point leaf of ``tree`` to ``dtype``; other leaves unchanged.

    Leaves may be arrays or ``jax.ShapeDtypeStruct`` (which get the new dtype).
    """

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            if isinstance(x, jax.ShapeDtypeStruct):  # abstract trees (memory analysis)
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
