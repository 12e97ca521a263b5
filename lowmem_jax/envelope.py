"""Accuracy envelopes: which technique settings a search may use (:data:`ENVELOPES`).

``report``: what the technical report (Sohoni et al. 2019) found safe for accuracy: float32
master weights (``fp32``, ``mixed_fp16``, ``mixed_bf16``), microbatches of at least 8 examples
(BatchNorm statistics per microbatch; applied to every model, which is conservative for those
without BatchNorm), at most 70% sparsity, optimizer state in 8 bits or more. It did not study
factorized layers, so they are outside. ``any``: every setting the library has.

=========  ===============================  ==============  ========  ===============  ==========
envelope   precisions                       microbatch >=   sparsity  optimizer state  factorize
=========  ===============================  ==============  ========  ===============  ==========
report     fp32, mixed_fp16, mixed_bf16     8 examples      <= 70%    auto..int8       no
any        all five                         1 example       < 100%    auto..int4       yes
=========  ===============================  ==============  ========  ===============  ==========
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowmem_jax import optimizer_state as optimizer_state_lib
from lowmem_jax import precision as precision_lib
from lowmem_jax.sparsity import SparseConfig

__all__ = ["Envelope", "ENVELOPES", "report_sparsity"]


def report_sparsity(sparsity: float) -> SparseConfig:
    """The report's sparse training at ``sparsity``: DSR, uniform densities, compressed storage
    (values + indices)."""
    return SparseConfig(algorithm="dsr", density=1.0 - sparsity, distribution="uniform",
                        compressed=True)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Envelope:
    """The settings a plan may use to stay inside an accuracy envelope."""

    name: str
    precisions: tuple[str, ...]
    min_microbatch_examples: int
    max_sparsity: float
    optimizer_states: tuple[str, ...]
    factorize: bool

    def why_outside(self, config: dict[str, Any]) -> str | None:
        """Why a step's ``config`` (``Setup.config``: ``batch_size`` and :meth:`Plan.to_dict`)
        is outside, or ``None`` when inside; the plain step is inside."""
        if config.get("plain"):
            return None
        if config.get("factorize") and not self.factorize:
            return "factorized layers"
        if config["precision"] not in self.precisions:
            return f"precision {config['precision']}"
        examples = config["batch_size"] // config["microbatches"]
        if config["microbatches"] > 1 and examples < self.min_microbatch_examples:
            return f"microbatches of {examples} examples (< {self.min_microbatch_examples})"
        sparsity = (config.get("sparsity") or {}).get("sparsity", 0.0)
        if sparsity > self.max_sparsity + 1e-9:
            return f"sparsity {sparsity:.0%} (> {self.max_sparsity:.0%})"
        if config.get("optimizer_state", "auto") not in self.optimizer_states:
            return f"optimizer state {config['optimizer_state']}"
        return None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ENVELOPES = {
    "report": Envelope(
        name="report",
        precisions=("fp32", "mixed_fp16", "mixed_bf16"),
        min_microbatch_examples=8,
        max_sparsity=0.7,
        optimizer_states=("auto", "fp32", "bf16", "int8"),
        factorize=False,
    ),
    "any": Envelope(
        name="any",
        precisions=tuple(sorted(precision_lib.POLICIES)),
        min_microbatch_examples=1,
        max_sparsity=0.99,
        optimizer_states=optimizer_state_lib.FORMATS,
        factorize=True,
    ),
}
