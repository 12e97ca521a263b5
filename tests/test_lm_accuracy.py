"""experiments/lm_accuracy.py trains the plans the committed LLM scaling table quotes."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from experiments import lm_accuracy
from lowmem_jax.planning.search import plan_name


@pytest.mark.parametrize("envelope", ["report", "any"])
def test_the_trained_plans_are_the_committed_table_s(envelope):
    quoted = lm_accuracy.quoted_plans()[envelope]
    plan = lm_accuracy.PLANS[envelope]
    assert json.loads(json.dumps(plan.to_dict())) == quoted["fields"]  # as JSON holds it
    assert plan_name(plan) == quoted["plan"]
    # at this model's batch of 8 sequences the plan is unchanged
    assert lm_accuracy.at_batch(plan) == plan
    assert os.path.isfile(lm_accuracy.SCALING)


def _quote(delta: dict, form: str) -> str:
    """A paired difference as the docs write it: ``form`` over its mean, 95% interval and
    relative mean."""
    low, high = delta["ci95"]
    return form.format(mean=f"{delta['mean']:+.4f}", low=f"{low:+.4f}", high=f"{high:+.4f}",
                       rel=f"{100 * delta['relative_mean']:+.2f}%")  # fmt: skip


def test_the_docs_quote_the_committed_runs_all_from_one_commit():
    """README and docs/language_models.md quote experiments/results/lm_accuracy's figures, and
    every run there is of one commit (pairs from one commit)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    result = json.loads((root / "experiments/results/lm_accuracy/accuracy.json").read_text())
    runs = [json.loads(p.read_text())
            for p in (root / "experiments/results/lm_accuracy/runs").glob("*.json")]  # fmt: skip
    assert len(runs) == 9 and len({r["provenance"]["commit"] for r in runs}) == 1
    docs = (root / "docs/language_models.md").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    for row in result["rows"]:
        if row["name"] == "baseline":
            assert f"{row['value']['mean']:.4f} ({row['value']['std']:.4f})" in docs
            continue
        delta = row["delta_vs_baseline"]
        assert _quote(delta, "{mean} [{low}, {high}], {rel}") in docs
        assert f"{delta['mean']:+.4f}" in readme
        assert _quote(delta, "[{low}, {high}] ({rel})") in readme


def test_the_precision_runs_are_quoted_and_of_one_commit():
    """docs/techniques.md quotes experiments/results/lm_precision (bf16 + stochastic rounding
    against float32 AdamW), whose runs are all of one commit."""
    root = pathlib.Path(__file__).resolve().parents[1]
    out = root / "experiments/results/lm_precision"
    result = json.loads((out / "accuracy.json").read_text())
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert len(runs) == 6 and len({r["provenance"]["commit"] for r in runs}) == 1
    assert result["commits"] == [runs[0]["provenance"]["commit"]]
    docs = " ".join((root / "docs/techniques.md").read_text().split())
    (row,) = [r for r in result["rows"] if r["name"] == "bf16-sr"]
    delta = row["delta_vs_baseline"]
    assert _quote(delta, "{mean} [{low}, {high}] ({rel})") in docs
    assert f"commit {result['commits'][0]}" in docs
    assert abs(delta["relative_mean"]) < 0.02  # issue 81: within 2% of float32 at equal steps
