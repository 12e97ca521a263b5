"""The analytic half of :mod:`lowmem_jax.analysis.memory`: the technical report's breakdown of a
train step's memory by summing tensor sizes (model, optimizer, activations, dense weights, inputs,
state; see :mod:`lowmem_jax.analysis.memory` for what each part counts). Nothing is compiled: shapes
are enough, and the residuals come from ``jax.vjp``'s jaxpr."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

from lowmem_jax.analysis.state import state_view
from lowmem_jax.core.base import BlockwiseLeaf, LazyLeaf, Optimizer, as_optimizer, shapes

PyTree = Any

__all__ = [
    "analytic_breakdown",
    "optimizer_breakdown",
    "saved_activation_bytes",
    "microbatch_residuals",
    "microbatch_args",
    "dense_weight_bytes",
    "tree_bytes",
    "host_resident_bytes",
]


def _nbytes(x, per_device: bool = False) -> int:
    """Bytes of an array or abstract value (``per_device``: of one device's shard where it has
    a sharding); typed PRNG keys count as their key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None) if per_device else None
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree: PyTree, per_device: bool = False) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``ShapeDtypeStruct``); with
    ``per_device``, of the shard one device holds of each leaf that has a sharding (the whole
    leaf where it has none)."""
    return sum(_nbytes(x, per_device) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def host_resident_bytes(tree: PyTree) -> int:
    """Bytes of the leaves of ``tree`` whose sharding names host memory (``pinned_host`` /
    ``unpinned_host``): what stays off the device between steps."""
    return sum(
        _nbytes(x)
        for x in jax.tree.leaves(tree)
        if "host" in str(getattr(getattr(x, "sharding", None), "memory_kind", None) or "")
    )


def _bytes_by_dtype(tree: PyTree) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        out[jnp.dtype(x.dtype).name] += _nbytes(x)
    return dict(out)


_WRAPPERS = {"inner", "inner_state", "inner_states"}


def _slot_name(path) -> str:
    names = [getattr(k, "name", None) or getattr(k, "key", None) for k in path]
    names = [str(n) for n in names if n is not None and not isinstance(n, int)]
    names = [n for n in names if n not in _WRAPPERS]
    if len(names) > 1 and names[-1] == "scales":  # a quantized slot's scales (optimizer_state)
        return f"{names[0]} scales"
    return names[0] if names else "state"


def optimizer_breakdown(
    params: PyTree, opt_state: PyTree, microbatches: int = 1, model_params: PyTree | None = None
) -> dict[str, int]:
    """Bytes of gradients, accumulator and optimizer state (see the module docstring).

    The gradient (and the float32 accumulator when microbatching) has the shape of the
    parameters the model sees, ``model_params`` (default ``params``): with compressed sparse
    storage that is the dense, transient layout, not the stored values -- unless the step
    differentiates w.r.t. the stored parameters (pass ``model_params=None`` then).
    """
    grad_params = params if model_params is None else model_params
    out = {"gradients": tree_bytes(grad_params)}
    if microbatches > 1:
        out["gradient_accumulator"] = sum(
            int(np.prod(x.shape, dtype=np.int64)) * 4 for x in jax.tree.leaves(grad_params)
        )
    slots: dict[str, int] = defaultdict(int)
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if hasattr(leaf, "shape"):
            slots[_slot_name(path)] += _nbytes(leaf)
    for name, nbytes in slots.items():
        out[f"slot:{name}"] = nbytes
    return out


def saved_activation_bytes(
    loss_fn: Callable, params: PyTree, model_state: PyTree, batch: PyTree, rng
) -> dict[str, Any]:
    """Residuals saved by one forward pass of ``loss_fn`` for the gradient w.r.t. ``params``.

    ``loss_fn(params, model_state, batch, rng) -> (loss, aux)``; inputs may be abstract. Returns
    ``{"bytes", "count", "largest": [(shape, dtype, source), ...]}``; residuals that are the
    arguments themselves (parameters, inputs) are not counted: they are already in memory.
    """
    leaves, tree = jax.tree.flatten((model_state, batch, rng))

    def vjp_wrt_params(p, *leaves):
        # Only the parameters are differentiated; the rest is closed over, so a residual that
        # is an input (the batch) stays recognisable as one of the jaxpr's arguments.
        s, b, r = jax.tree.unflatten(tree, leaves)
        return jax.vjp(lambda p_: loss_fn(p_, s, b, r), p)

    closed, out_shape = jax.make_jaxpr(vjp_wrt_params, return_shape=True)(params, *leaves)
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(out_shape[1]))
    residuals = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    invars = set(jaxpr.invars)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    # Values that depend on no input (e.g. the zeros relu's derivative selects from) are
    # constants XLA folds into the consumer: not stored, not counted.
    dynamic = set(invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in dynamic for v in eqn.invars):
            dynamic.update(eqn.outvars)
    seen, total, items = set(), 0, []
    for v in residuals:
        if isinstance(v, jex_core.Literal) or v in invars or v not in dynamic or v in seen:
            continue
        seen.add(v)
        nbytes = _nbytes(v.aval)
        total += nbytes
        eqn = producers.get(v)
        items.append((nbytes, str(v.aval.str_short()), eqn.primitive.name if eqn else "const"))
    items.sort(reverse=True)
    return {"bytes": total, "count": len(items), "largest": items[:60]}


def dense_weight_bytes(
    state, tx: optax.GradientTransformation | Optimizer, blocks_rematerialized: bool = False
) -> int:
    """Bytes of the dense weights the step builds from the stored ``state.params`` (see the
    module docstring): the leaves ``tx``'s materialization makes that are not stored leaves.

    A leaf the materialization hands out blockwise (when the step differentiates w.r.t. the
    stored parameters, :func:`~lowmem_jax.core.base.differentiated_loss`) counts one block when
    ``blocks_rematerialized`` (the block loop densifies it inside each block's checkpoint), else
    whole (:class:`~lowmem_jax.ScannedBlocks` densifies it before a loop without remat). A
    ``blocks:`` schedule is counted as rematerialized in every stack."""
    opt = as_optimizer(tx)
    state = state_view(state)
    total = 0

    def count(params, opt_state):
        nonlocal total
        stored = {id(x) for x in jax.tree.leaves(params)}
        dense = opt.materialize(params, opt_state, blockwise=opt.grads_wrt_stored)
        for x in jax.tree.leaves(dense, is_leaf=lambda x: isinstance(x, BlockwiseLeaf | LazyLeaf)):
            if isinstance(x, BlockwiseLeaf):
                blocks = 1 if blocks_rematerialized else x.shape[0]
                total += blocks * math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize
            elif isinstance(x, LazyLeaf):  # built where a layer reads it: counted whole
                total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            elif id(x) not in stored:
                total += _nbytes(x)
        return 0

    jax.eval_shape(count, shapes(state.params), _opt_state(state))
    return total


def _model_params(state, opt: Optimizer) -> PyTree:
    """Shapes of the parameters the model sees (``opt``'s materialized ``state.params``)."""
    state = state_view(state)
    return jax.eval_shape(opt.materialize, shapes(state.params), _opt_state(state))


def _opt_state(state) -> PyTree:
    return shapes(state_view(state).opt_state)


def microbatch_residuals(
    loss_fn: Callable,
    state,
    batch: PyTree,
    microbatches: int = 1,
    *,
    tx: optax.GradientTransformation | Optimizer | None = None,
) -> dict[str, Any]:
    """:func:`saved_activation_bytes` of one microbatch of the step on ``state``
    (:func:`microbatch_args`)."""
    return saved_activation_bytes(loss_fn, *microbatch_args(state, batch, microbatches, tx=tx))


def microbatch_args(
    state,
    batch: PyTree,
    microbatches: int = 1,
    *,
    tx: optax.GradientTransformation | Optimizer | None = None,
) -> tuple[PyTree, PyTree, PyTree, Any]:
    """``(params, model_state, batch, rng)`` of one microbatch of the step on ``state``: the
    parameters as the model sees them (``tx`` may store them in another form), the state's
    ``model_state`` and ``rng``, ``batch``'s leading axis divided by ``microbatches``
    (shapes)."""
    opt = as_optimizer(optax.identity() if tx is None else tx)
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // microbatches,) + x.shape[1:], x.dtype),
        batch,
    )
    view = state_view(state)
    return _model_params(view, opt), view.model_state, micro, view.rng


def analytic_breakdown(
    *,
    state,
    batch: PyTree,
    loss_fn: Callable | None = None,
    microbatches: int = 1,
    tx: optax.GradientTransformation | Optimizer | None = None,
    blocks_rematerialized: bool = False,
) -> dict[str, Any]:
    """The report's model / optimizer / activations / dense weights / inputs breakdown, in
    bytes.

    ``state``: a :class:`~lowmem_jax.TrainState` (or its ``jax.eval_shape``), or any pytree
    state with a ``params`` attribute (``flax.training.train_state.TrainState`` too): its
    ``opt_state``, ``model_state`` and ``rng`` are used where it has them; **state** counts
    every leaf that is neither parameter nor optimizer state. ``loss_fn`` is the loss the step
    differentiates, ``loss_fn(params, model_state, batch, rng)``, in the compute dtype
    (``precision.cast_loss_fn``); without it the activation figure is ``None``. ``tx``: the
    step's optimizer; when it stores the parameters in another form than the model sees
    (compressed sparse storage), the activations are those of the materialized parameters and
    the gradients (and accumulator) take the stored or the model's layout as the step does
    (:attr:`~lowmem_jax.core.base.Optimizer.grads_wrt_stored`). The model figure always counts the
    stored ``state.params``. ``blocks_rematerialized``: see :func:`dense_weight_bytes`.
    """
    opt = as_optimizer(optax.identity() if tx is None else tx)
    view = state_view(state)
    model_params = _model_params(view, opt)
    opt_state = _opt_state(view)
    optimizer = optimizer_breakdown(
        view.params,
        opt_state,
        microbatches,
        view.params if opt.grads_wrt_stored else model_params,
    )
    activations = None
    if loss_fn is not None:
        activations = microbatch_residuals(loss_fn, view, batch, microbatches, tx=opt)
    out = {
        "source": "analytic",
        "model_bytes": tree_bytes(view.params),
        "model_bytes_by_dtype": _bytes_by_dtype(view.params),
        "optimizer_bytes": sum(optimizer.values()),
        "optimizer_breakdown": optimizer,
        "activation_bytes": None if activations is None else activations["bytes"],
        "activation_residuals": activations,
        "dense_weight_bytes": dense_weight_bytes(view, opt, blocks_rematerialized),
        "input_bytes": tree_bytes(batch),
        "state_bytes": tree_bytes(state) - tree_bytes((view.params, opt_state)),
        "host_resident_bytes": host_resident_bytes(state),
    }
    parts = (
        "model_bytes",
        "optimizer_bytes",
        "activation_bytes",
        "dense_weight_bytes",
        "input_bytes",
        "state_bytes",
    )
    out["total_bytes"] = sum(out[k] or 0 for k in parts)
    return out
