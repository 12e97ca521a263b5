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

#: Old module (under ``lowmem_jax.``) -> its new home (or homes, searched in order, where its
#: names went to more than one).
MOVED: dict[str, str | tuple[str, ...]] = {
    "base": "core.base",
    "technique": ("core.technique", "core.technique_hooks"),
    "technique_report": "core.report_hooks",
    "jaxprs": "core.jaxprs",
    "linen_wrap": "core.linen_wrap",
    "paths": "core.paths",
    "sharding": ("core.mesh", "techniques.shard"),
    "scanned_blocks": ("blocks.scanned", "techniques.weight_memory"),
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
    "sparsity": "techniques.sparsity",
    "sparsity.state": ("techniques.sparsity.state", "techniques.sparsity.transform"),
    "activation_loops": "techniques.activations.loops",
    "optimizer_state": "techniques.optimizer_state",
    "host_update": "techniques.shard.offload",
    "grad_compression": "techniques.shard.compression",
    "sharding_report": "techniques.shard.report_section",
    "pipeline": "techniques.pipeline",
    "factorization": "techniques.factorize",
    "plan": "compose.plan",
    "train": "compose.step",
    "plan_flags": ("compose.flags", "workloads.flags", "core.units"),
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


def new_home(old: str) -> tuple[str, ...] | None:
    """``"sparsity.transform"`` -> ``("techniques.sparsity.transform",)`` (under
    ``lowmem_jax.``): the new homes of an old path, or ``None`` where the name did not move."""
    head, _, rest = old.partition(".")
    if old in MOVED:  # a module whose names went to two of its package's modules
        head, rest = old, ""
    if head not in MOVED:
        return None
    homes = (MOVED[head],) if isinstance(MOVED[head], str) else MOVED[head]
    return tuple(f"{home}.{rest}" if rest else home for home in homes)


class _Alias(types.ModuleType):
    """An old module name whose attributes are its new homes'."""

    __path__: list[str] = []  # submodules of an old package resolve through the finder too

    def __init__(self, name: str, targets: tuple[str, ...]):
        super().__init__(name)
        self._targets = targets

    def __getattr__(self, attr: str):
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"{self.__name__} (now {', '.join(self._targets)}) has no {attr!r}")

    def __dir__(self):
        return sorted({n for t in self._targets for n in dir(importlib.import_module(t))})


class _Loader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]):
        self.targets = targets

    def create_module(self, spec):
        if spec.name != "lowmem_jax.sparsity":  # lm.sparsity is the curated short name
            warnings.warn(
                f"{spec.name} moved to {' and '.join(self.targets)}; the old path goes in the "
                "next release",
                DeprecationWarning,
                stacklevel=2,
            )
        return _Alias(spec.name, self.targets)

    def exec_module(self, module) -> None:
        for target in self.targets:
            importlib.import_module(target)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``lowmem_jax.<old>`` after every other finder failed (it is last on the path)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("lowmem_jax."):
            return None
        new = new_home(fullname[len("lowmem_jax.") :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(tuple(f"lowmem_jax.{home}" for home in new))
        )


def install() -> None:
    """Puts the finder last on ``sys.meta_path`` (once). An old module whose name is a public
    name of the package too (``verdicts`` the function, ``sparsity`` the curated short name) is
    registered now: imported later through the finder, the import would rebind the package's
    name to the module."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    package = sys.modules["lowmem_jax"]
    for name in MOVED:
        if "." not in name and name in vars(package):
            homes = new_home(name)
            sys.modules.setdefault(
                f"lowmem_jax.{name}",
                _Alias(f"lowmem_jax.{name}", tuple(f"lowmem_jax.{h}" for h in homes)),
            )


def module_getattr(name: str):
    """``lm.<old>``: the old module's alias (the package's ``__getattr__``)."""
    if name in MOVED and "." not in name:
        return importlib.import_module(f"lowmem_jax.{name}")
    raise AttributeError(f"module 'lowmem_jax' has no attribute {name!r}")
