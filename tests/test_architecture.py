"""The house's layers are enforced, not described: the import contract in ``pyproject.toml``
(``lint-imports``) holds, and breaks when a technique imports another, when generic code reads a
technique's internals, or when a layer imports one above it; the top level holds the curated API
and its old paths, nothing else."""

import pathlib
import shutil
import subprocess
import sys

import pytest

import lowmem_jax as lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
        " sys.exit(lint_imports_command())"]  # fmt: skip


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``root``, with ``root``'s contract."""
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contract_holds():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "3 kept, 0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> pathlib.Path:
    """The package and its contract, copied: each case below adds one import to the copy."""
    root = tmp_path_factory.mktemp("house")
    shutil.copytree(ROOT / "lowmem_jax", root / "lowmem_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    "module,line,broken",
    [
        # a technique importing another technique (its face, or its internals)
        ("techniques/remat/schedule.py", "from lowmem_jax.techniques import sparsity",
         "Each technique imports no other technique"),
        ("techniques/pipeline/gpipe.py", "from lowmem_jax.techniques.microbatches import "
         "accumulate", "Each technique imports no other technique"),
        # generic code reading a technique's internals instead of its package
        ("compose/plan.py", "from lowmem_jax.techniques.sparsity import transform",
         "Generic code reaches a technique through its package"),
        ("blocks/scanned.py", "from lowmem_jax.techniques.pipeline import gpipe",
         "The layers"),
        # a layer importing one above it
        ("core/base.py", "from lowmem_jax.compose import plan", "The layers"),
        ("techniques/precision/policy.py", "from lowmem_jax.workloads import registry",
         "The layers"),
    ],
)  # fmt: skip
def test_the_contract_breaks_on_an_import_across_the_layers(copy, module, line, broken):
    path = copy / "lowmem_jax" / module
    original = path.read_text()
    try:
        path.write_text(f"{original}\n{line}  # noqa\n")
        result = _lint(copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout[-2000:]
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout[-2000:]


def test_the_top_level_holds_the_api_and_its_old_paths_only():
    """Every other module lives in the folder of its concept."""
    top = sorted(p.name for p in pathlib.Path(lm.__file__).parent.glob("*.py"))
    assert top == ["__init__.py", "_moved.py"]


def test_no_package_name_hides_one_of_its_modules():
    """A package's face exports names, and none is the name of one of its modules (else
    ``lm.<package>.<module>`` would be the name, not the module)."""
    import importlib
    import pkgutil
    import types

    for info in pkgutil.walk_packages(lm.__path__, "lowmem_jax."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        parent, _, name = info.name.rpartition(".")
        assert getattr(importlib.import_module(parent), name) is module, info.name
        assert isinstance(module, types.ModuleType)


def _documented_modules() -> tuple[set[str], set[str]]:
    """The files and folders docs/architecture.md's module list names (``## Every module``)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Every module", 1)[1].split("```", 2)[1]
    files, folders, stack = set(), set(), []
    for line in block.splitlines():
        match = re.match(r"^( *)([\w.]+/?)(\s|$)", line)
        if not match or len(match.group(1)) >= 20:  # a description's continuation
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        del stack[depth:]
        path = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            folders.add(path)
            stack.append(name.rstrip("/"))
        elif name.endswith((".py", ".pyi")):
            files.add(path)
    return files, folders


def test_the_architecture_page_lists_every_module_and_no_other():
    package = pathlib.Path(lm.__file__).parent
    on_disk = {str(p.relative_to(package.parent)) for p in package.rglob("*.py*")
               if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts}  # fmt: skip
    folders = {str(p.relative_to(package.parent)) for p in package.rglob("*")
               if p.is_dir() and p.name != "__pycache__"} | {"lowmem_jax"}  # fmt: skip
    inits = {f"{folder}/__init__.py" for folder in folders if folder != "lowmem_jax"}
    files, named_folders = _documented_modules()
    assert named_folders == folders
    assert files == on_disk - inits, (sorted(on_disk - inits - files), sorted(files - on_disk))


def test_the_readme_picture_is_the_contract_s_layers():
    """The README's architecture picture names the contract's layers, top to bottom."""
    import re

    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in layers["contracts"] if c["type"] == "layers"]
    readme = (ROOT / "README.md").read_text()
    picture = readme.split("## Architecture in one picture", 1)[1].split("```", 2)[1]
    named = re.findall(r"\b([a-z_]+)/", picture)
    order = [named.index(p.strip().removeprefix("lowmem_jax."))
             for layer in contract["layers"] for p in layer.split("|")]  # fmt: skip
    assert order == sorted(order), named
