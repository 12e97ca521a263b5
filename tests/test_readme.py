import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


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
