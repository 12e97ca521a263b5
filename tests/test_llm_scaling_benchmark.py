"""benchmarks/llm_scaling.py at the tiny decoder shape: its Flax/Optax-alone peer rows are the
configurations they name, and the library rows' breakdown adds up (seconds)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from conftest import load_benchmark

import lowmem_jax as lm


@pytest.fixture(scope="module")
def scaling():
    return load_benchmark("llm_scaling")


def test_the_peer_rows_store_what_they_name(scaling):
    rows = {name: scaling.peer_row("llama-tiny", 4, 16, name) for name in scaling.PEERS}
    fp32, bf16 = rows["remat"]["breakdown"], rows["remat+bf16"]["breakdown"]
    assert bf16["parameters"] * 2 == fp32["parameters"]  # bf16 parameters
    assert bf16["optimizer_state"] < fp32["optimizer_state"]  # adamw's moments follow them
    factored = rows["remat+bf16+adafactor"]["breakdown"]["optimizer_state"]
    # No first moment (the second factored only for dims >= 128: few at this shape).
    assert factored < 0.51 * bf16["optimizer_state"]
    # MultiSteps holds a parameter-sized accumulator in its state.
    multisteps = rows["remat+bf16+adafactor+multisteps"]["breakdown"]["optimizer_state"]
    assert multisteps >= factored + bf16["parameters"]


def test_a_library_row_breaks_the_state_into_its_parts(scaling):
    work = lm.workloads.workload("llama-tiny", 4, seq_len=16)
    row = scaling.library_row("plain", lm.workloads.build_plain(work))
    parts = row["breakdown"]
    params = lm.models.llama.parameter_count(lm.models.llama.PRESETS["tiny"]) * 4
    assert parts["parameters"] == parts["gradients"] == params
    assert parts["optimizer_state"] >= 2 * params  # Adam's two float32 moments
    assert parts["logits"] == 4 * 16 * 256 * jnp.dtype(jnp.float32).itemsize
    assert row["total_bytes"] >= parts["parameters"] + parts["optimizer_state"]


def test_bert_s_peer_trains_the_masked_positions_with_dropout(scaling):
    row = scaling.peer_row("bert-tiny", 4, 16, "remat+bf16")
    assert row["breakdown"]["parameters"] == 2 * lm.models.bert.bert_parameter_count(
        lm.models.bert.BERT_PRESETS["tiny"]
    )


def test_the_readme_s_language_model_figures_are_the_committed_results():
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    results = root / "benchmarks/results"
    readme = " ".join((root / "README.md").read_text().split())
    plain = json.loads((results / "analyze_llama-7b_b1_s2048_plain_cpu.json").read_text())
    planned = json.loads((results / "plan_llama-7b_b1_s2048_any_24GiB_cpu.json").read_text())
    assert f"plain Flax/Optax step {plain['xla']['total_bytes'] / 2**30:.1f} GiB" in readme
    assert f"({planned['xla']['total_bytes'] / 2**20:,.1f} MiB)" in readme
    assert " ".join(planned["argv"][6:]) in readme
    sizes = json.loads((results / "llm_scaling_cpu.json").read_text())["sizes"]
    ratios = []
    for e in sizes:
        if e["model"].startswith("llama"):
            rows = {r["label"]: r["total_bytes"] for r in e["rows"]}
            best = rows["best in the 'any' envelope"]
            peer = min(v for k, v in rows.items() if k.startswith("peer"))
            ratios.append((rows["plain Flax/Optax step"] / best, peer / best))
    plain_r, peer_r = zip(*ratios, strict=True)
    assert f"{min(plain_r):.1f}x-{max(plain_r):.1f}x below the plain step" in readme
    assert f"{min(peer_r):.1f}x-{max(peer_r):.1f}x below the least of Flax/Optax" in readme
