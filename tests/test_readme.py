import contextlib
import io
import json
import pathlib
import re

import pytest

from lowmem_jax.report.run import summary_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
YOUR_MODEL = ROOT / "docs" / "your_model.md"  # the whole step for a bundled model, in one block


@pytest.mark.slow
def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", YOUR_MODEL.read_text(), re.S)
    runnable = [b for b in blocks if "import lowmem_jax as lm" in b]
    assert runnable, "docs/your_model.md lost its runnable example"
    namespace: dict = {}
    exec(compile(runnable[0], str(YOUR_MODEL), "exec"), namespace)
    assert int(namespace["state"].step) == 3
    assert namespace["metrics"]["loss"].dtype.name == "float32"


@pytest.mark.slow
def test_readme_bring_your_own_model_runs():
    """Linen, NNX and the hand-written step, in order, in one namespace (as a reader would)."""
    section = README.read_text().split("### Bring your own model\n")[1].split("\n### ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 4, "the README's Bring your own model section lost a block"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # Linen, one epoch
    assert float(namespace["metrics"]["loss"]) < 1.6 and int(namespace["state"].skipped_steps) < 3
    exec(compile(blocks[1], str(README), "exec"), namespace)  # NNX, sparse, three epochs
    assert type(namespace["trained"]).__name__ == "NNXNet" and namespace["accuracy"] > 0.6
    assert (
        abs(namespace["tx"].describe(namespace["state"].opt_state)["sparsity"]["density"] - 0.3)
        < 0.01
    )
    assert namespace["report"].xla["total_bytes"] > 0
    # By hand: the block itself asserts its parameters equal make_train_step's, bit for bit.
    exec(compile(blocks[2], str(README), "exec"), namespace)
    assert int(namespace["mine"].step) == 5
    # A published model (transformers' Flax GPT-2): the verdicts the README prints, and it trains.
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(blocks[3], str(README), "exec"), namespace)
    shown = section.split("prints\n\n```\n")[1].split("```")[0]
    assert printed.getvalue().split() == shown.split()
    assert int(namespace["metrics"]["skipped_steps"]) == 0


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    command = re.search(
        r"Install and run the tests.*?```bash\n(.*?)\n```", README.read_text(), re.S
    )
    assert command and command.group(1).strip() in ci


def test_readme_memory_tables_are_the_committed_reports():
    """Every table marked ``summary_table: <report.json>`` in the README or a page of docs/
    equals that report's rows."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [
        (page, path, table)
        for page in pages
        for path, table in re.findall(
            r"<!-- summary_table: (\S+) [^>]*-->\n(.*?)<!-- /summary_table -->",
            page.read_text(),
            re.S,
        )
    ]
    assert blocks, "the README and docs/ lost their memory table"
    for page, path, table in blocks:
        report = json.loads((ROOT / path).read_text())
        names = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
        expected = summary_table(report, names)
        shown = page.relative_to(ROOT)
        assert table == expected, f"stale numbers in {shown}; from {path}:\n{expected}"


def test_readme_headline_table_is_the_committed_results():
    """The README's first table equals what the committed reports and accuracy give."""
    from experiments.envelope_accuracy import headline_table

    text = README.read_text()
    block = re.search(r"<!-- headline_table[^>]*-->\n(.*?)<!-- /headline_table -->", text, re.S)
    assert block, "the README lost its headline table"
    assert block.group(1) == headline_table(), "stale headline; regenerate it"
