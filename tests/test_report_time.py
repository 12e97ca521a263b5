"""benchmarks/report_time.py: `lowmem report`'s progress lines and /usr/bin/time's line read back
into runs, and the README's quoted times equal to the committed runs'."""

import json

import pytest
from conftest import BENCHMARKS, load_benchmark

LOG = """lowmem report: wrn-28-2, batch 128 (compile-only, no step runs)
[ 1/2] plain                              XLA total    491.1 MiB  analytic    537.6 MiB  (7.2s; 7s elapsed, ~140s left)
[ 2/2] mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input XLA total     20.7 MiB  analytic     20.2 MiB  (33.7s; 41s elapsed, ~0s left)
| config | ... |
172.31 s wall 251.40 s user
"""  # noqa: E501


def test_a_log_becomes_a_run_and_runs_a_table(tmp_path):
    bench = load_benchmark("report_time")
    run = bench.parse_log(LOG)
    assert run["wall_seconds"] == 172.31 and run["user_seconds"] == 251.4
    assert run["rows"] == [
        {"name": "plain", "xla_total_mib": 491.1, "seconds": 7.2},
        {"name": "mixed_fp16 + mb 8 + remat full + sparse 70% + uint8 input",
         "xla_total_mib": 20.7, "seconds": 33.7},
    ]  # fmt: skip
    other = {**run, "rows": run["rows"][:1], "user_seconds": None}
    lines = bench.table({"a": run, "b": other}, ["a", "b"]).splitlines()
    assert lines[2] == "| plain | 7.2 | 7.2 |" and lines[3].endswith("| 33.7 | - |")
    assert lines[-2:] == [
        "| **whole process** | **172 s** | **172 s** |",
        "| user CPU | 251 s | - |",
    ]
    bench.plot({"a": run, "b": other}, ["a", "b"], str(tmp_path / "runs.png"))
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no '/usr/bin/time' line"):
        bench.parse_log(LOG.rsplit("\n", 2)[0])


def test_the_readme_quotes_the_committed_cold_and_warm_times():
    results = json.loads((BENCHMARKS / "results" / "report_time.json").read_text())
    cold, warm = (results["runs"][results["readme"][k]]["wall_seconds"] for k in ("cold", "warm"))
    readme = " ".join((BENCHMARKS.parent / "README.md").read_text().split())
    quote = f"{cold / 60:.1f} minutes with an empty compilation cache, {warm / 60:.1f} warm"
    assert quote in readme
