"""The curated public API: ``lowmem_jax.__all__`` is small, and the docs use only it."""

import functools
import pathlib
import re
import types

import lowmem_jax as lm

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC = [
    "Plan",
    "TrainState",
    "make_train_step",
    "make_plain_train_step",
    "model_params",
    "split_nnx",
    "classifier_loss_fn",
    "translation_loss_fn",
    "custom_workload",
    "workload",
    "build",
    "analyze",
    "analyze_model",
    "inspect",
    "verdicts",
    "plan_for_budget",
    "NoPlanFits",
    "FactorConfig",
    "quantized_state",
    "ScannedBlocks",
    "scaled_grad_fn",
    "accumulate_gradients",
    "make_loss_scale",
    "cast_loss_fn",
    "compiler_options",
    "Optimizer",
    "SkipGuard",
    "NoProgressError",
    "models",
    "sparsity",
]
# Left the top level; each stays reachable through its submodule.
MOVED = [
    "loss_scale.all_finite",
    "loss_scale.select_tree",
    "loss_scale.NoOpLossScale",
    "loss_scale.StaticLossScale",
    "loss_scale.DynamicLossScale",
    "precision.Policy",
    "precision.get_policy",
    "precision.cast_floating",
    "remat.parse_policy",
    "base.as_optimizer",
    "base.differentiated_loss",
    "optimizer_state.QuantizedState",
    "memory.MemoryReport",
    "technique.Verdict",
    "inspector.Inspection",
    "planner.BudgetPlan",
    "nnx_split.SplitNNX",
    "techniques.shard.state_shardings",
]


def _resolve(path: str):
    return functools.reduce(getattr, path.split("."), lm)


def _is_submodule(name: str) -> bool:
    return isinstance(getattr(lm, name, None), types.ModuleType)


def test_all_is_the_curated_list():
    assert len(lm.__all__) <= 30
    assert len(set(lm.__all__)) == len(lm.__all__)
    assert sorted(lm.__all__) == sorted(PUBLIC)


def test_every_public_name_resolves():
    for name in lm.__all__:
        assert getattr(lm, name) is not None, name
    namespace: dict = {}
    exec("from lowmem_jax import *", namespace)
    assert set(lm.__all__) <= set(namespace)


def test_moved_names_stay_reachable_through_their_submodule():
    for path in MOVED:
        _resolve(path)
        assert path.split(".")[-1] not in lm.__all__, path


def test_readme_python_blocks_use_only_the_public_api():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    names = {n for b in blocks for n in re.findall(r"(?<![\w.])lm\.(\w+)", b)}
    assert names
    outside = sorted(n for n in names if n not in lm.__all__ and not _is_submodule(n))
    assert not outside, f"README uses lm.{outside}: add them to __all__ or use the submodule"


def test_every_lm_path_in_the_docs_resolves():
    for doc in DOCS:
        text = doc.read_text()
        for path in sorted(set(re.findall(r"(?<![\w.])lm((?:\.\w+)+)", text))):
            path = path[1:]
            head = path.split(".")[0]
            assert head in lm.__all__ or _is_submodule(head), f"{doc.name}: lm.{path}"
            try:
                _resolve(path)
            except AttributeError as error:
                raise AssertionError(f"{doc.name}: lm.{path} does not resolve") from error


#: Names of the flat layout (a88204e) that are gone, replaced: the activations' and the
#: pipeline's context variables by per-block hooks (lowmem_jax.blocks.hooks).
REPLACED = {"active_spec", "active", "pipelining"}


def test_every_module_path_of_the_flat_layout_still_resolves_with_a_warning():
    """Each module of the flat layout (``tests/data/flat_layout_names.json``: its public names
    at a88204e) imports by its old path for one release, warning with its new home, and gives
    the same objects as the new home (one module, not a copy)."""
    import importlib
    import json
    import sys
    import warnings

    old = json.loads((ROOT / "tests" / "data" / "flat_layout_names.json").read_text())
    for path, names in old.items():
        kept = path.count(".") == 1 and path.split(".")[1] in vars(lm)  # lm.verdicts, lm.sparsity
        if type(sys.modules.get(path)).__name__ == "_Alias" and not kept:  # imported before
            del sys.modules[path]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(path)
        missing = [n for n in names if n not in REPLACED and not hasattr(module, n)]
        assert not missing, (path, missing)
        if isinstance(module, types.ModuleType) and type(module).__name__ == "_Alias":
            assert kept or any(issubclass(w.category, DeprecationWarning) for w in caught), path
    from lowmem_jax.remat import parse_policy
    from lowmem_jax.sparsity.transform import SparseTraining

    assert parse_policy is lm.techniques.remat.parse_policy
    assert SparseTraining is lm.techniques.sparsity.SparseTraining
    assert lm.loss_scale.all_finite is lm.core.finite.all_finite
    assert callable(lm.verdicts) and lm.sparsity is lm.techniques.sparsity  # names kept
