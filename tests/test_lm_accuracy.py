"""experiments/lm_accuracy.py trains the plans the committed LLM scaling table quotes."""

from __future__ import annotations

import json
import os

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
