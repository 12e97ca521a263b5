import jax
import jax.numpy as jnp
import pytest

import lowmem_jax as lm


def _count(tree):
    return sum(x.size for x in jax.tree.leaves(tree))


def test_wrn_28_2_has_exactly_1_467_610_parameters():
    model = lm.models.WideResNet(depth=28, width=2, num_classes=10)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )
    assert _count(shapes["params"]) == 1_467_610


def test_parameter_breakdown_matches_the_brief():
    model = lm.models.WideResNet(depth=28, width=2)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )["params"]
    by_kind = {"conv3x3": 0, "conv1x1": 0, "bn": 0, "dense": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(p, "key", "") for p in path]
        if keys[0] == "classifier":
            by_kind["dense"] += leaf.size
        elif keys[-1] == "kernel":
            by_kind["conv1x1" if leaf.shape[-3] == 1 else "conv3x3"] += leaf.size
        else:
            by_kind["bn"] += leaf.size
    assert by_kind == {"conv3x3": 1_451_952, "conv1x1": 10_752, "bn": 3_616, "dense": 1_290}


@pytest.mark.parametrize("depth, width", [(10, 1), (16, 2)])
def test_depth_and_width_are_configurable(depth, width):
    model = lm.models.WideResNet(depth=depth, width=width, num_classes=7)
    x = jnp.ones((2, 16, 16, 1))
    variables = model.init(jax.random.key(0), x, train=False)
    logits = model.apply(variables, x, train=False)
    assert logits.shape == (2, 7)
    # 3 groups of n blocks: the conv1 kernels are stacked [blocks, 3, 3, in, out]
    n = (depth - 4) // 6
    blocks = sum(
        leaf.shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
        if "conv1" in jax.tree_util.keystr(path)
    )
    assert blocks == 3 * n


def test_compute_dtype_follows_the_policy():
    model = lm.Plan(precision="mixed_bf16").configure_model(lm.models.WideResNet(depth=10, width=1))
    x = jnp.ones((2, 8, 8, 3))
    variables = model.init(jax.random.key(0), x, train=False)
    assert jax.tree.leaves(variables["params"])[0].dtype == jnp.float32
    assert model.apply(variables, x.astype(jnp.bfloat16), train=False).dtype == jnp.bfloat16


@pytest.mark.parametrize("depth", [8, 27, 4])
def test_bad_depth_raises(depth):
    with pytest.raises(ValueError, match="depth"):
        lm.models.WideResNet(depth=depth)
