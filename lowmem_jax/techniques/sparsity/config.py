"""Sparse-training configuration: algorithm, densities, schedule; validated on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

from lowmem_jax.techniques.sparsity.storage import COMPRESSED, MASKED, Storage

__all__ = [
    "SparseConfig",
    "ALGORITHMS",
    "DISTRIBUTIONS",
    "INITS",
    "REALLOCATING",
    "REGROW_POOLS",
    "default_is_sparse",
]

#: ``static``: the initial mask never changes; the others rewire during training.
ALGORITHMS = ("static", "set", "rigl", "snfs", "dsr")
#: Per-layer densities: the same everywhere, or Erdos-Renyi-Kernel (Evci et al. 2020).
DISTRIBUTIONS = ("uniform", "erk")
#: How the initial mask is chosen (``snip`` needs a gradient, see ``SparseTraining.store``).
INITS = ("random", "magnitude", "snip")
#: Where regrowth may land (``SparseConfig.regrow_pool``).
REGROW_POOLS = ("auto", "not_kept", "zeros_first")
#: Algorithms whose per-layer non-zero counts change (need capacity headroom when compressed).
REALLOCATING = ("snfs", "dsr")
# DSR's N_p as a fraction of the sparse weights: 20,000 of WRN-28-2's 1,462,704 conv weights.
DSR_PRUNED_FRACTION = 20_000 / 1_462_704


def default_is_sparse(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Conv and dense kernels (leaves named ``kernel`` with ndim >= 2) outside ``classifier``.

    Biases, BatchNorm scales/offsets and the final layer (the WRN's ``classifier``) stay dense,
    as in the DSR WideResNet runs.
    """
    return bool(path) and path[-1] == "kernel" and len(shape) >= 2 and "classifier" not in path


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """What sparse training does. All fields are static (Python values).

    Attributes:
      algorithm: one of :data:`ALGORITHMS`.
      density: overall fraction of non-zeros kept among the sparse leaves, in ``(0, 1]``.
      distribution: per-layer densities, ``uniform`` or ``erk`` (:data:`DISTRIBUTIONS`).
      init: initial mask, ``random`` / ``magnitude`` / ``snip`` (:data:`INITS`); SNIP keeps the
        global top ``density`` fraction of ``|w * grad|`` (so its per-layer counts ignore
        ``distribution``).
      update_period, start_step, end_step: rewire after applied optimizer step ``t`` (1-based,
        skipped steps do not count) iff ``t % period(t) == 0`` and
        ``start_step <= t <= end_step`` (``end_step=None``: never stop). ``update_period`` is
        an int, or ``((0, p0), (t1, p1), ...)``: period ``p_i`` from step ``t_i`` on (DSR's
        100 -> 200 -> 400 -> 800 schedule).
      drop_fraction: fraction of each layer's active weights replaced per update (SET, RigL,
        SNFS's prune rate), cosine-annealed to 0 at ``end_step`` when ``anneal`` is ``cosine``.
      anneal: ``cosine`` or ``constant``.
      dsr_threshold: DSR's initial global magnitude threshold ``H``.
      dsr_target_pruned: DSR's ``N_p``, the number of weights it aims to prune per update;
        ``None`` (default): :data:`DSR_PRUNED_FRACTION` of the sparse leaves' weights, which is
        the report's 20,000 for WRN-28-2 and scales it to other models (a fixed 20,000 prunes
        most of a small model's non-zeros at every update).
      compressed: store sparse leaves as values ``[capacity]`` + int32 indices (see the package
        docstring) instead of masked dense tensors.
      capacity_factor: compressed storage per layer is ``min(size, ceil(factor * budget))``;
        ``None``: 1.0 for algorithms with fixed per-layer counts, 1.25 for :data:`REALLOCATING`
        ones and SNIP.
      seed: seeds the initial mask and every random regrowth (``fold_in(seed, step)``).
      is_sparse: ``is_sparse(path_names, shape) -> bool`` picks the sparse leaves
        (default :func:`default_is_sparse`).
      erk_power: exponent of the ERK scale ``(sum(dims) / prod(dims)) ** erk_power``.
      regrow_pool: where regrowth may land (:data:`REGROW_POOLS`). ``not_kept``: every position
        the prune did not keep, the just-pruned ones included (a just-pruned weight regrown
        restarts at 0): Evci et al. 2020's Algorithm 1 and the official RigL code, whose SET
        does the same. ``zeros_first``: positions that were zero before the update first, the
        just-pruned ones only in a layer without enough of them (this library's rule before;
        a departure from RigL and SET as published). ``auto`` (default): ``not_kept`` for
        RigL, SET and SNFS, ``zeros_first`` for DSR (the rule its committed study runs used;
        DSR's paper regrows at zero-valued positions without saying whether just-pruned ones
        count).
    """

    algorithm: str = "rigl"
    density: float = 0.1
    distribution: str = "erk"
    init: str = "random"
    update_period: int | tuple[tuple[int, int], ...] = 100
    start_step: int = 0
    end_step: int | None = None
    drop_fraction: float = 0.3
    anneal: str = "cosine"
    dsr_threshold: float = 1e-3
    dsr_target_pruned: int | None = None
    compressed: bool = False
    capacity_factor: float | None = None
    seed: int = 0
    is_sparse: Callable[[tuple[str, ...], tuple[int, ...]], bool] = default_is_sparse
    erk_power: float = 1.0
    regrow_pool: str = "auto"

    def __post_init__(self):
        _one_of("algorithm", self.algorithm, ALGORITHMS)
        _one_of("distribution", self.distribution, DISTRIBUTIONS)
        _one_of("init", self.init, INITS)
        _one_of("anneal", self.anneal, ("cosine", "constant"))
        _one_of("regrow_pool", self.regrow_pool, REGROW_POOLS)
        if not (isinstance(self.density, (int, float)) and 0.0 < self.density <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if not 0.0 <= self.drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {self.drop_fraction!r}")
        if not self.periods or any(p < 1 for _, p in self.periods):
            raise ValueError(
                "update_period must be an integer >= 1 or ((0, p0), (t1, p1), ...) with "
                f"increasing t_i and every p_i >= 1, got {self.update_period!r}"
            )
        if int(self.start_step) < 0:
            raise ValueError(f"start_step must be >= 0, got {self.start_step}")
        if self.end_step is not None and int(self.end_step) < int(self.start_step):
            raise ValueError(
                f"end_step must be None or >= start_step={self.start_step}, got {self.end_step}"
            )
        if not (self.dsr_threshold > 0 and math.isfinite(self.dsr_threshold)):
            raise ValueError(f"dsr_threshold must be > 0, got {self.dsr_threshold}")
        if self.dsr_target_pruned is not None and int(self.dsr_target_pruned) < 1:
            raise ValueError(f"dsr_target_pruned must be >= 1, got {self.dsr_target_pruned}")
        if self.capacity_factor is not None and not self.capacity_factor >= 1.0:
            raise ValueError(f"capacity_factor must be None or >= 1, got {self.capacity_factor}")

    @property
    def periods(self) -> tuple[tuple[int, int], ...]:
        """``update_period`` as ``((0, p0), (t1, p1), ...)``; ``()`` if malformed."""
        if isinstance(self.update_period, numbers.Integral):
            return ((0, int(self.update_period)),)
        try:
            pairs = tuple((int(t), int(p)) for t, p in self.update_period)
        except (TypeError, ValueError):
            return ()
        starts = [t for t, _ in pairs]
        if not pairs or starts[0] != 0 or starts != sorted(set(starts)):
            return ()
        return pairs

    @property
    def dynamic(self) -> bool:
        """Whether masks change during training."""
        return self.algorithm != "static"

    @property
    def resolved_regrow_pool(self) -> str:
        """``regrow_pool`` with ``auto`` resolved for this algorithm (see the attribute)."""
        if self.regrow_pool != "auto":
            return self.regrow_pool
        return "zeros_first" if self.algorithm == "dsr" else "not_kept"

    @property
    def storage(self) -> Storage:
        """How sparse leaves are stored (:mod:`.storage`): compressed or masked."""
        return COMPRESSED if self.compressed else MASKED

    def describe(self) -> dict[str, Any]:
        """A short JSON-able description: algorithm, sparsity, distribution, storage."""
        return {
            "algorithm": self.algorithm,
            "sparsity": 1.0 - self.density,
            "distribution": self.distribution,
            "storage": self.storage.name,
        }

    @property
    def capacity(self) -> float:
        """The capacity factor in effect (see ``capacity_factor``)."""
        if self.capacity_factor is not None:
            return float(self.capacity_factor)
        if self.algorithm in REALLOCATING or self.init == "snip":
            return 1.25
        return 1.0


def report_sparsity(sparsity: float) -> SparseConfig:
    """The report's sparse training at ``sparsity`` (a fraction of zeros): DSR, uniform
    densities, compressed storage (values + indices)."""
    return SparseConfig(algorithm="dsr", density=1.0 - sparsity, distribution="uniform",
                        compressed=True)  # fmt: skip


def _one_of(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Unknown {name}={value!r}; allowed values: {list(allowed)}")
