"""The technique registry: every registered technique reaches Plan, the CLI, the planner's axes,
the envelopes and the report grid, and a forgotten wire fails here."""

import argparse
import ast
import dataclasses
import functools
import itertools
import pathlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.analysis import memory
from lowmem_jax.compose.flags import add_plan_flags, plan_from_args
from lowmem_jax.core.report_hooks import GridContext, ReportRow
from lowmem_jax.planning import planner
from lowmem_jax.planning.envelope import ENVELOPES
from lowmem_jax.planning.search import plan_name, plan_of
from lowmem_jax.planning.space import axes_in
from lowmem_jax.report import grid as report_grid
from lowmem_jax.report.grid import model_grid, standard_grid
from lowmem_jax.techniques import TECHNIQUES, technique
from lowmem_jax.workloads.flags import add_workload_flags, analyze_argv

PLAN_FIELDS = [f.name for f in dataclasses.fields(lm.Plan)]
AXES = [t for t in TECHNIQUES if t.axis is not None]
BATCH = 128


def _parser(base=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    add_plan_flags(parser, base or lm.Plan())
    return parser


def test_every_plan_field_is_owned_by_exactly_one_technique():
    owned = [f.name for t in TECHNIQUES for f in t.fields]
    assert owned == PLAN_FIELDS  # Plan is made of them, in the registry's order
    assert len({t.name for t in TECHNIQUES}) == len(TECHNIQUES)
    assert all(t.name == t.fields[0].name for t in TECHNIQUES)  # named by its first field


def test_every_technique_reaches_the_command_line():
    options = {o for action in _parser()._actions for o in action.option_strings}
    flag_fields = {f.name for f in lm.Plan.flag_fields()}
    for t in TECHNIQUES:
        assert "--" + t.name.replace("_", "-") in options, t.name
        assert t.flags is not None or t.name in flag_fields, t.name


@pytest.mark.parametrize("t", AXES, ids=lambda t: t.name)
def test_every_axis_value_gives_a_plan_its_flags_give_back(t):
    """Plan -> analyze_argv -> parsed flags -> the same plan, for every candidate of every axis
    (analyze_argv itself raises where no flag expresses a setting); a non-default value shows
    in the plan's name."""
    for value in t.axis.space(BATCH):
        if value in t.axis.families:
            continue
        plan = plan_of({t.axis.key: value})
        argv = analyze_argv("wrn-28-2", BATCH, plan)
        assert plan_from_args(_parser().parse_args(argv), lm.Plan()) == plan
        assert (plan == lm.Plan()) == (t.label(plan) in (None, t.label(lm.Plan()))), value
        if t.label(plan) is not None:
            assert t.label(plan) in plan_name(plan)


def test_a_plan_s_microbatch_count_reads_as_its_flag():
    """``microbatches 4`` in a plan's name is ``--microbatches 4``, a count; a report row's
    ``mb k`` (k examples per microbatch) is another thing and never appears in a plan's name."""
    plan = lm.Plan(microbatches=4, remat="full")
    assert plan_name(plan) == "fp32 + microbatches 4 + remat full"
    assert "--microbatches 4" in " ".join(analyze_argv("wrn-28-2", BATCH, plan))


@pytest.mark.parametrize("envelope", sorted(ENVELOPES))
@pytest.mark.parametrize("t", [t for t in TECHNIQUES if t.envelope is not None],
                         ids=lambda t: t.name)  # fmt: skip
def test_the_planner_axis_and_the_envelope_agree(t, envelope):
    """A value the planner's axis admits into an envelope is one the envelope calls inside, and
    a value it leaves out gets a reason: the search and the report's envelope column cannot
    disagree."""
    env = ENVELOPES[envelope]
    assert env.describe()[t.envelope.key] == env.limit(t.name)
    if t.axis is None:
        return
    for value in t.axis.space(BATCH):
        if value in t.axis.families:
            continue
        config = {"batch_size": BATCH, **plan_of({t.axis.key: value}).to_dict()}
        within = t.axis.within(value, env.limit(t.name), BATCH)
        assert (env.why_outside(config) is None) == within, (value, env.why_outside(config))


def test_every_rule_has_a_limit_in_every_envelope():
    for t in TECHNIQUES:
        if t.envelope is not None:
            assert set(t.envelope.limits) == set(ENVELOPES), t.name


def test_every_searched_technique_has_rows_in_a_report_grid():
    """In the WideResNet's or the transformer's (a technique may apply to some optimizers
    only: the WideResNet trains with SGD, the transformer with Adam). The axes searched over
    several devices are not the grid's (one device's): ZeRO's stages have the report's
    per-device section, a pipeline's benchmarks/pipeline_stages.py."""
    plans = [plan for model in ("wrn-28-2", "dynamicconv-iwslt")
             for _, _, plan in model_grid(model, BATCH) if plan is not None]  # fmt: skip
    for t in AXES:
        if t.axis.over_devices is not None:
            continue
        assert any(t.label(p) not in (None, t.label(lm.Plan())) for p in plans), t.name


@pytest.mark.parametrize("images", [True, False])
def test_every_technique_s_report_rows_reach_the_grid_in_row_order(images):
    """The grid is the registry's rows (and the combined ones), in ``ROW_ORDER`` (a technique's
    rows under its name); each technique that declares rows has one of them in the quick grid,
    with the plan its fields make."""
    context = GridContext(BATCH, "conv_out", images)
    full = standard_grid(BATCH, images=images)
    quick = {name: plan for name, _, plan in standard_grid(BATCH, images=images, quick=True)}
    by_name = {name: (group, plan) for name, group, plan in full}
    for t in TECHNIQUES:
        rows = t.report.rows(context) if t.report.rows else ()
        for row in rows:
            assert by_name[row.name] == (row.group, lm.Plan(**row.fields)), row.name
        assert sum(row.quick for row in rows) == (1 if rows else 0), t.name
        assert all(row.name in quick for row in rows if row.quick)
    positions = {row.name: report_grid.ROW_ORDER.index(row.section or t.name)
                 for t in TECHNIQUES if t.report.rows
                 for row in t.report.rows(context)}  # fmt: skip
    ordered = [positions[name] for name, _, _ in full if name in positions]
    assert ordered == sorted(ordered)


def test_a_technique_s_rows_land_in_the_report_without_editing_the_grid(monkeypatch):
    """A new technique's rows reach ``lowmem report`` from its own module: here a copy of the
    precision technique that declares one more row, put in the registry."""
    old = technique("precision")
    row = ReportRow("bf16 again", "precision", {"precision": "bf16"}, quick=True)
    rows = lambda context: (*old.report.rows(context), row)  # noqa: E731
    new = dataclasses.replace(old, report=dataclasses.replace(old.report, rows=rows))
    registry = tuple(new if t is old else t for t in TECHNIQUES)
    monkeypatch.setattr(report_grid, "TECHNIQUES", registry)
    names = [name for name, _, _ in model_grid("wrn-28-2", BATCH, "quick")]
    assert names.index("bf16 again") == names.index("mixed_fp16") + 1


def test_a_technique_s_report_section_lands_in_the_report_without_editing_it(monkeypatch, tmp_path):
    """A section of its own (flag, rows, markdown, plot) reaches ``lowmem report`` from the
    technique's declaration: here a copy of the precision technique with a section that
    compiles the baseline at the precisions its flag names."""
    import lowmem_jax.techniques as registry_module
    from lowmem_jax.cli import dispatch as cli
    from lowmem_jax.core.report_hooks import ReportSection
    from lowmem_jax.report.run import run_report, write_report

    def rows(analyze, precisions, progress):
        return [{"precision": p, "total": analyze({"precision": p})["total_bytes"]}
                for p in precisions]  # fmt: skip

    def plot(rows, title, path):
        pathlib.Path(path).write_text(title)

    section = ReportSection(
        key="sweep",
        add_flag=lambda parser: parser.add_argument("--sweep", type=lambda t: tuple(t.split(","))),
        setting=lambda args, batch_size: args.sweep,
        argv=lambda precisions: ["--sweep", ",".join(precisions)],
        check=lambda batch_size, precisions: None,
        rows=rows,
        markdown=lambda rows: [f"sweep {r['precision']}: {r['total']}" for r in rows],
        plot=plot,
    )
    old = technique("precision")
    new = dataclasses.replace(old, report=dataclasses.replace(old.report, section=section))
    monkeypatch.setattr(
        registry_module, "TECHNIQUES", tuple(new if t is old else t for t in TECHNIQUES)
    )
    args = cli.build_parser().parse_args(["report", "--sweep", "bf16"])
    assert section.setting(args, 8) == ("bf16",)
    grid = [("baseline", "baseline", lm.Plan())]
    result = run_report("wrn-10-1", 8, grid=grid, progress=None, sections={"sweep": ("fp32",)})
    assert result["sweep"] == [
        {"precision": "fp32", "total": result["configs"][0]["xla"]["total_bytes"]}
    ]
    written = write_report(result, str(tmp_path))
    assert str(tmp_path / "sweep.png") in written
    assert f"sweep fp32: {result['sweep'][0]['total']}" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="Unknown report section 'sweeps'; allowed values"):
        run_report("wrn-10-1", 8, grid=grid, progress=None, sections={"sweeps": ("fp32",)})


def test_the_planner_searches_every_registered_axis():
    for envelope in ENVELOPES.values():
        axes = axes_in(envelope, BATCH, planner.SPACE)
        assert list(axes) == [t.axis.key for t in AXES]
        assert all(axes[t.axis.key] for t in AXES)  # the mildest value is always inside


def test_microbatch_counts_follow_the_batch_and_the_envelope():
    axes = axes_in(ENVELOPES["report"], 100, {**planner.SPACE, "microbatches": (1, 4, 20)})
    assert axes["microbatches"] == (1, 4)  # 100 / 20 = 5 examples: under the report's 8
    assert axes_in(ENVELOPES["any"], 12, planner.SPACE)["microbatches"] == (1, 2, 3, 4, 6, 12)


def test_plan_of_refuses_an_unknown_axis():
    with pytest.raises(ValueError, match="Unknown search axes \\['dropout'\\]; allowed values"):
        plan_of({"dropout": 0.1})
    with pytest.raises(ValueError, match="Unknown technique 'dropout'; registered"):
        technique("dropout")


CHOICE_FIELDS = [f for f in lm.Plan.flag_fields() if f.metadata["choices"]]


@pytest.mark.parametrize("field", CHOICE_FIELDS, ids=lambda f: f.name)
@given(value=st.text(min_size=1, max_size=12))
def test_a_plan_refuses_a_value_outside_a_fields_choices_naming_it(field, value):
    if value in field.metadata["choices"] or (field.name == "loss_scale" and value == "auto"):
        return
    with pytest.raises(ValueError, match=field.name):
        lm.Plan(**{field.name: value})


def test_technique_modules_import_no_other_technique_nor_the_composer():
    """A technique declares itself against the protocol (lowmem_jax.core.technique) and its own
    implementation; Plan, the step and the other techniques stay out (the import contract in
    pyproject.toml says the same for every layer)."""
    here = pathlib.Path(lm.__file__).parent / "techniques"
    paths = sorted(here.glob("*/*.py"))
    assert len({p.parent.name for p in paths}) == len(TECHNIQUES)
    for path in paths:
        own = f"lowmem_jax.techniques.{path.parent.name}"
        forbidden = ("lowmem_jax.compose", "lowmem_jax.techniques")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                mine = name == own or name.startswith(own + ".")
                assert mine or not name.startswith(forbidden), f"{path} imports {name}"


#: A setting of each technique the planner does not search (an axis' values are taken from it).
UNSEARCHED = {
    "loss_scale": lm.Plan(loss_scale="static"),
    "shard": lm.Plan(optimizer_memory="pinned_host"),  # ZeRO's stages: sharding_cases.py
    "input_dtype": lm.Plan(input_dtype="uint8"),
    "loss_chunk": lm.Plan(loss_chunk=64),  # llama-tiny's 8 x 32 tokens in 4 chunks
    "weight_memory": lm.Plan(
        weight_memory="pinned_host",
        optimizer_memory="pinned_host",
        optimizer_update="host",
        remat="full",
    ),  # fmt: skip
}


#: Techniques whose every setting needs several devices, tested in a process that has them.
ON_DEVICES = {"pipeline": "tests/pipeline_cases.py"}


def _settings():
    for t in TECHNIQUES:
        if t.name in ON_DEVICES:
            continue
        if t.axis is None or t.axis.over_devices is not None:  # a mesh axis: one device here
            yield t.name, UNSEARCHED[t.name]
            continue
        for value in t.axis.space(8):
            if value not in t.axis.families and plan_of({t.axis.key: value}) != lm.Plan():
                yield t.name, plan_of({t.axis.key: value})


def test_every_technique_has_a_setting_here():
    assert {name for name, _ in _settings()} == {t.name for t in TECHNIQUES} - set(ON_DEVICES)


@pytest.mark.parametrize("name,plan", list(_settings()), ids=lambda x: getattr(x, "name", x))
def test_every_setting_changes_the_step_and_says_it_took_effect(name, plan):
    """Through Plan.configure_model, Plan.wrap_optimizer and make_train_step's hooks, each
    setting of each technique reaches the program (a technique whose hooks were not wired would
    build the default step), and its verdict (lm.verdicts) says it took effect."""
    work, setup = _built(plan)
    text = setup.step.lower(setup.abstract_state(), work.batch).as_text()
    assert text != _default_program(work.name)
    found = {v.technique: v for v in setup.verdicts()}
    assert found[name].took_effect, found[name]


def test_a_setting_with_nothing_to_act_on_says_so():
    """WRN-10-1's Tucker factors, 70% sparse, are all under the 4,096 elements a low-bit state
    quantizes: int8 is on and changes nothing it stores, and the verdict says so instead of
    staying silent. A plan that turns nothing on has no verdicts."""
    tucker, sparse = lm.FactorConfig("tucker", 0.25), lm.sparsity.report_sparsity(0.7)
    plan = lm.Plan(optimizer_state="int8", factorize=tucker, sparsity=sparse)
    found = {v.technique: v for v in lm.build(lm.workload("wrn-10-1", 8), plan).verdicts()}
    assert found["factorize"].took_effect and not found["optimizer_state"].took_effect
    assert found["optimizer_state"].evidence.startswith("0 of ")
    assert "under 4,096 elements" in found["optimizer_state"].evidence
    assert lm.build(lm.workload("wrn-10-1", 8), lm.Plan()).verdicts() == []
    one = lm.build(lm.workload("wrn-10-1", 8), lm.Plan(shard="zero1", devices=1)).verdicts()
    assert [(v.technique, v.took_effect) for v in one] == [("shard", False)]


_PAIRS = [
    (a, b) for (i, a), (j, b) in itertools.combinations(enumerate(_settings()), 2) if a[0] != b[0]
]


_SPARSE_70 = lm.sparsity.report_sparsity(0.7)


def _pair(a: dict, b: dict):
    """The entry of :data:`_PAIRS` whose two plans set the fields ``a`` and ``b``."""
    (found,) = [(x, y) for x, y in _PAIRS if (x[1], y[1]) == (lm.Plan(**a), lm.Plan(**b))]
    return found


@settings(max_examples=4, deadline=None)
@given(pair=st.sampled_from(_PAIRS))
@example(pair=_pair({"precision": "mixed_fp16"}, {"activations": "int8"}))
@example(pair=_pair({"optimizer_state": "int8"}, {"optimizer_memory": "pinned_host"}))
@example(pair=_pair({"sparsity": _SPARSE_70}, {"optimizer_memory": "pinned_host"}))
def test_any_two_settings_refuse_in_one_line_or_each_gives_its_verdict(pair):
    """Two techniques' settings together (a sample of every pair, a new one each run): the
    plan is refused in one line naming a field of one of them, or the step builds and each
    technique's verdict is there (before: `lowmem analyze` crashed on an int8 state with a
    factored second moment, on int8 activations with mixed precision or microbatches, and on
    a low-bit state kept in host memory; the analytic count on sparse weights whose pattern is
    kept in host memory)."""
    (name_a, plan_a), (name_b, plan_b) = pair
    fields = {f.name for t in TECHNIQUES if t.name in (name_a, name_b) for f in t.fields}
    changed = {f.name: getattr(plan_b, f.name) for f in dataclasses.fields(plan_b)
               if getattr(plan_b, f.name) != getattr(lm.Plan(), f.name)}  # fmt: skip
    try:
        plan = dataclasses.replace(plan_a, **changed)
        work, setup = _built(plan)
    except ValueError as err:
        line = str(err).splitlines()[0]
        assert any(f in line for f in fields), (pair, line)
        return
    found = {v.technique for v in setup.verdicts()}
    assert {name_a, name_b} <= found, (pair, found)
    state = setup.abstract_state()  # the analytic count reads it as laid out (host memory too)
    assert memory.analytic_breakdown(state=state, batch=work.batch, tx=setup.tx)["total_bytes"] > 0


#: Where each setting is tried: WRN-10-1 (its widest 3x3 kernels, 18,432 elements, get a
#: quantized state), else the small transformer (Adam: for a setting that SGD refuses).
MODELS = ("wrn-10-1", "dynamicconv-small", "llama-tiny")
#: The sequence length of each of :data:`MODELS` that takes one (short: a test's).
SEQ_LEN = {"llama-tiny": 32}


def _built(plan):
    """``(workload, setup)`` on the first of :data:`MODELS` whose build takes ``plan`` (a
    setting that cannot apply to a model refuses it in one line, a ``ValueError``)."""
    for model in MODELS:
        work = lm.workload(model, 8, seq_len=SEQ_LEN.get(model))
        work = work.with_input_dtype(plan.input_dtype)
        try:
            return work, lm.build(work, plan)
        except ValueError:
            if model == MODELS[-1]:
                raise


@functools.cache
def _default_program(model: str) -> str:
    work = lm.workload(model, 8, seq_len=SEQ_LEN.get(model))
    setup = lm.build(work, lm.Plan())
    return setup.step.lower(setup.abstract_state(), work.batch).as_text()


#: A technique that acts per block, as a new one would be written: its folder (this file as its
#: package's ``__init__``) and its line in the registry, nothing else. Its hook does nothing but
#: tag each block's output (``checkpoint_name``), so its verdict counts what it reached.
_SCRATCH = '''"""Block counter: a per-block hook tagging each block's output (a test's)."""

import jax

from lowmem_jax.blocks.hooks import BlockHook
from lowmem_jax.core.report_hooks import rows_of
from lowmem_jax.core.technique import (
    Axis, EnvelopeRule, ModelHooks, PlanField, ReportHooks, Technique, Verdict,
)

TAG = "counted_block"


class _Tagged(BlockHook):
    def wrap_body(self, body, closed, iterations):
        def tagged(h, xs, *rest):
            h, out = body(h, xs, *rest)
            return jax.ad_checkpoint.checkpoint_name(h, TAG), out

        return tagged


def _validate(plan):
    if plan.block_counter not in (0, 1):
        raise ValueError(f"block_counter must be 0 or 1, got {plan.block_counter!r}")


def _verdict(evidence, plan):
    if not plan.block_counter:
        return None
    tags = [e for e, _ in evidence.equations()
            if e.primitive.name == "name" and e.params["name"] == TAG]
    return Verdict("block_counter", bool(tags), f"{len(tags)} block bodies tagged")


TECHNIQUE = Technique(
    name="block_counter",
    fields=(PlanField("block_counter", int, 0, "0 or 1: tag each block's output.",
                      help="tag each block's output (a test's technique)"),),
    validate=_validate,
    label=lambda plan: "counted" if plan.block_counter else None,
    envelope=EnvelopeRule("max_block_counter", {"report": 0, "any": 1},
                          lambda config, limit: None if config.get("block_counter", 0) <= limit
                          else "counted blocks", lambda limit: "" if limit else "blocks uncounted"),
    axis=Axis("block_counter", (0, 1), plan_fields=lambda v: {"block_counter": v},
              within=lambda v, limit, batch_size: v <= limit),
    model=ModelHooks(block=lambda plan: _Tagged() if plan.block_counter else None),
    report=ReportHooks(verdict=_verdict,
                       rows=rows_of("counting", "counted", [("counted", {"block_counter": 1})])),
)
'''

_SCRATCH_CHECKS = """
import json, sys
import lowmem_jax as lm
from lowmem_jax.cli import dispatch
from lowmem_jax.planning import planner
from lowmem_jax.planning.envelope import ENVELOPES, in_words
from lowmem_jax.planning.space import axes_in
from lowmem_jax.report.grid import model_grid
from lowmem_jax.techniques import TECHNIQUES

assert "block_counter" in [t.name for t in TECHNIQUES]
plan = lm.Plan(block_counter=1)                                   # Plan
assert plan.to_dict()["block_counter"] == 1
assert axes_in(ENVELOPES["any"], 8, planner.SPACE)["block_counter"] == (0, 1)   # planner
assert axes_in(ENVELOPES["report"], 8, planner.SPACE)["block_counter"] == (0,)
assert ENVELOPES["report"].why_outside({"batch_size": 8, **plan.to_dict()}) == "counted blocks"
assert "blocks uncounted" in in_words(ENVELOPES["report"].describe())          # envelopes
names = [name for name, _, p in model_grid("wrn-10-1", 8, "quick")]           # report
assert "counted" in names, names
verdicts = {v.technique: v for v in lm.build(lm.workload("wrn-10-1", 8), plan).verdicts()}
assert verdicts["block_counter"].took_effect, verdicts                        # verdicts
print(json.dumps(verdicts["block_counter"].evidence))
sys.exit(dispatch.main(["analyze", "--model", "wrn-10-1", "--batch-size", "8",
                        "--block-counter", "1"]))                             # the CLI
"""


def test_a_new_per_block_technique_needs_only_its_folder_and_its_registry_line(tmp_path):
    """A scratch technique acting per block (a no-op hook that tags each block's output), added
    to a copy of the package as its folder plus one line in the registry's tuple, reaches Plan,
    the planner's axes, both envelopes, the report's grid, the verdicts and ``lowmem analyze``
    (its flag and its verdict), and the import contract still holds."""
    import shutil
    import subprocess
    import sys

    root = pathlib.Path(lm.__file__).resolve().parents[1]
    shutil.copytree(root / "lowmem_jax", tmp_path / "lowmem_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    folder = tmp_path / "lowmem_jax" / "techniques" / "block_counter"
    folder.mkdir()
    (folder / "__init__.py").write_text(_SCRATCH)
    registry = tmp_path / "lowmem_jax" / "techniques" / "__init__.py"
    text = registry.read_text()
    text = text.replace("    activations,\n", "    activations,\n    block_counter,\n", 1)
    line = "    remat.TECHNIQUE,\n"
    text = text.replace(line, f"{line}    block_counter.TECHNIQUE,\n")
    registry.write_text(text)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _SCRATCH_CHECKS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "block bodies tagged" in run.stdout
    assert "block_counter: took effect" in run.stdout, run.stdout[-2000:]
    lint = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
         " sys.exit(lint_imports_command())"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert lint.returncode == 0, lint.stdout[-2000:]
