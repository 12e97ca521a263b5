import jax
import jax.numpy as jnp
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
