"""The planner and the analysis on a user's model (issue 37 item 7): ``lm.custom_workload`` of a
Linen or NNX model nobody registered, searched like the bundled ones."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import lowmem_jax as lm

BATCH = {"image": jnp.zeros((32, 16, 16, 3)), "label": jnp.zeros((32,), jnp.int32)}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.BatchNorm(use_running_average=not train)(nn.Conv(32, (3, 3))(x))
        return x + nn.relu(nn.Conv(32, (3, 3))(nn.relu(y)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(32, (3, 3))(x)
        for _ in range(2):
            x = Block()(x, train=train)
        return nn.Dense(10)(x.mean((1, 2)))


def _init(model, rng, batch):
    return model.init(rng, batch["image"][:2], train=False)


def _linen_work():
    return lm.custom_workload(
        "linen-net", Net(), BATCH, loss=lm.classifier_loss_fn, init=_init,
        optimizer=optax.adam(1e-3),
    )  # fmt: skip


def test_the_planner_finds_a_plan_that_fits_a_user_s_linen_model():
    work = _linen_work()
    plain = lm.workloads.build_plain(work).analyze().xla["total_bytes"]
    budget = int(0.6 * plain)
    log: list[str] = []
    found = lm.plan_for_budget(work, budget, envelope="any", log=log.append)
    assert found.xla["total_bytes"] <= budget < plain
    assert found.plan != lm.Plan()
    assert any("remat='sqrt' left out" in line for line in log), log  # needs scanned stacks
    setup = lm.build(work, found.plan)
    assert all(v.took_effect for v in setup.verdicts()), setup.verdicts()


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(32, 32, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.norm(self.conv(x)))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Conv(3, 32, (3, 3), rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


def _nnx_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def test_the_planner_and_the_analysis_take_a_user_s_nnx_model():
    work = lm.custom_workload(
        "nnx-net", NNXNet(nnx.Rngs(0)), BATCH, loss=_nnx_loss, optimizer=optax.sgd(0.1, 0.9)
    )
    plain = lm.workloads.build_plain(work).analyze().xla["total_bytes"]
    remat = lm.build(work, lm.Plan(remat="full")).analyze().xla["total_bytes"]
    assert remat < 0.8 * plain  # the blocks were found
    found = lm.plan_for_budget(work, int(0.6 * plain), envelope="report")
    assert found.xla["total_bytes"] <= 0.6 * plain
    setup = lm.build(work, found.plan)
    state = setup.init_state(BATCH)
    new, metrics = setup.step(state, BATCH)  # the plan trains: a step is applied
    assert int(new.skipped_steps) == 0 and bool(metrics["grads_finite"])


def test_a_setting_the_model_refuses_is_left_out_of_the_search():
    class Tied(nn.Module):  # no Dense / Conv layer: factorize refuses it
        @nn.compact
        def __call__(self, tokens, train: bool = True):
            embed = nn.Embed(64, 16)
            return embed.attend(nn.relu(embed(tokens)))

    def loss(model):
        def loss_fn(params, model_state, batch, rng):
            logits = model.apply({"params": params}, batch["tokens"])
            value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).mean()
            return value, (model_state, {"loss": value})

        return loss_fn

    batch = {"tokens": jnp.zeros((8, 12), jnp.int32)}
    work = lm.custom_workload(
        "tied", Tied(), batch, loss=loss, optimizer=optax.adam(1e-3),
        init=lambda model, rng, b: model.init(rng, b["tokens"]),
    )  # fmt: skip
    log: list[str] = []
    found = lm.plan_for_budget(work, 10 * 2**30, envelope="any", log=log.append)
    assert found.plan == lm.Plan()  # everything fits: the mildest plan
    assert any(line.strip().startswith("factorize=") and "left out" in line for line in log), log


def test_custom_workload_checks_its_arguments():
    with pytest.raises(ValueError, match="init is required for the Linen model Net"):
        lm.custom_workload("x", Net(), BATCH, loss=lm.classifier_loss_fn, optimizer=optax.sgd(1))
    with pytest.raises(ValueError, match="init is for Linen models"):
        lm.custom_workload("x", NNXNet(nnx.Rngs(0)), BATCH, loss=_nnx_loss,
                           optimizer=optax.sgd(1), init=_init)  # fmt: skip
    with pytest.raises(ValueError, match="batch must be a non-empty dict"):
        lm.custom_workload("x", Net(), [], loss=lm.classifier_loss_fn, optimizer=optax.sgd(1),
                           init=_init)  # fmt: skip


def test_the_cli_takes_a_user_s_model_as_module_and_function(capsys):
    import json

    from lowmem_jax.cli import dispatch as cli

    argv = ["--model", "test_custom_workload:_linen_work", "--batch-size", "16"]
    assert cli.main(["analyze", *argv, "--remat", "full", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batch_size"] == 16 and result["verdicts"][0]["took_effect"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["analyze", "--model", "test_custom_workload:no_such_function"])
    assert exit_.value.code == 2
    assert "cannot call no_such_function()" in capsys.readouterr().err
