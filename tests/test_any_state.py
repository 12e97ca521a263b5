"""The analyses on a hand-written step's state, whatever it is: a dict, flax's
``train_state.TrainState`` (no ``model_state``, no ``rng``); a loss with dropout gets a key; a
state without ``params`` is refused in one line."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import lowmem_jax as lm


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(64)(x)))
        return nn.Dense(10)(x)


MODEL = Net()
BATCH = {"image": jnp.ones((8, 16)), "label": jnp.zeros((8,), jnp.int32)}
PARAMS = MODEL.init(jax.random.key(0), BATCH["image"], train=False)["params"]
TX = optax.adam(1e-3)
LOSS = lm.classifier_loss_fn(MODEL)  # draws dropout from its rng argument


def _grads(params, rng):
    return jax.grad(lambda p: LOSS(p, {}, BATCH, rng)[0])(params)


@jax.jit
def dict_step(state, batch):
    grads = _grads(state["params"], jax.random.key(1))
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


@jax.jit
def flax_step(state, batch):
    return state.apply_gradients(grads=_grads(state.params, jax.random.key(1)))


STATES = {
    "dict": (dict_step, {"params": PARAMS, "opt_state": TX.init(PARAMS)}),
    "flax TrainState": (
        flax_step,
        train_state.TrainState.create(apply_fn=MODEL.apply, params=PARAMS, tx=TX),
    ),
}


@pytest.mark.parametrize("kind", STATES)
def test_analyze_verdicts_and_inspect_take_the_state_a_user_s_step_takes(kind):
    step, state = STATES[kind]
    report = lm.analyze(step, state, BATCH, loss_fn=LOSS)
    params = sum(x.size * 4 for x in jax.tree.leaves(PARAMS))
    assert report.analytic["model_bytes"] == params
    moments = report.analytic["optimizer_breakdown"]
    assert moments["slot:mu"] == moments["slot:nu"] == moments["gradients"] == params
    assert report.analytic["activation_bytes"] > 0  # the loss traced with a key for dropout
    assert report.xla["total_bytes"] > 3 * params
    plan = lm.Plan(remat="full")
    assert lm.verdicts(step, state, BATCH, plan=plan, tx=TX, loss_fn=LOSS)
    assert lm.inspect(step, state, BATCH).peak_bytes > 0


def test_a_state_without_params_is_refused_in_one_line():
    state = {"weights": PARAMS, "opt_state": TX.init(PARAMS)}
    with pytest.raises(ValueError, match=r"state: .*`params`.*it has: opt_state, weights\)") as e:
        lm.analyze(dict_step, state, BATCH)
    assert "\n" not in str(e.value)
