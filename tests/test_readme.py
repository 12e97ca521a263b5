import json
import pathlib
import re

import pytest

from lowmem_jax.report import summary_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    runnable = [b for b in blocks if "import lowmem_jax as lm" in b]
    assert runnable, "the README lost its runnable example"
    namespace: dict = {}
    exec(compile(runnable[0], str(README), "exec"), namespace)
    assert int(namespace["state"].step) == 3
    assert namespace["metrics"]["loss"].dtype.name == "float32"


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    command = re.search(
        r"Install and run the tests.*?```bash\n(.*?)\n```", README.read_text(), re.S
    )
    assert command and command.group(1).strip() in ci


def test_readme_memory_tables_are_the_committed_reports():
    """Every README table marked ``summary_table: <report.json>`` equals that report's rows."""
    text = README.read_text()
    blocks = re.findall(
        r"<!-- summary_table: (\S+) [^>]*-->\n(.*?)<!-- /summary_table -->", text, re.S
    )
    assert blocks, "the README lost its memory table"
    for path, table in blocks:
        report = json.loads((README.parent / path).read_text())
        names = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
        expected = summary_table(report, names)
        assert table == expected, f"stale numbers in the README; from {path}:\n{expected}"
