"""benchmarks/plan_exhaustive.py: its budget grid and its table (the compiles are the run's)."""

from __future__ import annotations

from conftest import load_benchmark
from hypothesis import given
from hypothesis import strategies as st

plan_exhaustive = load_benchmark("plan_exhaustive")


@given(
    least=st.integers(1, 10**9),
    extra=st.integers(0, 10**9),
    count=st.integers(2, 12),
)
def test_budgets_run_from_the_baseline_down_to_exactly_the_least(least, extra, count):
    """The last budget is the least total itself (only plans that reach it fit), not a float
    rounding of it that nothing fits."""
    baseline = least + extra
    got = plan_exhaustive.budgets(baseline, least, count)
    assert len(got) == count and got[-1] == least
    assert abs(got[0] - baseline) <= 1
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))


def test_table_counts_a_miss_and_the_worst_ratio():
    row = {"argv": ["--model", "m", "--batch-size", "16", "--remat", "full"],
           "xla_total_bytes": 2**20, "flops": 2.0}  # fmt: skip
    budgets = [
        {"budget_bytes": 2**21, "plans_that_fit": 3, "exhaustive": row, "planner": row,
         "flops_over_exhaustive": 1.0},
        {"budget_bytes": 2**20, "plans_that_fit": 1, "exhaustive": row, "planner": None,
         "flops_over_exhaustive": None},
    ]  # fmt: skip
    result = {"model": "m", "batch_size": 16, "reference_flops": 1.0, "budgets": budgets}
    text = plan_exhaustive.table([result], "cpu")
    assert "MISS: no plan found" in text
    assert "Worst ratio: 1.0000; budgets with no answer from the planner: 1 of 2." in text
    assert "| m b16 | 2.00 | 3 | `--remat full` | 2.000 |" in text
