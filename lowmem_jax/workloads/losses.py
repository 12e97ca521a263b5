"""Loss functions in the train step's signature, for the benchmark tasks.

``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``: the loss is a
float32 scalar, ``metrics`` a dict of float32 scalars, ``rng`` the dropout key (or ``None``).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lowmem_jax.core.base import LossFn

__all__ = ["classifier_loss_fn", "translation_loss_fn", "lm_loss_fn", "mlm_loss_fn"]


def classifier_loss_fn(model: nn.Module, *, label_smoothing: float = 0.0) -> LossFn:
    """Softmax cross-entropy loss for a Flax classifier ``model(images, train) -> logits``.

    ``batch = {"image": [B, H, W, C] float, "label": [B] int}``. The loss is the mean over the
    batch, computed in float32; metrics are ``loss``, ``accuracy`` and ``count`` (the number of
    examples, from the batch's shape: the same in every microbatch, so microbatching's equal
    weights are exact; :mod:`lowmem_jax.techniques.microbatches.accumulate`). Model state
    collections (``batch_stats``) are updated as in training mode. A label outside
    ``[0, classes)`` makes the loss NaN (the step is then skipped and counted, not trained on a
    zero target).
    """

    def loss_fn(params, model_state, batch, rng):
        mutable = list(model_state)
        out = model.apply(
            {"params": params, **model_state},
            batch["image"],
            train=True,
            mutable=mutable or False,
            rngs={"dropout": rng} if rng is not None else {},
        )
        logits, new_state = out if mutable else (out, {})
        logits = logits.astype(jnp.float32)
        labels = batch["label"]
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets).mean()
        loss = loss * _nan_unless_in_range(labels, logits.shape[-1])
        accuracy = (logits.argmax(-1) == labels).mean()
        count = jnp.float32(labels.shape[0])
        return loss, (dict(new_state), {"loss": loss, "accuracy": accuracy, "count": count})

    return loss_fn


def _nan_unless_in_range(labels: jax.Array, classes: int) -> jax.Array:
    """1.0, or NaN when a label lies outside ``[0, classes)`` (one-hot of such a label is all
    zeros, a loss of -0.0 that trains on nothing): the loss and its gradient become
    non-finite, so the train step skips the update and counts it."""
    in_range = ((labels >= 0) & (labels < classes)).all()
    return jnp.where(in_range, 1.0, jnp.nan).astype(jnp.float32)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _token_losses(
    logits: jax.Array, labels: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array]:
    """Per-token (smoothed loss, nll), float32 ``[B, T]``, from ``logits [B, T, V]`` (any dtype).

    ``(1 - eps) * nll + eps * mean_v(-log p_v)`` equals the cross-entropy against the smoothed
    one-hot without materialising a ``[B, T, V]`` target. Checkpointed: the backward pass keeps
    the logits in their compute dtype and recomputes the float32 log-probabilities, instead of
    saving a float32 ``[B, T, V]`` array (the largest residual of the model under bf16).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll_tok = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    smooth_tok = -logp.mean(axis=-1)
    return (1.0 - label_smoothing) * nll_tok + label_smoothing * smooth_tok, nll_tok


def translation_loss_fn(
    model: nn.Module,
    *,
    label_smoothing: float = 0.1,
    pad_id: int = 0,
    token_weighted: bool = True,
) -> LossFn:
    """Label-smoothed token cross-entropy for ``model(src, tgt_in, train) -> logits``.

    ``batch = {"src": [B, S], "tgt_in": [B, T], "tgt_out": [B, T]}`` int32. Per target token,
    ``loss = CE(logits, (1 - eps) * onehot(y) + eps / V)`` (fairseq's
    ``label_smoothed_cross_entropy`` with ``eps = label_smoothing``), in float32, averaged over
    tokens with ``tgt_out != pad_id``. Metrics: ``loss``, ``nll_loss`` (unsmoothed),
    ``accuracy`` (argmax == target over non-pad tokens) and ``count`` (the non-pad tokens,
    float32; ``tokens`` with ``token_weighted=False``). ``rng`` (if not None) is the dropout key.

    Microbatching (:func:`lowmem_jax.accumulate_gradients`): the loss reports its tokens as
    ``count`` (``token_weighted=True``, the default), each microbatch is weighted by them, and
    with ``k > 1`` the gradients and metrics are the full batch's token means (the weights given
    at the backward pass's seed: the step compiles as the unweighted one). ``token_weighted=False``
    weights microbatches equally (it warns under microbatches): the mean of per-microbatch token
    means, equal to the full-batch token mean only when microbatches hold equal token counts.

    Raises:
      ValueError: for ``label_smoothing`` outside ``[0, 1)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply(
            {"params": params, **model_state},
            batch["src"],
            batch["tgt_in"],
            train=True,
            rngs={"dropout": rng} if rng is not None else {},
        )
        labels = batch["tgt_out"]
        weights = (labels != pad_id).astype(jnp.float32)
        tokens = weights.sum()
        denom = jnp.maximum(tokens, 1.0)  # an all-padding microbatch contributes 0, not NaN
        loss_tok, nll_tok = _token_losses(logits, labels, label_smoothing)
        loss = (loss_tok * weights).sum() / denom * _nan_unless_in_range(labels, logits.shape[-1])
        nll = (nll_tok * weights).sum() / denom
        accuracy = ((logits.argmax(-1) == labels) * weights).sum() / denom
        # The non-pad tokens: the count the microbatches are weighted by (summed over them), or
        # unweighted a metric of its own (averaged over them).
        metrics = {"loss": loss, "nll_loss": nll, "accuracy": accuracy,
                   ("count" if token_weighted else "tokens"): tokens}  # fmt: skip
        return loss, (dict(model_state), metrics)

    return loss_fn


def lm_loss_fn(model: nn.Module) -> LossFn:
    """Next-token cross-entropy for a causal language model ``model(inputs, train) -> logits``.

    ``batch = {"inputs": [B, T], "targets": [B, T]}`` int32, packed sequences (``targets[:, t]``
    the token after ``inputs[:, t]``; every position counts, there is no padding). The loss is
    the mean over the ``B * T`` tokens of ``-log softmax(logits)[target]``, in float32 (the
    float32 log-probabilities recomputed in the backward pass, not stored: :func:`_token_losses`).
    Metrics: ``loss``, ``accuracy`` (argmax == target) and ``count`` (``B * T``, from the
    shape: equal in every microbatch, so microbatching's equal weights are exact). A target
    outside ``[0, V)`` makes the loss NaN (the step is skipped and counted).

    A model with a non-zero ``loss_chunk`` (``Plan.loss_chunk``; the bundled
    :class:`~lowmem_jax.models.Llama`) is asked for its per-token ``(nll, correct)`` instead,
    ``model(inputs, train, targets=targets)``: the logits a chunk of tokens at a time, never whole
    (:mod:`lowmem_jax.techniques.loss_chunk`); the loss and its gradient are the same within
    float32 rounding.
    """
    chunked = bool(getattr(model, "loss_chunk", 0))

    def loss_fn(params, model_state, batch, rng):
        variables = {"params": params, **model_state}
        rngs = {"dropout": rng} if rng is not None else {}
        labels = batch["targets"]
        if chunked:
            nll_tok, correct = model.apply(variables, batch["inputs"], train=True,
                                           targets=labels, rngs=rngs)  # fmt: skip
            vocab = model.vocab_size
        else:
            logits = model.apply(variables, batch["inputs"], train=True, rngs=rngs)
            _, nll_tok = _token_losses(logits, labels, 0.0)
            correct, vocab = logits.argmax(-1) == labels, logits.shape[-1]
        loss = nll_tok.mean() * _nan_unless_in_range(labels, vocab)
        accuracy = correct.mean()
        count = jnp.float32(labels.size)
        return loss, (dict(model_state), {"loss": loss, "accuracy": accuracy, "count": count})

    return loss_fn


def mlm_loss_fn(model: nn.Module) -> LossFn:
    """Masked-LM cross-entropy for ``model(inputs, train) -> logits`` (BERT's objective).

    ``batch = {"inputs": [B, T] int32 (the masked sequence), "targets": [B, T] int32 (the
    original tokens), "weights": [B, T] float32}`` (1 where the loss reads the position: the
    masked ones). The loss is ``sum(w * nll) / max(sum(w), 1)`` in float32. Metrics: ``loss``,
    ``accuracy`` (over the weighted positions) and ``count`` (``sum(w)``): microbatches are
    weighted by the positions each holds, so ``k`` microbatches give the full batch's mean
    (:mod:`lowmem_jax.techniques.microbatches.accumulate`). ``rng`` is the dropout key.
    """

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply(
            {"params": params, **model_state},
            batch["inputs"],
            train=True,
            rngs={"dropout": rng} if rng is not None else {},
        )
        labels, weights = batch["targets"], batch["weights"].astype(jnp.float32)
        count = weights.sum()
        denom = jnp.maximum(count, 1.0)
        _, nll_tok = _token_losses(logits, labels, 0.0)
        loss = (nll_tok * weights).sum() / denom * _nan_unless_in_range(labels, logits.shape[-1])
        accuracy = ((logits.argmax(-1) == labels) * weights).sum() / denom
        return loss, (dict(model_state), {"loss": loss, "accuracy": accuracy, "count": count})

    return loss_fn
