import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILE, load_benchmark

import lowmem_jax as lm
from lowmem_jax.models import DynamicConvTransformer, beam_search, greedy_decode, sequence_log_prob
from lowmem_jax.training.averaging import average_checkpoints, average_last_checkpoints
from lowmem_jax.training.checkpointing import Checkpointer, checkpoint_steps, param_checksum
from lowmem_jax.training.tasks.translation import bleu, detokenize

# A tiny vocabulary (PAD, BOS, EOS + 3 content ids) so that a random model emits EOS often.
V, MAX_LEN = 6, 8
MODEL = DynamicConvTransformer.small(
    V,
    V,
    embed_dim=32,
    ffn_dim=64,
    dropout=0.0,
    encoder_kernel_sizes=(3,),
    decoder_kernel_sizes=(3,),
)


@functools.cache
def _setup():
    rng = np.random.default_rng(0)
    src = rng.integers(3, V, size=(24, 7))
    src[:, -1] = 2
    src[:8, 4:] = [2, 0, 0]  # some shorter, right-padded sources
    src = jnp.asarray(src, jnp.int32)
    params = jax.jit(MODEL.init, compiler_options=FAST_COMPILE)(jax.random.key(1), src, src)
    # A wider random output matrix: the initial one makes every step pick the same token; this
    # one gives a mix of tokens, EOS after 1 to 7 tokens in half of the rows, and no EOS in others.
    embed_out = jax.random.normal(jax.random.key(3), params["params"]["embed_out"].shape)
    return src, {**params["params"], "embed_out": embed_out}


@functools.cache
def _decode(beam_size=None, length_penalty=1.0, stop_early=True):
    if beam_size is None:
        fn = functools.partial(greedy_decode, MODEL, max_len=MAX_LEN)
    else:
        fn = functools.partial(
            beam_search, MODEL, max_len=MAX_LEN, beam_size=beam_size,
            length_penalty=length_penalty, stop_early=stop_early, return_scores=True,
        )  # fmt: skip
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def _score(params, src, tokens):
    fn = jax.jit(functools.partial(sequence_log_prob, MODEL), compiler_options=FAST_COMPILE)
    return np.asarray(fn(params, src, tokens))


def test_beam_size_one_equals_greedy():
    src, params = _setup()
    greedy = np.asarray(_decode()(params, src))
    tokens, _ = _decode(1)(params, src)
    np.testing.assert_array_equal(np.asarray(tokens), greedy)
    assert (greedy == 2).any(axis=1).sum() >= 4  # the comparison covers EOS-ended rows


def _load_decode_benchmark():
    return load_benchmark("decode")


# The decoding interface computed the old way (the full decode over the prefix buffer at every
# step, O(max_len^2)): the reference the benchmark times, here for reference outputs.
_FullPrefixDecoder = _load_decode_benchmark().full_prefix_decoder(MODEL, MAX_LEN)


@pytest.mark.parametrize("stop_early", [True, False])
def test_beam_search_incremental_equals_full_prefix(stop_early):
    src, params = _setup()
    tokens, scores = _decode(4, 1.0, stop_early)(params, src)
    full = jax.jit(
        functools.partial(
            beam_search, _FullPrefixDecoder, max_len=MAX_LEN, beam_size=4,
            stop_early=stop_early, return_scores=True,
        ),
        compiler_options=FAST_COMPILE,
    )  # fmt: skip
    ref_tokens, ref_scores = full(params, src)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(ref_scores), rtol=1e-5, atol=1e-6)
    assert (np.asarray(tokens) == 2).any(axis=1).sum() >= 4  # EOS-ended rows are compared too


def test_beam_four_scores_at_least_greedy_on_model_log_probs():
    # stop_early=False: a sentence ends when no alive hypothesis can beat the finished ones.
    # (fairseq's stop_early=True ends at 4 finished hypotheses, which with this 6-token
    # vocabulary are often early, unlikely EOS endings: a worse search on tiny vocabularies.)
    src, params = _setup()
    tokens, scores = _decode(4, 0.0, stop_early=False)(params, src)
    greedy = _decode()(params, src)
    beam_logp, greedy_logp = _score(params, src, tokens), _score(params, src, greedy)
    # With length_penalty=0 the beam score is the hypothesis' log-probability.
    np.testing.assert_allclose(np.asarray(scores), beam_logp, rtol=1e-5, atol=1e-5)
    assert (beam_logp >= greedy_logp - 1e-5).all()
    assert (beam_logp > greedy_logp + 1e-3).any()  # the search does find better hypotheses


def test_beam_output_shape_and_eos_pad_conventions():
    src, params = _setup()
    tokens, scores = _decode(4)(params, src)
    tokens = np.asarray(tokens)
    assert tokens.shape == (src.shape[0], MAX_LEN) and tokens.dtype == np.int32
    assert scores.shape == (src.shape[0],) and np.isfinite(np.asarray(scores)).all()
    ended = 0
    for row in tokens:
        eos = np.flatnonzero(row == 2)
        if eos.size:
            ended += 1
            assert (row[: eos[0]] != 0).all() and (row[eos[0] + 1 :] == 0).all()
        else:
            assert (row != 0).all()  # no EOS: max_len real tokens
    assert ended >= 4


def test_beam_search_validation_errors():
    src, params = _setup()
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(MODEL, params, src, max_len=4, beam_size=0)
    with pytest.raises(ValueError, match="max_len"):
        beam_search(MODEL, params, src, max_len=0)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(MODEL, params, src, max_len=4, length_penalty=-1.0)


def test_detokenize_ids_and_bleu():
    rows = np.array([[5, 9, 4, 7, 2, 0], [3, 3, 8, 6, 11, 2]])
    assert detokenize(rows) == ["5 9 4 7", "3 3 8 6 11"]
    assert detokenize([[1, 4, 0, 2, 9]]) == ["4"]  # BOS / PAD skipped, cut at EOS
    refs = ["the cat sat on the mat today", "a quick brown fox jumps over it"]
    assert bleu(refs, refs) == pytest.approx(100.0)
    assert bleu(["zz yy xx ww vv uu tt", "qq pp oo nn mm ll kk"], refs) == pytest.approx(
        0.0, abs=1e-6
    )
    assert 0.0 < bleu(["the cat sat on the mat", refs[1]], refs) < 100.0
    assert bleu(detokenize(rows), detokenize(rows), tokenize="none") == pytest.approx(100.0)
    with pytest.raises(ValueError, match="equal lengths"):
        bleu(refs, refs[:1])
    with pytest.raises(ValueError, match="empty"):
        bleu([], [])


def test_average_checkpoints_of_two_pytrees():
    a = {"w": jnp.array([1.0, 2.0]), "h": jnp.array([1.0, 3.0], jnp.bfloat16), "n": jnp.array(3)}
    b = {"w": jnp.array([3.0, 6.0]), "h": jnp.array([2.0, 4.0], jnp.bfloat16), "n": jnp.array(6)}
    avg = average_checkpoints([a, b])
    np.testing.assert_allclose(avg["w"], [2.0, 4.0])
    assert avg["h"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(avg["h"], np.float32), [1.5, 3.5])
    assert int(avg["n"]) == 4  # integers: floor of the mean, as fairseq
    # TrainStates contribute their params (pytrees only: the caller picks what to average).
    plan, tx = lm.Plan(), optax.adam(1e-3)
    states = [
        lm.TrainState.create(params=p, tx=tx, plan=plan) for p in ({"w": a["w"]}, {"w": b["w"]})
    ]
    np.testing.assert_allclose(average_checkpoints([s.params for s in states])["w"], [2.0, 4.0])
    with pytest.raises(ValueError, match="structure"):
        average_checkpoints([a, {"w": a["w"]}])
    with pytest.raises(ValueError, match="at least one"):
        average_checkpoints([])


def test_average_last_checkpoints_from_checkpointer(tmp_path):
    plan, tx = lm.Plan(), optax.adam(1e-3)
    state = lm.TrainState.create(params={"w": jnp.zeros(3)}, tx=tx, plan=plan)
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    for step in range(1, 5):
        ckpt.save(step, state.replace(step=jnp.int32(step), params={"w": jnp.full(3, float(step))}))
    params, steps = average_last_checkpoints(ckpt, jax.eval_shape(lambda: state), 2)
    assert steps == [3, 4]
    np.testing.assert_allclose(params["w"], [3.5, 3.5, 3.5])
    ckpt.close()
    assert checkpoint_steps(tmp_path) == [2, 3, 4] and checkpoint_steps(tmp_path / "none") == []
    params, steps = average_last_checkpoints(str(tmp_path), state, 3)  # from the directory
    assert steps == [2, 3, 4]
    np.testing.assert_allclose(params["w"], [3.0, 3.0, 3.0])
    with pytest.raises(FileNotFoundError, match="n=4"):
        average_last_checkpoints(str(tmp_path), state, 4)
    # What to average of each restored state: here the step counter, as an array.
    steps_avg, _ = average_last_checkpoints(str(tmp_path), state, 2, params=lambda s: s.step)
    assert int(steps_avg) == 3  # integers: floor of (3 + 4) / 2
    assert param_checksum(params) == param_checksum({"w": np.full(3, 3.0, np.float32)})
    assert param_checksum(params) != param_checksum({"w": np.full(3, 3.5, np.float32)})
