"""Microbatching: gradient accumulation over ``k`` slices of a batch with ``lax.scan``.

A gradient function here has the signature

    grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)

``batch`` is a pytree whose leaves share a leading batch axis ``B``; ``metrics`` is a pytree of
scalars. :func:`accumulate_gradients` returns a function of the same signature that splits every
batch leaf ``[B, ...]`` into ``k`` contiguous microbatches ``[k, B/k, ...]`` and runs ``grad_fn``
on them in a ``lax.scan``, so only one microbatch's activations are live at a time:

    grads   = (1/k) * sum_i grad_fn(params, state_i, batch_i, fold_in(rng, i)).grads
    metrics = (1/k) * sum_i metrics_i

For a loss that is a mean over a fixed number of examples per microbatch, the mean of microbatch
gradients equals the full-batch gradient exactly (up to float rounding). A loss normalised by a
count that varies between microbatches (tokens that are not padding, masked positions, example
weights) is another objective under that mean: the mean of microbatch means. Such a loss reports
its normaliser as the metric :data:`COUNT` (``metrics["count"]``, ``n_i``, float32 scalar), and
the microbatches are then weighted by it:

    grads   = sum_i n_i * grads_i / sum_i n_i
    metrics = sum_i n_i * metrics_i / sum_i n_i,   metrics["count"] = sum_i n_i

which is the full batch's gradient and metrics of the mean over all ``sum_i n_i`` units. When
the count depends on the batch (and ``rng``) alone, not on the parameters or the model state (a
mask's sum, the non-padding tokens), the counts of all ``k`` microbatches are evaluated before
the loop from the traced loss cut down to its count (``dce_jaxpr``: no forward pass), and a
gradient function that takes a keyword ``weight`` (:func:`lowmem_jax.scaled_grad_fn`'s: ``grad(S
* weight * loss) / S``) is asked for ``grad(w_i * loss_i)`` with ``w_i = k n_i / sum_j n_j``:
the weight enters at the backward pass's seed, a scalar, the gradients keep the magnitude of the
unweighted rule's (which matters under a float16 loss scale), and the sum is divided by the
constant ``k`` as in the unweighted rule: no gradient-sized op takes a traced scalar (the
division by a traced total cost 3.26 MB, 1.35%, on an IWSLT step). Otherwise (a count computed
from the model's outputs, or a ``grad_fn`` without ``weight``) the sum is carried divided by the
latest non-zero count (``c_i = c_{i-1} n_{i-1} / n_i + grads_i``), so each microbatch's gradient
is added unscaled and divided by the traced total once at the end; a microbatch with ``n_i = 0``
then adds its gradient unweighted, which must therefore be zero (a mean over ``max(n_i, 1)``, as
the bundled losses take). (``optax.MultiSteps`` averages its steps equally, as the unweighted
rule does.) A count that depends on shapes alone (a constant in the traced loss, as
:func:`~lowmem_jax.classifier_loss_fn`'s number of examples) is equal in every microbatch: the
unweighted rule is then exact and used. A loss with no count is accumulated by the unweighted
rule with a one-line warning (once).

BatchNorm semantics: each microbatch is normalised with its *own* batch statistics (as in the
technical report, and as separate devices would), and ``model_state`` (running averages) is
threaded through the scan carry in microbatch order: after the step it equals what ``k``
consecutive forward passes over ``batch_0 .. batch_{k-1}`` would leave. With BatchNorm the
microbatched gradient therefore differs from the full-batch one; without it, it does not.

Gradients are summed in float32 (whatever the parameter dtype) and returned in the dtype that
``grad_fn`` returns them in. The gradient of a parameter in host memory (weight streaming) is
summed there, by the host (:func:`lowmem_jax.techniques.shard.offload.on_host`).

On XLA:CPU the step compiles without XLA's while-loop-invariant code motion
(:func:`compiler_options`): the loop reads the parameters every iteration, and that pass moves
what is computed from them alone (e.g. XLA:CPU's float32 copies of half-precision weights for
its dots and convolutions) out of the loop, where it stays live across
all ``k`` microbatches instead of one layer's use.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent
from jax.extend import core as jex_core

from lowmem_jax.core.base import in_host_memory
from lowmem_jax.core.batches import check_num_microbatches, split_batch
from lowmem_jax.core.host import on_host

PyTree = Any
GradFn = Callable[[PyTree, PyTree, PyTree, Any], tuple[PyTree, PyTree, PyTree]]

__all__ = [
    "COUNT",
    "accumulate_gradients",
    "split_batch",
    "check_num_microbatches",
    "compiler_options",
]

#: The metric under which a loss reports its normaliser (module docstring).
COUNT = "count"

NO_COUNT_WARNING = (
    "microbatches: the loss reports no metrics['count'], so each microbatch's mean counts "
    "equally: exact for a mean over a fixed number of examples; a loss normalised by tokens, "
    "masks or weights should report its normaliser as metrics['count'] to get the full batch's "
    "gradient"
)


def compiler_options(num_microbatches: int, backend: str | None = None) -> dict[str, str]:
    """XLA options for a step that accumulates over ``num_microbatches`` on ``backend`` (default:
    JAX's default): on CPU with ``num_microbatches > 1``,
    ``{"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}`` (module docstring: the
    loop's parameter-only values are computed per microbatch, not held across the loop; the
    arithmetic is the same); otherwise ``{}``."""
    k = check_num_microbatches(num_microbatches)
    if k > 1 and (backend or jax.default_backend()) == "cpu":
        return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
    return {}


def accumulate_gradients(grad_fn: GradFn, num_microbatches: int, shards: int = 1) -> GradFn:
    """Wraps ``grad_fn`` to accumulate over ``num_microbatches`` slices with ``lax.scan``.

    ``num_microbatches == 1`` returns ``grad_fn`` itself. ``rng`` may be ``None``; otherwise
    microbatch ``i`` receives ``jax.random.fold_in(rng, i)``.

    Raises:
      ValueError: for ``num_microbatches < 1`` (here) or a batch size it does not divide (when
        the returned function is traced).
    """
    k = check_num_microbatches(num_microbatches)
    if k == 1:
        return grad_fn

    def accumulated(params, model_state, batch, rng):
        microbatches = split_batch(batch, k, shards)
        first = jax.tree.map(lambda x: x[0], microbatches)
        traced, shapes = jax.make_jaxpr(grad_fn, return_shape=True)(params, model_state, first, rng)
        grads_shape, _, metrics_shape = shapes
        count_at = _count_output(traced, shapes)
        weights = None  # k n_i / sum_j n_j, known before the loop: given at the backward's seed
        if count_at is not None and _takes_weight(grad_fn):
            counts = _counts_before(traced, count_at, (params, model_state), microbatches, rng)
            if counts is not None:
                total = counts.sum()
                weights = jnp.where(total > 0, counts * (k / jnp.where(total > 0, total, 1.0)), 0.0)
        rescaled = count_at is not None and weights is None
        # The gradients have the parameters' structure; one in host memory is summed there.
        in_host = jax.tree.map(in_host_memory, params)

        def zeros(s, host):
            make = lambda: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))  # noqa: E731
            return _on_host(make)() if host else make()

        def add(a, g, host, r=None):
            if r is None:
                return (_on_host(jnp.add) if host else jnp.add)(a, g.astype(a.dtype))
            if host:
                r = jax.device_put(r, jax.memory.Space.Host)
            return (_on_host(_rescaled_add) if host else _rescaled_add)(a, g, r)

        def mean(a, s, host, total=k):
            if host and not isinstance(total, int):
                total = jax.device_put(total, jax.memory.Space.Host)
            fn = lambda a, total: (a / total).astype(s.dtype)  # noqa: E731
            return (_on_host(fn) if host else fn)(a, total)

        grad_sum = jax.tree.map(zeros, grads_shape, in_host)

        def body(carry, xs):
            grad_sum, state, ref = carry
            microbatch, index, *weight = xs
            mb_rng = None if rng is None else jax.random.fold_in(rng, index)
            seed = {"weight": weight[0]} if weight else {}
            grads, state, metrics = grad_fn(params, state, microbatch, mb_rng, **seed)
            r = None
            if rescaled:  # grad_sum holds sum_j n_j g_j / ref (module docstring: why)
                n = metrics[COUNT].astype(jnp.float32)
                r = jnp.where((n > 0) & (ref > 0), ref / jnp.where(n > 0, n, 1.0), 1.0)
                ref = jnp.where(n > 0, n, ref)
            grad_sum = jax.tree.map(lambda a, g, h: add(a, g, h, r), grad_sum, grads, in_host)
            return (grad_sum, state, ref), metrics

        carry = (grad_sum, model_state, jnp.zeros((), jnp.float32))
        xs = (microbatches, jnp.arange(k), *(() if weights is None else (weights,)))
        (grad_sum, model_state, ref), metrics = jax.lax.scan(body, carry, xs)
        if not rescaled:  # equal weights, or the counts' weights given at the seed: sum / k
            grads = jax.tree.map(mean, grad_sum, grads_shape, in_host)
            counts = None if count_at is None else metrics[COUNT].astype(jnp.float32)
            return grads, model_state, _mean_metrics(metrics, counts)
        counts = metrics[COUNT].astype(jnp.float32)
        total = counts.sum() / ref  # grads = grad_sum * ref / sum_i n_i
        grads = jax.tree.map(lambda a, s, h: mean(a, s, h, total), grad_sum, grads_shape, in_host)
        return grads, model_state, _mean_metrics(metrics, counts)

    return accumulated


def _rescaled_add(a: jax.Array, g: jax.Array, r: jax.Array) -> jax.Array:
    """``a * r + g``: the weighted sum kept divided by the last count, so the gradient is added
    as it comes (XLA then adds a scattered gradient, an embedding's, into the sum in place; a
    weighted gradient ``n * g`` would be a buffer of its own: +31.7 MB on the IWSLT step)."""
    return a * r.astype(a.dtype) + g.astype(a.dtype)


def _mean_metrics(metrics: PyTree, counts: jax.Array | None) -> PyTree:
    """The full batch's metrics from the stacked ``[k]`` per-microbatch ones: means (weighted by
    ``counts`` when given), the :data:`COUNT` summed."""
    if isinstance(metrics, Mapping) and COUNT in metrics:
        rest = {key: value for key, value in metrics.items() if key != COUNT}
        if counts is None:
            out = jax.tree.map(lambda m: m.mean(axis=0), rest)
        else:
            total = counts.sum()
            weights = jnp.where(counts > 0, counts, 0)

            def weighted(m):
                w = weights.reshape(weights.shape + (1,) * (m.ndim - 1))
                return (jnp.where(w > 0, m * w, 0).sum(axis=0) / total).astype(m.dtype)

            out = jax.tree.map(weighted, rest)
        return {**out, COUNT: metrics[COUNT].sum(axis=0)}
    return jax.tree.map(lambda m: m.mean(axis=0), metrics)


def _count_output(traced, shapes) -> int | None:
    """The index among the traced ``grad_fn``'s outputs of the loss's :data:`COUNT`, or ``None``
    where microbatches are weighted equally: the loss reports no count (warned about, once) or
    reports a constant of the traced function (a count from shapes alone is the same in each)."""
    _, _, metrics = shapes
    if not isinstance(metrics, Mapping) or COUNT not in metrics:
        warnings.warn(NO_COUNT_WARNING, stacklevel=4)
        return None
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    where = [
        i for i, (path, _) in enumerate(leaves)
        if path[0] == jax.tree_util.SequenceKey(2)
        and path[1:] == (jax.tree_util.DictKey(COUNT),)
    ]  # fmt: skip
    if len(where) != 1 or jnp.shape(metrics[COUNT]) != ():
        raise ValueError(f"metrics[{COUNT!r}] must be a scalar, got {metrics[COUNT]}")
    out = traced.jaxpr.outvars[where[0]]
    constant = isinstance(out, jex_core.Literal) or out in traced.jaxpr.constvars
    return None if constant else where[0]


def _takes_weight(grad_fn: GradFn) -> bool:
    """Whether ``grad_fn`` takes the keyword ``weight`` (the gradient of ``weight * loss``)."""
    try:
        return "weight" in inspect.signature(grad_fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin, some callables)
        return False


def _counts_before(traced, count_at: int, model: PyTree, microbatches: PyTree, rng) -> Any:
    """The ``[k]`` counts of all microbatches from ``traced`` (``grad_fn`` on the first) cut down
    to its output ``count_at``, or ``None`` when that count reads the parameters or the model
    state (``model``: then only the loop can tell it). Evaluated for each microbatch with its
    ``fold_in(rng, i)``; what is left of the loss is the count's own arithmetic."""
    jaxpr = pe.convert_constvars_jaxpr(traced.jaxpr)
    consts = len(traced.jaxpr.constvars)
    used_outputs = [i == count_at for i in range(len(jaxpr.outvars))]
    cut, used = pe.dce_jaxpr(jaxpr, used_outputs)
    model_leaves = len(jax.tree.leaves(model))
    if any(used[consts : consts + model_leaves]):
        return None

    def count(microbatch, index):
        mb_rng = None if rng is None else jax.random.fold_in(rng, index)
        inputs = [*traced.consts, *jax.tree.leaves(model), *jax.tree.leaves(microbatch),
                  *jax.tree.leaves(mb_rng)]  # fmt: skip
        (n,) = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(cut, ()))(
            *[x for x, u in zip(inputs, used, strict=True) if u]
        )
        return jnp.asarray(n, jnp.float32)

    k = jax.tree.leaves(microbatches)[0].shape[0]
    return jax.lax.map(lambda xs: count(*xs), (microbatches, jnp.arange(k)))


def _on_host(fn: Callable) -> Callable:
    return on_host(jax.jit(fn))
