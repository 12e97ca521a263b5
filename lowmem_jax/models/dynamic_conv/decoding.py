"""Decoding for the DynamicConv Transformer: greedy and beam search, incremental.

For a :class:`~lowmem_jax.models.DynamicConvTransformer` (or any model with the same
``encode`` / ``decode`` and incremental ``init_cache`` / ``decode_step`` / ``reorder_cache``
methods) and its token conventions (``model.pad_id``; ``bos_id``, ``eos_id`` given, 1 and 2 by
default as in :mod:`lowmem_jax.data`):

- :func:`greedy_decode`: the argmax token each step.
- :func:`beam_search`: fairseq's beam search with static shapes (``jit``-able): hypotheses are
  scored by ``sum_t log p(y_t | y_<t, x) / len(y) ** length_penalty`` (``len`` counts EOS);
  a sentence stops once ``beam_size`` hypotheses have ended, so ``beam_size=1`` is greedy
  decoding. :func:`sequence_log_prob` scores given hypotheses with the same log-probabilities.

Decoding is incremental: each step feeds one token per hypothesis through the model's
``decode_step`` with a per-hypothesis cache (fairseq's ``incremental_state``), reordered by the
chosen parent beams each step (beam search), so decoding costs ``O(max_len)`` decoder
token-positions per hypothesis, ``K`` times greedy's for beam size ``K``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from lowmem_jax.models.dynamic_conv.model import DynamicConvTransformer

__all__ = ["greedy_decode", "beam_search", "sequence_log_prob", "BOS_ID", "EOS_ID"]

# The special ids of lowmem_jax.data (PAD = 0 is the model's pad_id).
BOS_ID = 1
EOS_ID = 2
PyTree = Any
_NEG_INF = -jnp.inf


def _step_log_probs(logits: jax.Array, pad_id: int) -> jax.Array:
    """``[..., V]`` logits -> float32 log-probabilities with the pad token excluded.

    The pad token is never emitted (it would read as padding on the next step), so its
    probability mass is removed before normalising, as ``greedy_decode`` excludes it.
    """
    logits = logits.astype(jnp.float32).at[..., pad_id].set(_NEG_INF)
    return jax.nn.log_softmax(logits, axis=-1)


def _length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """fairseq's normaliser ``length ** alpha`` (``length`` counts EOS), float32."""
    return jnp.power(jnp.asarray(length, jnp.float32), alpha)


def beam_search(
    model: Any,
    params: PyTree,
    src_tokens: jax.Array,
    *,
    max_len: int,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    stop_early: bool = True,
    return_scores: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Beam search: ``src_tokens [B, S]`` int -> best hypothesis ``[B, max_len]`` int32.

    Each output row is ``y_1 .. y_n EOS PAD ..`` (or ``max_len`` tokens without EOS when no
    hypothesis ended within ``max_len``), the layout of ``tgt_out`` and of ``greedy_decode``.

    Algorithm (fairseq ``SequenceGenerator``, with fixed shapes): ``K = beam_size`` alive
    hypotheses per sentence, cumulative log-probabilities ``a [B, K]`` (float32; pad excluded
    from the softmax). At step ``t`` every alive hypothesis is extended by every token; of the
    ``2K`` best candidates, those ending in EOS among the first ``K`` are *finished* with
    score ``a / (t + 1) ** length_penalty``, and the best ``K`` not ending in EOS stay alive.
    Finished hypotheses go to a pool of the ``K`` best scores. With ``stop_early`` (fairseq's
    default) a sentence is done once ``K`` have finished, so ``beam_size=1`` is greedy decoding
    whatever the length penalty; without it, a sentence is done only when no alive hypothesis
    can still beat the pool's worst score (its best possible score is ``a / max_len ** alpha``,
    as log-probabilities only decrease), which costs more steps and never returns a lower
    score than ``stop_early=True`` (neither mode is guaranteed to beat greedy decoding: the
    greedy prefix can fall out of the beam). The loop stops when every sentence is done or
    after ``max_len`` steps; then alive hypotheses of unfinished sentences join the pool with
    length ``max_len``. The output is the pool's best-scoring hypothesis.

    Cost: step ``t`` runs one incremental decoder step (``decode_step``) on the ``[B * K]``
    newest tokens, then gathers the cache rows of the chosen parents (``reorder_cache``):
    ``O(K * max_len)`` decoder token-positions per sentence. The cache follows the compute dtype.

    Args:
      model: a ``DynamicConvTransformer`` (``encode``, ``init_cache``, ``decode_step``,
        ``reorder_cache`` and ``pad_id``).
      params: its parameters (in the dtype it should compute in).
      src_tokens: ``[B, S]`` int, right-padded with ``model.pad_id``.
      max_len: static output length (EOS included).
      beam_size: ``K >= 1`` (with fewer than ``2K`` possible extensions, the surplus beams
        score ``-inf`` and are never chosen).
      length_penalty: ``alpha >= 0`` (0: raw log-probability; 1: per-token average).
      bos_id, eos_id: the special ids.
      stop_early: stop a sentence at ``K`` finished hypotheses (fairseq ``stop_early``).
      return_scores: also return the best hypotheses' scores ``[B]`` float32 (normalised).

    Raises:
      ValueError: for ``max_len < 1``, ``beam_size < 1`` or ``length_penalty < 0``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if length_penalty < 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    variables = {"params": params}
    pad, k = model.pad_id, beam_size
    b = src_tokens.shape[0]
    memory, src_mask = model.apply(variables, src_tokens, method=model.encode)
    memory = jnp.repeat(memory, k, axis=0)  # [B * K, S, C], beams of a sentence adjacent
    src_mask = jnp.repeat(src_mask, k, axis=0)
    cache = model.apply(variables, memory, src_mask, method=model.init_cache)

    # Alive beams: tokens [B, K, max_len + 1] (column 0 = BOS), scores [B, K]; only beam 0
    # starts alive so the first step does not pick K copies of the same extension.
    alive = jnp.full((b, k, max_len + 1), pad, jnp.int32).at[:, :, 0].set(bos_id)
    alive_logp = jnp.full((b, k), _NEG_INF, jnp.float32).at[:, 0].set(0.0)
    fin = jnp.full((b, k, max_len), pad, jnp.int32)
    fin_score = jnp.full((b, k), _NEG_INF, jnp.float32)
    fin_count = jnp.zeros((b,), jnp.int32)
    done = jnp.zeros((b,), bool)
    batch_idx = jnp.arange(b)[:, None]
    max_lp = _length_penalty(max_len, length_penalty)
    row0 = batch_idx * k  # [B, 1]: the first cache row of each sentence

    def cond(carry):
        t, *_, done, _ = carry
        return (t < max_len) & ~jnp.all(done)

    def body(carry):
        t, alive, alive_logp, fin, fin_score, fin_count, done, cache = carry
        last = jax.lax.dynamic_index_in_dim(alive, t, axis=2, keepdims=False)  # [B, K]
        logits, cache = model.apply(variables, last.reshape(b * k), cache, method=model.decode_step)
        logp = _step_log_probs(logits, pad).reshape(b, k, -1)
        vocab = logp.shape[-1]
        cand = (alive_logp[:, :, None] + logp).reshape(b, k * vocab)
        cand_logp, cand_idx = jax.lax.top_k(cand, 2 * k)  # [B, 2K], best first
        parent, token = cand_idx // vocab, (cand_idx % vocab).astype(jnp.int32)
        cand_tokens = alive[batch_idx, parent]  # [B, 2K, max_len + 1]
        cand_tokens = jax.lax.dynamic_update_index_in_dim(
            cand_tokens, token[..., None], t + 1, axis=2
        )
        is_eos = token == eos_id

        # Finished: EOS among the first K candidates, of sentences not yet done.
        new_fin = is_eos & (jnp.arange(2 * k) < k) & ~done[:, None] & (cand_logp > _NEG_INF)
        new_score = jnp.where(new_fin, cand_logp / _length_penalty(t + 1, length_penalty), _NEG_INF)
        pool_score = jnp.concatenate([fin_score, new_score], axis=1)  # [B, 3K]
        pool_tokens = jnp.concatenate([fin, cand_tokens[:, :, 1:]], axis=1)
        fin_score, keep = jax.lax.top_k(pool_score, k)
        fin = pool_tokens[batch_idx, keep]
        fin_count = fin_count + new_fin.sum(axis=1, dtype=jnp.int32)

        # Alive: the best K candidates not ending in EOS (at most K of the 2K end in EOS).
        alive_logp, keep = jax.lax.top_k(jnp.where(is_eos, _NEG_INF, cand_logp), k)
        alive = cand_tokens[batch_idx, keep]
        # Each new alive beam continues from its parent's decoder state: cache rows follow.
        parent_rows = (row0 + parent[batch_idx, keep]).reshape(b * k)
        cache = model.reorder_cache(cache, parent_rows)

        full = fin_count >= k
        if not stop_early:
            # Done only when no alive hypothesis can still beat the pool's worst score.
            full &= fin_score[:, k - 1] >= alive_logp[:, 0] / max_lp
        return t + 1, alive, alive_logp, fin, fin_score, fin_count, done | full, cache

    carry = (jnp.int32(0), alive, alive_logp, fin, fin_score, fin_count, done, cache)
    _, alive, alive_logp, fin, fin_score, _, done, _ = jax.lax.while_loop(cond, body, carry)

    # Sentences still unfinished after max_len steps: alive hypotheses (max_len tokens, no EOS)
    # compete with whatever finished.
    open_score = jnp.where(done[:, None], _NEG_INF, alive_logp / max_lp)
    pool_score = jnp.concatenate([fin_score, open_score], axis=1)
    pool_tokens = jnp.concatenate([fin, alive[:, :, 1:]], axis=1)
    best = jnp.argmax(pool_score, axis=1)
    tokens = pool_tokens[jnp.arange(b), best]
    if return_scores:
        return tokens, pool_score[jnp.arange(b), best]
    return tokens


def sequence_log_prob(
    model: Any,
    params: PyTree,
    src_tokens: jax.Array,
    tokens: jax.Array,
    *,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> jax.Array:
    """``sum_t log p(y_t | y_<t, x)`` of hypotheses ``tokens [B, T]`` -> ``[B]`` float32.

    ``tokens`` is a decoder output (``y_1 .. y_n EOS PAD ..``); the sum runs up to and including
    the first EOS (all ``T`` tokens if there is none), with the log-probabilities
    :func:`beam_search` uses (pad excluded from the softmax), so it reproduces beam search's
    scores at ``length_penalty=0``.
    """
    variables = {"params": params}
    pad = model.pad_id
    tokens = tokens.astype(jnp.int32)
    tgt_in = jnp.concatenate(
        [jnp.full((tokens.shape[0], 1), bos_id, jnp.int32), tokens[:, :-1]], axis=1
    )
    # Causal decoder: the logits at t see BOS y_1 .. y_t only, as during decoding; positions
    # after the first EOS are left out of the sum.
    is_eos = tokens == eos_id
    after_eos = jnp.cumsum(is_eos, axis=1) - is_eos > 0  # strictly after the first EOS
    memory, src_mask = model.apply(variables, src_tokens, method=model.encode)
    logits = model.apply(variables, tgt_in, memory, src_mask, method=model.decode)
    logp = jnp.take_along_axis(_step_log_probs(logits, pad), tokens[..., None], axis=-1)[..., 0]
    return jnp.where(after_eos, 0.0, logp).sum(axis=1)


def greedy_decode(
    model: DynamicConvTransformer,
    params: Any,
    src_tokens: jax.Array,
    max_len: int,
    *,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> jax.Array:
    """Greedy decoding: ``src_tokens [B, S]`` -> ``[B, max_len]`` int32 target tokens.

    Encodes once, then feeds ``BOS y_1 .. y_{max_len - 1}`` one token per step through
    :meth:`DynamicConvTransformer.decode_step` (incremental state: ``O(max_len)`` decoder work,
    not a re-run of the decoder over the prefix) and takes the argmax. The pad token is never
    emitted; after a row's EOS the row is filled with ``model.pad_id``. Jittable with ``max_len``
    static. The decoder state follows the compute dtype (``model.dtype`` or the params').
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    variables = {"params": params}
    memory, src_mask = model.apply(variables, src_tokens, method=model.encode)
    cache = model.apply(variables, memory, src_mask, method=model.init_cache)
    pad = model.pad_id
    b = src_tokens.shape[0]
    out = jnp.full((b, max_len), pad, jnp.int32)

    def body(t, carry):
        out, last, done, cache = carry
        logits, cache = model.apply(variables, last, cache, method=model.decode_step)
        # An emitted pad would be read as padding on the next step (and shift positions).
        logits = logits.at[:, pad].set(-jnp.inf)
        nxt = jnp.where(done, pad, logits.argmax(-1).astype(jnp.int32))
        out = jax.lax.dynamic_update_index_in_dim(out, nxt, t, axis=1)
        return out, nxt, done | (nxt == eos_id), cache

    carry = (out, jnp.full((b,), bos_id, jnp.int32), jnp.zeros((b,), bool), cache)
    return jax.lax.fori_loop(0, max_len, body, carry)[0]
