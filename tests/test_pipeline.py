"""GPipe pipeline stages on one device: the schedule's arithmetic, the plan's refusals, the
committed per-device figures. The stages themselves run in tests/pipeline_cases.py (8 host
devices, a process of its own)."""

import json

import pytest
from conftest import BENCHMARKS, load_benchmark
from hypothesis import given, settings
from hypothesis import strategies as st

import lowmem_jax as lm
from lowmem_jax.planning.envelope import ENVELOPES
from lowmem_jax.techniques.pipeline import gpipe as pipeline_lib


@given(examples=st.integers(1, 512), stages=st.integers(2, 8))
def test_the_default_microbatches_are_the_largest_divisor_up_to_four_per_stage(examples, stages):
    m = pipeline_lib.microbatch_count(examples, stages)
    assert examples % m == 0 and 1 <= m <= 4 * stages
    assert not any(examples % k == 0 for k in range(m + 1, min(examples, 4 * stages) + 1))
    assert pipeline_lib.microbatch_count(examples, stages, m) == m


def test_the_bubble_is_the_idle_share_of_the_ticks():
    assert pipeline_lib.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert pipeline_lib.bubble_fraction(2, 1) == pytest.approx(0.5)


def test_bad_pipeline_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="pipeline must be an int >= 1, got 0"):
        lm.Plan(pipeline=0)
    with pytest.raises(ValueError, match="pipeline_microbatches must be an int >= 0"):
        lm.Plan(pipeline=2, pipeline_microbatches=-1)
    with pytest.raises(ValueError, match=r"Unknown pipeline_rest='x'; allowed values"):
        lm.Plan(pipeline=2, pipeline_rest="x")
    only = r"pipeline=2 runs with {} in \[{}\] only \(got {!r}\)"
    for field, allowed, value in (
        ("grad_compression", "'none'", "int8"),
        ("optimizer_update", "'device'", "host"),
    ):
        shard = "dp" if field == "grad_compression" else "none"
        memory = "pinned_host" if field == "optimizer_update" else "device"
        with pytest.raises(ValueError, match=only.format(field, allowed, value)):
            lm.Plan(pipeline=2, shard=shard, optimizer_memory=memory, **{field: value})
    with pytest.raises(ValueError, match="pipeline_microbatches=3 does not divide the 8"):
        pipeline_lib.microbatch_count(8, 2, 3)
    with pytest.raises(ValueError, match="pipeline=2 needs 2 devices; JAX sees 1"):
        lm.Plan(pipeline=2).mesh()


@settings(max_examples=40, deadline=None)
@given(batch=st.sampled_from([8, 32, 96, 128]), stages=st.sampled_from([2, 3, 4]),
       requested=st.sampled_from([0, 1, 2, 4, 8]), data=st.sampled_from([0, 1, 2]))  # fmt: skip
def test_the_envelope_counts_the_examples_a_pipeline_microbatch_normalises(
    batch, stages, requested, data
):
    """Inside the report's envelope iff each pipeline microbatch holds at least 8 examples
    (BatchNorm's statistics, as microbatching's rule); the any envelope takes every one."""
    fields = {"pipeline": stages, "pipeline_microbatches": requested}
    if data:
        fields.update(shard="dp", devices=data)
    config = {"batch_size": batch, **lm.Plan(**fields).to_dict()}
    if (batch // max(data, 1)) % max(requested, 1):
        return  # the build refuses these microbatches
    count = pipeline_lib.microbatch_count(batch // max(data, 1), stages, requested)
    report, every = (ENVELOPES[name].why_outside(config) for name in ("report", "any"))
    assert every is None
    assert (report is None) == (count == 1 or batch // count >= 8), report
    if report is not None:
        assert report == f"pipeline microbatches of {batch // count} examples (< 8)"


def test_the_committed_table_is_its_json_and_the_docs_quote_it():
    bench = load_benchmark("pipeline_stages")
    stem = BENCHMARKS / "results" / "pipeline_stages_cpu"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".md").read_text() == bench.to_markdown(result)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == set(bench.CONFIGS)
    for row in rows.values():  # every pipeline took effect and holds less per device
        assert "split over" in row["verdict"] and row["argument_bytes"] < row[
            "one_device_argument_bytes"]  # fmt: skip
    # The rest partitioned holds less than replicated; the transformer at 4 stages <= 0.3x.
    for model, stages in (("wrn-28-2", 3), ("iwslt", 4)):
        replicated, partitioned = rows[f"{model}:{stages}"], rows[f"{model}:{stages}:partition"]
        assert partitioned["argument_bytes"] < replicated["argument_bytes"]
    iwslt = rows["iwslt:4:partition"]
    assert iwslt["argument_bytes"] <= 0.3 * iwslt["one_device_argument_bytes"]
    mib = {k: f"{r['argument_bytes'] / 2**20:.2f}" for k, r in rows.items()}
    one = {k: f"{r['one_device_argument_bytes'] / 2**20:.2f}" for k, r in rows.items()}
    root = BENCHMARKS.parent
    docs = " ".join((root / "docs" / "distributed.md").read_text().split())
    readme = " ".join((root / "README.md").read_text().split())
    quoted = (
        f"argument bytes (state + batch) fall from {one['wrn-28-2:3']} MiB on one device to "
        f"{mib['wrn-28-2:3']} per device"
    )
    assert quoted in docs, quoted
    assert f"at 4 stages {mib['iwslt:4:partition']} MiB of arguments per device" in docs
    # A data axis beside the stages: less per device than the stages alone.
    for model, stages in (("wrn-28-2", 3), ("iwslt", 4)):
        alone = rows[f"{model}:{stages}:partition"]["argument_bytes"]
        for shard in ("zero2", "zero3"):  # zero3 holds less again: the parameters partitioned
            both = rows[f"{model}:{stages}:partition:{shard}x2"]
            assert both["argument_bytes"] < alone
            alone = both["argument_bytes"]
            ratio = both["argument_bytes"] / both["one_device_argument_bytes"]
            mib_both = f"{both['argument_bytes'] / 2**20:.2f}"
            quoted = f"{mib_both} MiB of arguments under `{shard}` ({ratio:.3f}x"
            assert quoted in docs, quoted
    assert (f"WRN-28-2 at 3 stages {one['wrn-28-2:3']} -> {mib['wrn-28-2:3']} MiB of arguments "
            "per device") in readme  # fmt: skip
    iwslt_one = f"{iwslt['one_device_argument_bytes'] / 2**20:.1f}"
    iwslt_mib = f"{iwslt['argument_bytes'] / 2**20:.1f}"
    assert f"the rest partitioned, {iwslt_one} -> {iwslt_mib} MiB" in readme
    wrn3, iwslt3 = (f"{rows[k]['argument_bytes'] / 2**20:.2f}" for k in (
        "wrn-28-2:3:partition:zero3x2", "iwslt:4:partition:zero3x2"))  # fmt: skip
    assert f"2 data devices under zero3: {wrn3} and {iwslt3} MiB" in readme


def test_the_benchmark_refuses_an_unknown_config_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        load_benchmark("pipeline_stages").main(["--configs", "wrn-28-2:5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "--configs: unknown ['wrn-28-2:5']; allowed values" in err[-1]


def test_the_four_stage_bounds_quoted_for_wrn_28_2_are_its_blocks():
    """distributed.md: contiguous stages of whole blocks hold at least 0.358x of WRN-28-2's
    parameters on some device (the best of every 4-way cut of its 12 blocks in order); an
    interleaved assignment holds 0.253x (largest block first onto the least-loaded device,
    which here reaches the optimum); the layers outside the stacks on every device."""
    import itertools

    import jax

    from lowmem_jax.techniques import weight_memory

    state = lm.build(lm.workload("wrn-28-2", 128), lm.Plan()).abstract_state()
    sizes = weight_memory.units(state.params)
    blocks = [sizes[f"group{g}_{part}"] for g in range(3)
              for part in ("first", "rest", "rest", "rest")]  # fmt: skip
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    outside = total - sum(blocks)
    contiguous = min(
        max(sum(blocks[i:j]) for i, j in zip((0, *cuts), (*cuts, len(blocks)), strict=True))
        for cuts in itertools.combinations(range(1, len(blocks)), 3)
    )
    loads = [0] * 4
    for size in sorted(blocks, reverse=True):
        loads[loads.index(min(loads))] += size
    docs = " ".join((BENCHMARKS.parent / "docs" / "distributed.md").read_text().split())
    assert f"at best {(contiguous + outside) / total:.3f}x" in docs
    assert f"could hold {(max(loads) + outside) / total:.3f}x" in docs
