"""Microbatching: gradient accumulation over ``k`` slices of a batch with ``lax.scan``.

A gradient function here has the signature

    grad_fn(params, model_state, batch, rng) -> (grads, model_state, metrics)

``batch`` is a pytree whose leaves share a leading batch axis ``B``; ``metrics`` is a pytree of
scalars. :func:`accumulate_gradients` returns a function of the same signature that splits every
batch leaf ``[B, ...]`` into ``k`` contiguous microbatches ``[k, B/k, ...]`` and runs ``grad_fn``
on them in a ``lax.scan``, so only one microbatch's activations are live at a time:

    grads   = (1/k) * sum_i grad_fn(params, state_i, batch_i, fold_in(rng, i)).grads
    metrics = (1/k) * sum_i metrics_i

For a loss that is a mean over examples, the mean of microbatch gradients equals the full-batch
gradient exactly (up to float rounding).

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.core.base import in_host_memory
from lowmem_jax.core.batches import check_num_microbatches, split_batch
from lowmem_jax.core.host import on_host

PyTree = Any
GradFn = Callable[[PyTree, PyTree, PyTree, Any], tuple[PyTree, PyTree, PyTree]]

__all__ = ["accumulate_gradients", "split_batch", "check_num_microbatches", "compiler_options"]


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
        grads_shape, _, _ = jax.eval_shape(grad_fn, params, model_state, first, rng)
        # The gradients have the parameters' structure; one in host memory is summed there.
        in_host = jax.tree.map(in_host_memory, params)

        def zeros(s, host):
            make = lambda: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))  # noqa: E731
            return _on_host(make)() if host else make()

        def add(a, g, host):
            return (_on_host(jnp.add) if host else jnp.add)(a, g.astype(a.dtype))

        def mean(a, s, host):
            fn = lambda a: (a / k).astype(s.dtype)  # noqa: E731
            return (_on_host(fn) if host else fn)(a)

        grad_sum = jax.tree.map(zeros, grads_shape, in_host)

        def body(carry, xs):
            grad_sum, state = carry
            microbatch, index = xs
            mb_rng = None if rng is None else jax.random.fold_in(rng, index)
            grads, state, metrics = grad_fn(params, state, microbatch, mb_rng)
            grad_sum = jax.tree.map(add, grad_sum, grads, in_host)
            return (grad_sum, state), metrics

        (grad_sum, model_state), metrics = jax.lax.scan(
            body, (grad_sum, model_state), (microbatches, jnp.arange(k))
        )
        grads = jax.tree.map(mean, grad_sum, grads_shape, in_host)
        metrics = jax.tree.map(lambda m: m.mean(axis=0), metrics)
        return grads, model_state, metrics

    return accumulated


def _on_host(fn: Callable) -> Callable:
    return on_host(jax.jit(fn))
