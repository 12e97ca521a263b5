"""Plan as a value: made of the techniques' fields, keyword-only, frozen, validated, described."""

import __future__

import dataclasses
import json
import pathlib
import pickle

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.techniques.sparsity import report_sparsity


def test_a_plan_is_a_frozen_keyword_only_hashable_value():
    plan = lm.Plan(precision="mixed_fp16", microbatches=4)
    assert plan == lm.Plan(microbatches=4, precision="mixed_fp16")
    assert hash(plan) == hash(lm.Plan(microbatches=4, precision="mixed_fp16"))
    assert pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.precision = "fp16"
    with pytest.raises(TypeError):
        lm.Plan("fp16")  # positional: the field order is the registry's, not an API


def test_replace_validates_like_construction():
    with pytest.raises(ValueError, match="microbatches"):
        dataclasses.replace(lm.Plan(), microbatches=0)


@given(k=st.integers(max_value=0))
def test_microbatches_below_one_are_refused(k):
    with pytest.raises(ValueError, match="microbatches"):
        lm.Plan(microbatches=k)


@pytest.mark.parametrize(
    "field,value",
    [("remat_blocks", ("",)), ("remat_blocks", ["Block"]), ("sparsity", 0.9), ("factorize", "cp"),
     ("devices", -1), ("devices", True)],
)  # fmt: skip
def test_fields_without_choices_are_validated_too(field, value):
    with pytest.raises(ValueError, match=field):
        lm.Plan(**{field: value})


def test_to_dict_lists_flags_then_settings_then_configs():
    plan = lm.Plan(precision="fp16", remat_blocks=("Block",), sparsity=report_sparsity(0.5))
    d = plan.to_dict()
    keys = list(d)
    flags = [f.name for f in lm.Plan.flag_fields() if not f.metadata["omit_default"]]
    assert keys[: len(flags)] == flags
    assert keys[len(flags) :] == [
        "initial_loss_scale", "loss_scale_period", "loss_scale_factor", "min_loss_scale",
        "remat_blocks", "sparsity",
    ]  # fmt: skip
    assert d["loss_scale"] == "dynamic" and d["sparsity"] == plan.sparsity.describe()
    default = lm.Plan().to_dict()
    assert "remat_blocks" not in default and "input_dtype" not in default  # omitted at default
    assert "sparsity" not in default and "factorize" not in default
    assert lm.Plan(input_dtype="uint8").to_dict()["input_dtype"] == "uint8"


def test_the_docstring_documents_every_field():
    for t in TECHNIQUES:
        for f in t.fields:
            assert f"  {f.name}: {f.doc}" in lm.Plan.__doc__


def test_model_loss_casts_to_the_compute_dtype_and_back():
    def loss_fn(params, model_state, batch, rng):
        assert params["w"].dtype == jnp.float16 and batch["x"].dtype == jnp.float16
        return (params["w"] * batch["x"]).sum(), (model_state, {"m": params["w"].sum()})

    loss, (_, metrics) = lm.Plan(precision="mixed_fp16").model_loss(loss_fn)(
        {"w": jnp.ones(3)}, {}, {"x": jnp.ones(3)}, None
    )
    assert loss.dtype == jnp.float32 and metrics["m"].dtype == jnp.float32 and loss == 3


@pytest.mark.parametrize(
    "field,value,why",
    [("loss_scale_period", 0, "loss_scale_period must be an integer >= 1"),
     ("loss_scale_period", 2.5, "loss_scale_period must be an integer >= 1"),
     ("loss_scale_factor", 0.5, "loss_scale_factor must be > 1"),
     ("initial_loss_scale", 0.0, "initial_loss_scale must be > 0"),
     ("min_loss_scale", 2.0**16, r"min_loss_scale must be in \(0, initial_loss_scale=32768.0\]")],
)  # fmt: skip
def test_loss_scale_settings_are_refused_on_construction_at_any_precision(field, value, why):
    """Plan(loss_scale_period=0) was accepted and refused only later, under float16."""
    for precision in ("fp32", "fp16"):
        with pytest.raises(ValueError, match=why):
            lm.Plan(precision=precision, **{field: value})


def test_on_one_device_turns_off_what_needs_several_devices_and_nothing_else():
    """The comparison `lowmem analyze` makes for a sharded plan: the same plan on one device."""
    plan = lm.Plan(shard="zero1", devices=2, grad_compression="int8", remat="full")
    assert plan.on_one_device() == lm.Plan(remat="full")
    one = lm.Plan(remat="full", optimizer_memory="pinned_host")
    assert one.on_one_device() is one
    assert lm.Plan().mesh() is None and lm.Plan().state_shardings({"x": jnp.zeros(2)}) is None


def test_the_committed_plan_stub_is_what_the_techniques_declare():
    """``plan.pyi`` shows readers, ``grep`` and type checkers the fields ``make_dataclass``
    builds; it is regenerated from the registry here (a field added to a technique without
    ``lowmem_jax.compose.plan.write_stub()`` fails)."""
    from lowmem_jax.compose import plan as plan_module

    text = pathlib.Path(plan_module.__file__).with_suffix(".pyi").read_text()
    assert text == plan_module.stub(), "run lowmem_jax.compose.plan.write_stub()"
    for field in dataclasses.fields(lm.Plan):
        assert f"\n    {field.name}: " in text, field.name
    assert "\n    def configure_model(self, model: ModuleT) -> ModuleT: ...\n" in text
    namespace: dict = {}
    lazy = __future__.annotations.compiler_flag  # a stub's annotations may name Plan itself
    exec(compile(text, "plan.pyi", "exec", flags=lazy), namespace)  # the stub is valid Python
    assert [n for n in vars(namespace["Plan"]) if not n.startswith("_")] == [
        n for n in vars(plan_module._PlanMethods) if not n.startswith("_")
    ]


@given(st.sampled_from(["none", "full", "dots", "sqrt", "every:3", "save:conv_out",
                        "blocks:full*2,none"]))  # fmt: skip
def test_a_remat_policy_is_parsed_once_into_a_value_that_reads_as_its_text(text):
    """``Plan(remat=...)`` holds a parsed :class:`RematSpec` (what every use reads, no parse
    again), equal to, hashed as and written like its text (JSON, flags, ``repr``); a copy,
    a replace and a pickle keep it parsed."""
    from lowmem_jax.blocks.policy import RematSpec, parse_policy

    plan = lm.Plan(remat=text)
    assert isinstance(plan.remat, RematSpec) and plan.remat == text and str(plan.remat) == text
    assert hash(plan) == hash(lm.Plan(remat=RematSpec(text)))
    assert plan.remat.enabled == (text != "none")
    assert parse_policy(plan.remat) is plan.remat
    assert json.loads(json.dumps(plan.to_dict()))["remat"] == text
    assert f"remat={text!r}" in repr(plan)
    for copy in (dataclasses.replace(plan, microbatches=2), pickle.loads(pickle.dumps(plan))):
        assert isinstance(copy.remat, RematSpec) and copy.remat == text
        assert copy.remat.segment == plan.remat.segment
    with pytest.raises(ValueError, match="Unknown remat='every:0'; allowed values"):
        lm.Plan(remat="every:0")


def test_the_technique_flags_of_a_plan_give_the_plan_back():
    from lowmem_jax.compose.flags import plan_argv, plan_from_argv

    plan = lm.Plan(precision="mixed_bf16", microbatches=4, remat="sqrt", optimizer_state="int8",
                   sparsity=lm.techniques.sparsity.SparseConfig(density=1 - 0.7),
                   factorize=lm.FactorConfig())  # fmt: skip
    argv = plan_argv(plan)
    assert plan_from_argv(["--model", "llama-1b", *argv]) == plan
