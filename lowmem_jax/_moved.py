"""The import paths from before the package had folders: each moved module stays importable by
its old name (``lowmem_jax.remat``, ``lm.loss_scale``, ...) for one release, as an alias of its
new home that warns once (``DeprecationWarning``) naming it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

#: Old module (under ``lowmem_jax.``) -> its new home.
MOVED = {
    "base": "core.base",
    "technique": "core.technique",
    "technique_report": "core.report_hooks",
    "jaxprs": "core.jaxprs",
    "linen_wrap": "core.linen_wrap",
    "paths": "core.paths",
    "sharding": "core.mesh",
    "scanned_blocks": "blocks.scanned",
    "lazy_layers": "blocks.lazy_layers",
    "remat": "techniques.remat",
    "quantization": "codecs.quantization",
    "optimizer_state_format": "codecs.state_format",
    "activation_formats": "codecs.activation_formats",
    "leafwise": "codecs.leafwise",
    "precision": "techniques.precision",
    "loss_scale": "techniques.loss_scale",
    "microbatch": "techniques.microbatches",
    "remat_schedule": "techniques.remat.schedule",
    "activation_compression": "techniques.activations",
    "activation_loops": "techniques.activations.loops",
    "optimizer_state": "techniques.optimizer_state",
    "host_update": "techniques.shard.offload",
    "grad_compression": "techniques.shard.compression",
    "sharding_report": "techniques.shard.report_section",
    "pipeline": "techniques.pipeline",
    "factorization": "techniques.factorize",
    "plan": "compose.plan",
    "train": "compose.step",
    "plan_flags": "compose.flags",
    "nnx_split": "compose.nnx_split",
    "memory": "analysis.memory",
    "memory_analytic": "analysis.analytic",
    "flops": "analysis.flops",
    "collectives": "analysis.collectives",
    "inspector": "analysis.inspector",
    "xla_dumps": "analysis.xla_dumps",
    "verdicts": "analysis.verdicts",
    "step_timing": "analysis.timing",
    "setup": "workloads.setup",
    "custom": "workloads.custom",
    "recipes": "workloads.recipes",
    "losses": "workloads.losses",
    "planner": "planning.planner",
    "plan_space": "planning.space",
    "plan_search": "planning.search",
    "plan_descent": "planning.descent",
    "envelope": "planning.envelope",
    "plan_plot": "planning.plot",
    "report_grid": "report.grid",
    "report_combined": "report.combined",
    "report_plot": "report.plot",
    "loop": "training.loop",
    "loop_config": "training.config",
    "tasks": "training.tasks",
    "checkpointing": "training.checkpointing",
    "checkpoint_averaging": "training.averaging",
    "run_identity": "training.run_identity",
    "metrics_writer": "training.metrics_writer",
    "skip_guard": "training.skip_guard",
    "cli_analyze": "cli.analyze",
    "cli_inspect": "cli.inspect",
    "cli_train": "cli.train",
}


def new_home(old: str) -> str | None:
    """``"sparsity.transform"`` -> ``"techniques.sparsity.transform"`` (under ``lowmem_jax.``):
    the new path of an old one, or ``None`` where the name did not move."""
    head, _, rest = old.partition(".")
    if head == "sparsity" and rest:  # lm.sparsity itself is a curated alias (not deprecated)
        return f"techniques.sparsity.{rest}"
    if head not in MOVED:
        return None
    return MOVED[head] + (f".{rest}" if rest else "")


class _Alias(types.ModuleType):
    """An old module name whose attributes are its new home's."""

    __path__: list[str] = []  # submodules of an old package resolve through the finder too

    def __init__(self, name: str, target: str):
        super().__init__(name)
        self._target = target

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._target), attr)

    def __dir__(self):
        return dir(importlib.import_module(self._target))


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {self.target}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return _Alias(spec.name, self.target)

    def exec_module(self, module) -> None:
        importlib.import_module(self.target)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``lowmem_jax.<old>`` after every other finder failed (it is last on the path)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("lowmem_jax."):
            return None
        new = new_home(fullname[len("lowmem_jax.") :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(f"lowmem_jax.{new}"))


def install() -> None:
    """Puts the finder last on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def module_getattr(name: str):
    """``lm.<old>``: the old module's alias (the package's ``__getattr__``)."""
    if name in MOVED:
        return importlib.import_module(f"lowmem_jax.{name}")
    raise AttributeError(f"module 'lowmem_jax' has no attribute {name!r}")
