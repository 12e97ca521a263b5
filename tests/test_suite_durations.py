"""benchmarks/suite_durations.py: two JUnit reports of the suite compared per file and per test."""

import json
import pathlib

from conftest import BENCHMARKS, load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _junit(path, wall, cases):
    body = "".join(
        f'<testcase classname="tests.{module}" name="{name}" time="{seconds}" />'
        for module, name, seconds in cases
    )
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
        f'<testsuite name="pytest" tests="{len(cases)}" time="{wall}">{body}</testsuite>'
        "</testsuites>"
    )
    return str(path)


def test_runs_are_compared_per_file_and_per_test(tmp_path, monkeypatch):
    durations = load_benchmark("suite_durations")
    before = _junit(tmp_path / "a.xml", 100.0, [("test_a", "slow", 60.0), ("test_a", "x", 1.5),
                                                ("test_b", "gone", 30.0)])  # fmt: skip
    after = _junit(tmp_path / "b.xml", 50.0, [("test_a", "slow", 20.0), ("test_a", "x", 1.0),
                                              ("test_c", "new", 5.0)])  # fmt: skip
    result = durations.compare(durations.read_junit(before), durations.read_junit(after))
    assert result["totals"] == {
        "tests_before": 3, "tests_after": 3, "summed_before": 91.5, "summed_after": 26.0,
        "wall_before": 100.0, "wall_after": 50.0,
    }  # fmt: skip
    files = {row["file"]: (row["before"], row["after"]) for row in result["files"]}
    assert files == {"tests/test_a.py": (61.5, 21.0), "tests/test_b.py": (30.0, 0.0),
                     "tests/test_c.py": (0.0, 5.0)}  # fmt: skip
    assert result["slowest"][0] == {"test": "tests/test_a.py::slow", "before": 60.0, "after": 20.0}
    assert result["slowest"][1]["after"] is None  # the test no longer exists
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # result_writer, beside the script
    assert durations.main(["--before", before, "--after", after, "--out", str(tmp_path / "r")]) == 0
    assert "| tests/test_a.py::slow | 60.0 | 20.0 |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").stat().st_size > 0


def test_the_committed_table_is_its_json():
    stem = ROOT / "benchmarks" / "results" / "suite_durations_cold"
    result = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".md").read_text() == load_benchmark("suite_durations").to_markdown(
        result
    )
