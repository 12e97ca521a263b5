"""Factorization of models nobody here wrote (``factorize_module``): which layers, the same
function through the interception as through the factorized layer itself, NNX decomposition in
place, and a one-line refusal when no layer can be factorized."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.techniques import factorize as fz
from lowmem_jax.techniques.factorize.any_model import _chosen, _Layer


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(16)(nn.relu(nn.Dense(64)(x))), None


class _LinenNet(nn.Module):
    """A stem, a strided conv, a dilated conv (stays dense), a scanned stack, a dropout, a head."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2, use_bias=False)(x))
        x = nn.Conv(16, (3, 3), kernel_dilation=2)(x).mean((1, 2))
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack()(x, None)
        return nn.Dense(10)(nn.Dropout(0.1, deterministic=not train)(x))


def _init(model, x):
    return model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)


def test_linen_layers_are_replaced_in_place_and_the_ends_stay_dense():
    x = jnp.ones((2, 8, 8, 3))
    model = lm.Plan(factorize=fz.FactorConfig("tucker")).configure_model(_LinenNet())
    params = _init(model, x)["params"]
    shapes = jax.tree.map(jnp.shape, params)
    assert set(shapes["Conv_0"]) == {"kernel", "bias"}  # the stem
    assert set(shapes["Dense_0"]) == {"kernel", "bias"}  # the head
    assert set(shapes["Conv_2"]) == {"kernel", "bias"}  # dilated: not reproduced, kept
    assert set(shapes["Conv_1"]) == {"first", "core", "last"}
    for name in ("Dense_0", "Dense_1"):  # a stack: many layers, not an end; a layer axis first
        assert set(shapes["ScanBlock_0"][name]) == {"first", "last", "bias"}
        assert shapes["ScanBlock_0"][name]["first"]["kernel"][0] == 3
    dense = _init(_LinenNet(), x)["params"]
    assert sum(p.size for p in jax.tree.leaves(params)) < sum(
        p.size for p in jax.tree.leaves(dense)
    )
    only = fz.FactorConfig("lowrank", layers=("ScanBlock_0/Dense_1",))
    picked = jax.tree.map(jnp.shape, _init(fz.factorize_module(_LinenNet(), only), x)["params"])
    assert set(picked["ScanBlock_0"]["Dense_1"]) == {"first", "last", "bias"}
    assert set(picked["ScanBlock_0"]["Dense_0"]) == {"kernel", "bias"}
    assert set(picked["Conv_1"]) == {"kernel"}


def test_an_intercepted_layer_computes_the_conv_of_its_reconstructed_kernel():
    """The factorized model equals the dense model whose kernel is the factors' product: the
    interception routes the call through the factors, nothing else changes."""
    x = jax.random.normal(jax.random.key(3), (2, 8, 8, 3))
    config = fz.FactorConfig("cp", layers=("Conv_1",))
    model = fz.factorize_module(_LinenNet(), config)
    params = _init(model, x)["params"]
    conv = params["Conv_1"]
    kernel = fz.reconstruct_kernel("cp", {n: conv[n]["kernel"] for n in fz.FACTOR_NAMES["cp"]})
    dense = dict(params, Conv_1={"kernel": kernel})

    def loss(m):  # jitted: one program per model, not one per operation
        return jax.jit(lambda p: (m.apply({"params": p}, x, train=False) ** 2).sum())

    factorized, unfactorized = loss(model), loss(_LinenNet())
    np.testing.assert_allclose(factorized(params), unfactorized(dense), rtol=1e-4)
    grad = jax.jit(jax.grad(factorized))(params)["Dense_0"]["kernel"]
    reference = jax.jit(jax.grad(unfactorized))(dense)["Dense_0"]["kernel"]
    np.testing.assert_allclose(grad, reference, rtol=1e-3, atol=1e-5)


class _OwnDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return x @ self.param(
            "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features)
        )


class _Tied(nn.Module):
    """GPT-2's pattern: its own dense class, and a head that applies a Dense to the embedding."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 8)
        h = _OwnDense(8)(embed(tokens))
        return nn.Dense(32, use_bias=False).apply({"params": {"kernel": embed.embedding.T}}, h)


def test_a_model_with_nothing_to_factorize_is_refused_naming_why():
    model = lm.Plan(factorize=fz.FactorConfig()).configure_model(_Tied())
    with pytest.raises(ValueError) as err:
        model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    message = str(err.value)
    assert "no layer of _Tied to factorize" in message and "\n" not in message
    assert "Dense.apply: applied to parameters the model passes it (a tied weight)" in message
    assert "other classes are not replaced: _OwnDense" in message


class _NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.convs = nnx.List([
            nnx.Conv(3, 16, (3, 3), rngs=rngs),
            nnx.Conv(16, 16, (3, 3), strides=2, padding="VALID", rngs=rngs),
        ])  # fmt: skip
        self.grouped = nnx.Conv(16, 16, (3, 3), feature_group_count=2, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return _NNXBlock(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        for conv in self.convs:
            x = nnx.relu(conv(x))
        x = self.grouped(x).mean((1, 2))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def test_nnx_layers_are_decomposed_in_place_in_a_copy():
    net = _NNXNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 9, 3))
    # Full ranks (by path): the decomposition is exact, so the copy computes what the model does.
    full = (("convs/1", (3, 3, 16, 16), (16, 16)), ("blocks/up", (16, 32), (16,)),
            ("blocks/down", (32, 16), (16,)))  # fmt: skip
    exact = fz.factorize_module(net, fz.FactorConfig("tucker", ranks=full))
    np.testing.assert_allclose(exact(x), net(x), rtol=1e-4, atol=1e-4)
    assert isinstance(net.convs[1], nnx.Conv)  # the user's model is left as it was
    assert isinstance(exact.convs[0], nnx.Conv) and isinstance(exact.head, nnx.Linear)  # ends
    assert isinstance(exact.grouped, nnx.Conv)  # groups: not reproduced, kept
    assert isinstance(exact.convs[1], fz.NNXFactorized)
    assert exact.blocks.up.first.kernel[...].shape[0] == 2  # a stack keeps its layer axis
    small = lm.Plan(factorize=fz.FactorConfig("cp", 0.25)).configure_model(net)
    sparse = lm.sparsity.SparseConfig(density=0.5)  # the factors are `kernel`s: sparse training
    split = lm.split_nnx(small, lambda m, b: (m(b) ** 2).sum())  # reaches them
    tx = lm.Plan(sparsity=sparse).wrap_optimizer(optax.adam(1e-3), split.params)
    assert "blocks/up/first/kernel" in tx.layout.keys
    sizes = [sum(p.size for p in jax.tree.leaves(nnx.state(m, nnx.Param))) for m in (net, small)]
    assert sizes[1] < 0.6 * sizes[0], sizes
    grads = nnx.grad(lambda m: (m(x) ** 2).sum())(small)
    assert np.isfinite(grads["blocks"]["up"]["first"]["kernel"][...]).all()


def test_nnx_refusal_is_raised_when_the_plan_is_applied():
    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 3, rngs=rngs)
            self.b = nnx.Linear(3, 2, rngs=rngs)

    with pytest.raises(ValueError, match="no layer of Two to factorize: a: first or last layer"):
        lm.Plan(factorize=fz.FactorConfig()).configure_model(Two(nnx.Rngs(0)))


_layers = st.lists(
    st.builds(
        _Layer,
        path=st.sampled_from(["a", "b/c", "d", "e/f/g", "h"]),
        kind=st.just("Dense"),
        stacked=st.booleans(),
        unsupported=st.sampled_from([None, None, "groups"]),
    ),
    max_size=6,
    unique_by=lambda layer: layer.path,
)


@given(_layers, st.booleans(), st.sampled_from([(), ("b|d",), ("^e",)]))
def test_chosen_layers_obey_every_rule_or_the_model_is_refused(layers, keep, patterns):
    config = fz.FactorConfig(keep_first_last=keep, layers=patterns)
    try:
        chosen = _chosen(layers, config, "M")
    except ValueError as err:
        assert "no layer of M to factorize" in str(err)
        chosen = []
    by_path = {layer.path: layer for layer in layers}
    for path in chosen:
        assert by_path[path].unsupported is None
        assert not patterns or any(__import__("re").search(p, path) for p in patterns)
        ends = (layers[0].path, layers[-1].path)
        assert not (keep and path in ends and not by_path[path].stacked)
    if not keep and not patterns:
        assert chosen == [layer.path for layer in layers if layer.unsupported is None]
