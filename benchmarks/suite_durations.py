"""The test suite's time, test by test, before and after a change: two runs of the README's test
command on the same machine, each with an empty test compilation cache, compared per file and
per test.

Each run (from a clean clone; a fresh ``TMPDIR`` empties the suite's persistent compilation
cache)::

    TMPDIR=$(mktemp -d) python -m pytest -q -n 2 --dist worksteal --junitxml=RUN.xml

then ``python benchmarks/suite_durations.py --before A.xml --after B.xml --out STEM``. Seconds
are each test's own (setup + call + teardown, as pytest's JUnit report gives them), summed over
the two workers, which share the machine's two cores: a ratio within one pair of runs is the
figure to quote, not a time across machines.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from typing import Any


def read_junit(path: str) -> dict[str, Any]:
    """``{"tests": {nodeid: seconds}, "wall_seconds": the run's}`` of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = {}
    for case in root.iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        tests[f"{module}::{case.get('name')}"] = float(case.get("time", 0.0))
    return {"tests": tests, "wall_seconds": float(suite.get("time", 0.0))}


def compare(before: dict[str, Any], after: dict[str, Any], slowest: int = 40) -> dict[str, Any]:
    """Per-file sums and the ``slowest`` tests of ``before``, each with its time ``after``
    (``None`` where the test no longer exists)."""

    def by_file(tests):
        sums = collections.Counter()
        for node, seconds in tests.items():
            sums[node.split("::")[0]] += seconds
        return sums

    files_before, files_after = by_file(before["tests"]), by_file(after["tests"])
    files = sorted(set(files_before) | set(files_after), key=lambda f: -files_before.get(f, 0.0))
    top = sorted(before["tests"], key=lambda n: -before["tests"][n])[:slowest]
    return {
        "totals": {
            "tests_before": len(before["tests"]),
            "tests_after": len(after["tests"]),
            "summed_before": round(sum(before["tests"].values()), 1),
            "summed_after": round(sum(after["tests"].values()), 1),
            "wall_before": round(before["wall_seconds"], 1),
            "wall_after": round(after["wall_seconds"], 1),
        },
        "files": [
            {
                "file": f,
                "before": round(files_before.get(f, 0.0), 1),
                "after": round(files_after.get(f, 0.0), 1),
            }
            for f in files
        ],  # fmt: skip
        "slowest": [
            {
                "test": n,
                "before": round(before["tests"][n], 1),
                "after": None if n not in after["tests"] else round(after["tests"][n], 1),
            }
            for n in top
        ],  # fmt: skip
    }


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def to_markdown(result: dict[str, Any]) -> str:
    t = result["totals"]
    lines = [
        "# The test suite, test by test, before and after",
        "",
        result["note"],
        "",
        f"Command: `{result['meta']['command']}`",
        "",
        "| | before | after |",
        "|---|---:|---:|",
        f"| tests | {t['tests_before']} | {t['tests_after']} |",
        f"| pytest's wall time | {_minutes(t['wall_before'])} | {_minutes(t['wall_after'])} |",
        f"| seconds summed over the two workers | {t['summed_before']:.0f} | "
        f"{t['summed_after']:.0f} |",
        "",
        "## By file (the 25 slowest before)",
        "",
        "| file | before s | after s |",
        "|---|---:|---:|",
    ]
    for row in result["files"][:25]:
        lines.append(f"| {row['file']} | {row['before']:.1f} | {row['after']:.1f} |")
    lines += ["", "## The slowest tests before", "", "| test | before s | after s |",
              "|---|---:|---:|"]  # fmt: skip
    for row in result["slowest"]:
        after = "gone" if row["after"] is None else f"{row['after']:.1f}"
        lines.append(f"| {row['test']} | {row['before']:.1f} | {after} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["files"][:20][::-1]
    fig, ax = plt.subplots(figsize=(8, 6))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["before"] for r in rows], 0.4, label="before")
    ax.barh([i - 0.2 for i in y], [r["after"] for r in rows], 0.4, label="after")
    ax.set_yticks(list(y), [r["file"].removeprefix("tests/") for r in rows], fontsize=7)
    ax.set_xlabel("seconds summed over the two workers (cold compilation cache)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="JUnit XML of the run before")
    parser.add_argument("--after", required=True, help="JUnit XML of the run after")
    parser.add_argument("--out", required=True, help="output stem (.json, .md, .png)")
    parser.add_argument("--note", default="", help="where and when the runs were made")
    args = parser.parse_args(argv)
    import result_writer  # beside this script: on sys.path when it runs as one

    result = compare(read_junit(args.before), read_junit(args.after))
    given = sys.argv[1:] if argv is None else argv
    command = [a for i, a in enumerate(given) if "--note" not in (a, given[i - 1] if i else "")]
    result["note"], result["meta"] = args.note, result_writer.metadata(__file__, command)
    result_writer.write(args.out, result, to_markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
