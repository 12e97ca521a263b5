import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.analysis.memory import saved_activation_bytes
from lowmem_jax.models.layers import BatchNorm


def _run(module, variables, x, train):
    def f(params, x):
        out, upd = module.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            mutable=["batch_stats"],
        )
        return jnp.sum(jnp.sin(out)), (out, upd)

    (_, (out, upd)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        variables["params"], x
    )
    return out, upd, grads


@pytest.mark.parametrize("train", [True, False])
def test_matches_flax_batchnorm_in_float32(train):
    x = jnp.asarray(np.random.default_rng(0).normal(2.0, 3.0, size=(8, 5, 5, 6)), jnp.float32)
    ours = BatchNorm(use_running_average=not train, momentum=0.8)
    ref = nn.BatchNorm(use_running_average=not train, momentum=0.8, epsilon=1e-5)
    variables = ref.init(jax.random.key(0), x)
    variables = {
        "params": {"scale": jnp.linspace(0.5, 2, 6), "bias": jnp.linspace(-1, 1, 6)},
        "batch_stats": {"mean": jnp.full(6, 0.3), "var": jnp.full(6, 1.7)},
    }
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(
        jnp.shape, variables
    )
    for a, b in zip(
        jax.tree.leaves(_run(ours, variables, x, train)),
        jax.tree.leaves(_run(ref, variables, x, train)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_half_precision_saves_only_half_precision_activations():
    x = jax.ShapeDtypeStruct((16, 8, 8, 32), jnp.float16)

    def loss_for(module):
        variables = jax.eval_shape(module.init, jax.random.key(0), x)

        def loss_fn(params, state, batch, rng):
            out, upd = module.apply({"params": params, **state}, batch, mutable=["batch_stats"])
            return jnp.sum(jnp.tanh(out).astype(jnp.float32)), upd

        return saved_activation_bytes(
            loss_fn, variables["params"], {"batch_stats": variables["batch_stats"]}, x, None
        )["bytes"]

    half_tensor = 16 * 8 * 8 * 32 * 2
    ours = loss_for(BatchNorm(dtype=jnp.float16))
    flax_bn = loss_for(nn.BatchNorm(use_running_average=False, dtype=jnp.float16))
    assert ours <= 2 * half_tensor + 1024  # normalised output (for tanh) and x, in fp16
    assert flax_bn > ours
