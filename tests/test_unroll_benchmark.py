"""benchmarks/unroll.py: its table and plot from a result (no compile), and its flag check."""

from __future__ import annotations

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def unroll():
    return load_benchmark("unroll")


def _result():
    rows = [
        {"plan": "fp32", "model_default": "None",
         "total_mib": {"False": 560.9, "True": 488.5, "None": 488.5}},
        {"plan": "fp16", "model_default": "None",
         "total_mib": {"False": 375.7, "True": 431.9, "None": 375.7}},
    ]  # fmt: skip
    model = {"model": "wrn-28-2", "batch_size": 128, "plain_mib": 491.1, "rows": rows}
    return {"command": "python benchmarks/unroll.py", "backend_source": "XLA:CPU",
            "models": [model]}  # fmt: skip


def test_table_bolds_the_default_and_divides_it_by_plain(unroll, tmp_path):
    table = unroll.markdown(_result())
    assert "| fp32 | 560.9 | 488.5 | **488.5** | 0.995 |" in table
    assert "| fp16 | 375.7 | 431.9 | **375.7** | 0.765 |" in table
    unroll.plot(_result(), str(tmp_path / "u.png"))
    assert (tmp_path / "u.png").stat().st_size > 0


def test_an_unknown_plan_is_one_line_and_exit_2(unroll, capsys):
    with pytest.raises(SystemExit) as exit_:
        unroll.main(["--plans", "fp32,fp8", "--out-dir", "unused"])
    assert exit_.value.code == 2
    assert "--plans: unknown ['fp8']" in capsys.readouterr().err
