import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import lowmem_jax as lm


@pytest.mark.parametrize(
    "name, param, compute",
    [
        ("fp32", jnp.float32, jnp.float32),
        ("bf16", jnp.bfloat16, jnp.bfloat16),
        ("fp16", jnp.float16, jnp.float16),
        ("mixed_bf16", jnp.float32, jnp.bfloat16),
        ("mixed_fp16", jnp.float32, jnp.float16),
    ],
)
def test_named_policies(name, param, compute):
    policy = lm.techniques.precision.get_policy(name)
    assert policy.param_dtype == param and policy.compute_dtype == compute
    assert policy.output_dtype == jnp.float32


def test_unknown_precision_names_parameter_and_choices():
    with pytest.raises(ValueError, match=r"precision='fp8'.*mixed_fp16"):
        lm.techniques.precision.get_policy("fp8")


def test_cast_floating_only_touches_floats():
    tree = {"w": jnp.ones(2), "ids": jnp.arange(2), "mask": jnp.array([True, False])}
    out = lm.techniques.precision.cast_floating(tree, jnp.float16)
    assert out["w"].dtype == jnp.float16
    assert out["ids"].dtype == tree["ids"].dtype and out["mask"].dtype == jnp.bool_


def test_cast_loss_fn_computes_in_half_and_returns_fp32_master_grads():
    seen = {}

    def loss_fn(params, model_state, batch, rng):
        seen["w"], seen["x"], seen["label"] = (
            params["w"].dtype,
            batch["x"].dtype,
            batch["label"].dtype,
        )
        seen["state"] = model_state["count"].dtype
        loss = jnp.sum(params["w"] * batch["x"])
        return loss, (model_state, {"loss": loss})

    wrapped = lm.cast_loss_fn(loss_fn, "mixed_fp16")
    params = {"w": jnp.ones(4, jnp.float32)}
    batch = {"x": jnp.full(4, 0.5), "label": jnp.zeros(4, jnp.int32)}
    state = {"count": jnp.zeros((), jnp.float32)}
    grads, (_, metrics) = jax.grad(wrapped, has_aux=True)(params, state, batch, None)
    assert seen == {"w": jnp.float16, "x": jnp.float16, "label": jnp.int32, "state": jnp.float32}
    assert grads["w"].dtype == jnp.float32  # master weights stay fp32
    assert metrics["loss"].dtype == jnp.float32


def test_cast_floating_handles_abstract_leaves():
    tree = {
        "w": jax.ShapeDtypeStruct((2, 3), jnp.float32),
        "i": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    out = lm.techniques.precision.cast_floating(tree, jnp.float16)
    assert out["w"] == jax.ShapeDtypeStruct((2, 3), jnp.float16) and out["i"] == tree["i"]


class _OwnDtype(nn.Module):
    """Layers that fix their compute dtype themselves (as models configured by their own
    config do): the plan's precision cannot reach them."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(32, dtype=jnp.float32)(x))
        return nn.Dense(4, dtype=jnp.float32)(x)


def test_precision_on_layers_with_their_own_dtype_is_no_effect_naming_the_setting():
    model, x = _OwnDtype(), jnp.ones((8, 8))
    plan = lm.Plan(precision="mixed_bf16")
    configured = plan.configure_model(model)
    params = model.init(jax.random.key(0), x)["params"]
    tx = plan.wrap_optimizer(optax.sgd(0.1), params)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    batch = {"image": x, "label": jnp.zeros(8, jnp.int32)}
    step = lm.make_train_step(lm.classifier_loss_fn(configured), tx, plan)
    (verdict,) = [v for v in lm.verdicts(step, state, batch, plan=plan, tx=tx)
                  if v.technique == "precision"]  # fmt: skip
    assert not verdict.took_effect
    assert verdict.evidence.startswith("0 of 5 matmuls")  # forward 2, backward 3
    assert "set it to bfloat16" in verdict.evidence
