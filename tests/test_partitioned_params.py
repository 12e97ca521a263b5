"""Parameters in partitioning boxes (``nn.with_logical_partitioning`` / ``nn.with_partitioning``:
``nn.LogicallyPartitioned`` / ``nn.Partitioned`` leaves, as Flax's examples and MaxText-style
models write them) under the techniques that rewrite parameters: the step trains exactly as on
the same model without boxes, the boxes stay on the state's parameters, and factorization's
factors carry the kernel's names (a rank axis unnamed)."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowmem_jax as lm


class Net(nn.Module):
    """Four dense layers; ``boxed``: their kernels named for a mesh, as a sharded model does."""

    boxed: bool = True
    logical: bool = True

    @nn.compact
    def __call__(self, x, train: bool = True):
        def init(names):
            base = nn.initializers.lecun_normal()
            if not self.boxed:
                return base
            box = nn.with_logical_partitioning if self.logical else nn.with_partitioning
            return box(base, names)

        for names in (("embed", "mlp"), ("mlp", "hidden"), ("hidden", "mlp")):
            x = nn.relu(nn.Dense(64, kernel_init=init(names))(x))
        return nn.Dense(10, kernel_init=init(("mlp", "vocab")))(x)


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32)).astype(np.float32)
    return {"image": jnp.asarray(x), "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32)}


def _train(plan: lm.Plan, model: nn.Module, steps: int = 3):
    model = plan.configure_model(model)
    batch = _batch()
    params = model.init(jax.random.key(0), batch["image"])["params"]
    tx = plan.wrap_optimizer(optax.adam(1e-2), params)
    state = lm.TrainState.create(params=params, tx=tx, plan=plan)
    step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return params, state, losses


PLANS = {
    "factorize": lm.Plan(factorize=lm.FactorConfig("tucker")),
    "dsr": lm.Plan(sparsity=lm.sparsity.SparseConfig("dsr", density=0.5, update_period=1)),
    "dsr_compressed": lm.Plan(
        sparsity=lm.sparsity.SparseConfig("dsr", density=0.5, update_period=1, compressed=True)
    ),
    "int8": lm.Plan(optimizer_state="int8"),
}


@pytest.mark.parametrize("name", PLANS)
def test_a_boxed_model_trains_as_its_unboxed_twin(name):
    plan = PLANS[name]
    params, state, losses = _train(plan, Net(boxed=True))
    _, twin_state, twin_losses = _train(plan, Net(boxed=False))
    np.testing.assert_allclose(losses, twin_losses, rtol=1e-6)
    assert int(state.skipped_steps) == 0 and losses[-1] != losses[0]
    boxes = [
        x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        if isinstance(x, nn.Partitioned)
    ]  # fmt: skip
    assert boxes, "the model's kernels are boxed"
    spec = nn.get_partition_spec(state.params)
    assert spec == nn.get_partition_spec(params), "the state keeps the model's boxes"


@pytest.mark.parametrize("logical", [True, False])
def test_factors_carry_the_kernels_names(logical):
    model = lm.Plan(factorize=lm.FactorConfig("tucker")).configure_model(Net(logical=logical))
    params = model.init(jax.random.key(0), jnp.ones((2, 32)))["params"]
    box = params["Dense_1"]["first"]["kernel"]
    assert isinstance(box, nn.LogicallyPartitioned if logical else nn.Partitioned)
    assert box.names == ("mlp", None)
    assert params["Dense_1"]["last"]["kernel"].names == (None, "hidden")
    assert params["Dense_0"]["kernel"].names == ("embed", "mlp")  # the first layer stays dense


def test_other_kernel_metadata_is_refused_in_one_line():
    class Tagged(flax.struct.PyTreeNode, nn.meta.AxisMetadata):
        value: jax.Array

        def unbox(self):
            return self.value

        def replace_boxed(self, val):
            return self.replace(value=val)

        def add_axis(self, index, params):
            return self

        def remove_axis(self, index, params):
            return self

    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            def init(*a):
                return Tagged(nn.initializers.lecun_normal()(*a))

            for _ in range(3):
                x = nn.Dense(8, kernel_init=init)(x)
            return x

    model = lm.Plan(factorize=lm.FactorConfig("tucker")).configure_model(Odd())
    with pytest.raises(ValueError, match="Tagged metadata.*nn.Partitioned"):
        model.init(jax.random.key(0), jnp.ones((2, 8)))


def test_nnx_factors_carry_the_kernels_sharding_names():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            def init(names):
                return nnx.with_metadata(
                    nnx.initializers.lecun_normal(), out_sharding=names, eager_sharding=False
                )

            self.layers = nnx.List([
                nnx.Linear(32, 64, kernel_init=init(("embed", "mlp")), rngs=rngs),
                nnx.Linear(64, 64, kernel_init=init(("mlp", "hidden")), rngs=rngs),
                nnx.Linear(64, 10, kernel_init=init(("hidden", "vocab")), rngs=rngs),
            ])  # fmt: skip

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = lm.Plan(factorize=lm.FactorConfig("tucker")).configure_model(Mlp(nnx.Rngs(0)))
    middle = model.layers[1]
    assert middle.first.kernel.get_metadata()["out_sharding"] == ("mlp", None)
    assert middle.last.kernel.get_metadata()["out_sharding"] == (None, "hidden")
    assert model(jnp.ones((2, 32))).shape == (2, 10)
