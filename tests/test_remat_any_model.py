"""Remat for a Linen model this library did not write (no `remat` attribute): per named block
class, or the whole forward; the same parameters, gradients, BatchNorm statistics and dropout."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILE

import lowmem_jax as lm


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.Conv(self.width, (3, 3))(x)
        y = nn.BatchNorm(use_running_average=not train)(y)
        y = nn.Dropout(0.25, deterministic=not train)(nn.relu(y))
        return x + y


class UserCNN(nn.Module):
    width: int = 8
    depth: int = 3

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3))(x)
        for _ in range(self.depth):
            x = Block(self.width)(x, train=train)
        return nn.Dense(10)(x.mean((1, 2)))


def _loss_fn(model):
    def loss_fn(params, model_state, batch, rng):
        logits, new_state = model.apply(
            {"params": params, **model_state}, batch["image"], train=True,
            mutable=["batch_stats"], rngs={"dropout": rng},
        )  # fmt: skip
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (new_state, {"loss": loss})

    return loss_fn


def _checkpoint_regions(fn, *args) -> int:
    return sum(
        e.primitive.name.startswith(("checkpoint", "remat"))
        for e in lm.remat.traced_equations(fn, *args)
    )


BATCH = {
    "image": jax.random.normal(jax.random.key(1), (4, 8, 8, 3)),
    "label": jnp.arange(4) % 10,
}


@pytest.mark.parametrize(
    "remat, blocks, regions",
    [("full", ("Block",), 3), ("dots", ("Block",), 3), ("full", (), 1)],
)
def test_remat_of_a_user_model_keeps_parameters_gradients_and_batchnorm(remat, blocks, regions):
    plain = UserCNN()
    configured = lm.Plan(remat=remat, remat_blocks=blocks).configure_model(plain)
    assert isinstance(configured, UserCNN)
    variables = plain.init(jax.random.key(0), BATCH["image"], train=False)
    again = configured.init(jax.random.key(0), BATCH["image"], train=False)
    assert jax.tree.structure(again) == jax.tree.structure(variables)
    jax.tree.map(np.testing.assert_array_equal, again, variables)

    params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
    rng = jax.random.key(2)

    def grads(model, params=params):
        grad_fn = jax.grad(_loss_fn(model), has_aux=True)
        return grad_fn(params, state, BATCH, rng)

    (g_plain, (s_plain, _)), (g_remat, (s_remat, _)) = grads(plain), grads(configured)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_remat, g_plain)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), s_remat, s_plain)
    assert _checkpoint_regions(lambda p: grads(configured, p), params) == regions
    assert _checkpoint_regions(lambda p: grads(plain, p), params) == 0


def test_per_block_remat_of_a_user_model_lowers_compiled_temp_bytes():
    """Through the whole composed step (mixed precision, microbatches) and the analysis."""
    model, batch = UserCNN(width=32, depth=6), {
        "image": jnp.zeros((32, 32, 32, 3)), "label": jnp.zeros((32,), jnp.int32),
    }  # fmt: skip
    temps = {}
    for remat in ("none", "full"):
        plan = lm.Plan(precision="mixed_bf16", microbatches=2, remat=remat, remat_blocks=("Block",))
        configured = plan.configure_model(model)
        variables = configured.init(jax.random.key(0), batch["image"][:2], train=False)
        tx = optax.sgd(0.1)
        state = lm.TrainState.create(
            params=variables["params"], tx=tx, plan=plan,
            model_state={"batch_stats": variables["batch_stats"]},
        )  # fmt: skip
        step = lm.make_train_step(_loss_fn(configured), tx, plan, jit=False)
        options = {**plan.compiler_options(), **FAST_COMPILE}
        compiled = jax.jit(step, compiler_options=options).lower(state, batch).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["full"] < 0.7 * temps["none"], temps


def test_bad_remat_blocks_are_refused():
    with pytest.raises(ValueError, match="remat_blocks must be a tuple"):
        lm.Plan(remat_blocks="Block")
    with pytest.raises(ValueError, match="applies remat='full' itself"):
        lm.Plan(remat="full", remat_blocks=("Block",)).configure_model(lm.models.WideResNet())


def test_a_block_name_the_model_never_calls_is_an_error_listing_its_classes():
    model = lm.Plan(remat="full", remat_blocks=("Blok",)).configure_model(UserCNN())
    with pytest.raises(ValueError, match=r"\['Blok'\].*\['BatchNorm', 'Block', 'Conv', 'Dense'"):
        model.init(jax.random.key(0), BATCH["image"], train=False)
