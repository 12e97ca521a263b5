import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm


def test_dynamic_defaults_follow_the_convention():
    ls = lm.make_loss_scale("dynamic")
    assert float(ls.loss_scale) == 2.0**15
    assert (ls.period, ls.factor, ls.min_loss_scale) == (2000, 2.0, 1.0)


def test_overflow_halves_and_resets_counter():
    ls = lm.make_loss_scale("dynamic", period=3)
    ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    assert int(ls.counter) == 2
    ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == 2.0**14 and int(ls.counter) == 0


def test_grows_after_period_finite_steps():
    ls = lm.make_loss_scale("dynamic", period=3, initial_scale=8.0)
    for _ in range(2):
        ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 8.0
    ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 16.0 and int(ls.counter) == 0


def test_floor_survives_jit_and_holds():
    ls = lm.make_loss_scale("dynamic", initial_scale=4.0, min_loss_scale=2.0)

    @jax.jit
    def overflow_three_times(state):
        for _ in range(3):
            state = state.adjust(jnp.array(False))
        return state

    out = overflow_three_times(ls)
    assert out.min_loss_scale == 2.0  # static config survived the jit boundary
    assert float(out.loss_scale) == 2.0  # and was applied inside it
    out = jax.jit(lambda s: s.adjust(jnp.array(False)))(out)
    assert float(out.loss_scale) == 2.0


def test_scale_unscale_roundtrip_keeps_dtype():
    ls = lm.make_loss_scale("static", initial_scale=1024.0)
    tree = {"a": jnp.ones((3,), jnp.float16), "b": jnp.full((2,), 0.5, jnp.float32)}
    scaled = ls.scale(tree)
    assert scaled["a"].dtype == jnp.float16 and float(scaled["a"][0]) == 1024.0
    back = ls.unscale(scaled)
    np.testing.assert_array_equal(back["b"], tree["b"])


def test_noop_is_identity():
    ls = lm.make_loss_scale("none")
    tree = {"a": jnp.arange(3.0)}
    assert ls.scale(tree) is tree and ls.adjust(jnp.array(False)) is ls


def test_all_finite_and_select_tree():
    good = {"w": jnp.ones(3), "i": jnp.arange(3)}
    bad = {"w": jnp.array([1.0, jnp.inf, 0.0]), "i": jnp.arange(3)}
    all_finite = lm.techniques.loss_scale.all_finite
    assert bool(all_finite(good)) and not bool(all_finite(bad))
    assert not bool(lm.techniques.loss_scale.all_finite({"w": jnp.array([jnp.nan])}))
    picked = lm.techniques.loss_scale.select_tree(jnp.array(False), bad, good)
    np.testing.assert_array_equal(picked["w"], good["w"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "sometimes"}, "loss_scale"),
        ({"kind": "dynamic", "period": 0}, "period"),
        ({"kind": "dynamic", "factor": 1.0}, "factor"),
        ({"kind": "dynamic", "min_loss_scale": 0.0}, "min_loss_scale"),
        ({"kind": "static", "initial_scale": -1.0}, "initial_scale"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=match):
        lm.make_loss_scale(kind, **kwargs)
