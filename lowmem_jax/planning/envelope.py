"""Accuracy envelopes: which technique settings a search may use (:data:`ENVELOPES`).

``report``: what the technical report (Sohoni et al. 2019) found safe for accuracy; ``any``:
every setting the library has. Each technique states its own limit in each envelope and why a
step is outside it (:attr:`lowmem_jax.core.technique.Technique.envelope`); an envelope is the
collection of those limits, checked in the registry's order:

========  =====================  ==========  ===========  ========  ==========  ======  =========
envelope  precisions             microbatch  activations  sparsity  opt. state  factor  gradients
========  =====================  ==========  ===========  ========  ==========  ======  =========
report    fp32, mixed fp16/bf16  >= 8        none         <= 70%    auto..int8  no      whole
any       all five               >= 1        all formats  < 100%    auto..int4  yes     any
========  =====================  ==========  ===========  ========  ==========  ======  =========

(The microbatch limit holds for a pipeline's microbatches too, whose BatchNorm statistics are
per microbatch as well. Compressed gradients, :mod:`lowmem_jax.techniques.shard.compression`, were
not in the report.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowmem_jax.techniques import TECHNIQUES

__all__ = ["Envelope", "ENVELOPES", "in_words"]


@dataclasses.dataclass(frozen=True)
class Envelope:
    """The settings a plan may use to stay inside an accuracy envelope.

    Attributes:
      name: the envelope's name.
      limits: ``{technique name: limit}`` for each technique with an envelope rule.
    """

    name: str
    limits: dict[str, Any]

    def limit(self, technique: str) -> Any:
        """The limit of the registered ``technique`` (e.g. ``"sparsity"``: its most sparsity)."""
        return self.limits[technique]

    def why_outside(self, config: dict[str, Any]) -> str | None:
        """Why a step's ``config`` (``Setup.config``: ``batch_size`` and :meth:`Plan.to_dict`)
        is outside, or ``None`` when inside; the plain step is inside."""
        if config.get("plain"):
            return None
        for technique in TECHNIQUES:
            if technique.envelope is not None:
                why = technique.envelope.outside(config, self.limits[technique.name])
                if why is not None:
                    return why
        return None

    def describe(self) -> dict[str, Any]:
        """``name`` and each limit under its rule's key (e.g. ``max_sparsity``)."""
        out: dict[str, Any] = {"name": self.name}
        for technique in TECHNIQUES:
            if technique.envelope is not None:
                out[technique.envelope.key] = self.limits[technique.name]
        return out


def in_words(limits: dict[str, Any]) -> str:
    """An envelope's limits (:meth:`Envelope.describe`, or the same read back from JSON) in a
    few words, each rule's (:attr:`EnvelopeRule.describe`) in the registry's order; a limit
    the dict lacks (an older report's) is left out."""
    words = (
        t.envelope.describe(limits[t.envelope.key])
        for t in TECHNIQUES
        if t.envelope is not None and t.envelope.key in limits
    )
    return ", ".join(w for w in words if w)


def _envelope(name: str) -> Envelope:
    rules = {t.name: t.envelope for t in TECHNIQUES if t.envelope is not None}
    return Envelope(name, {technique: rule.limits[name] for technique, rule in rules.items()})


ENVELOPES = {name: _envelope(name) for name in ("report", "any")}
