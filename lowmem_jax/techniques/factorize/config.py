"""What factorization does: :class:`FactorConfig`, and each layer's ranks from it.

Ranks by target compression (``rank_rule="compression"``, the default): a factorized layer keeps
at most the fraction ``c`` of its dense kernel's parameters. For a kernel ``[KH, KW, S, T]``
(``k2 = KH * KW``; a dense layer is ``k2 = 1``):

* ``lowrank`` (and every 1x1 convolution or dense layer): ``R (k2 S + T) <= c k2 S T``;
* ``tucker``: ``R1 S + k2 R1 R2 + R2 T <= c k2 S T`` with ``R2 / R1 = T / S`` (ranks in
  proportion to the channels, as the VBMF ranks of Kim et al. tend to be);
* ``cp``: ``R (S + KH + KW + T) <= c k2 S T`` (the rank may exceed ``S`` and ``T``).

Ranks are at least 1 and at most what the decomposition can use (``min(k2 S, T)`` for
``lowrank``, ``S`` and ``T`` for Tucker-2).

Ranks from trained weights (``rank_rule="energy"`` or ``"vbmf"``, Kim et al. 2016) are chosen
by :func:`lowmem_jax.techniques.factorize.select_ranks`, which fills the config's ``ranks`` table.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "FactorConfig",
    "METHODS",
    "FACTOR_HIDDEN",
    "compression_ranks",
    "layer_method",
]

METHODS = ("cp", "tucker", "lowrank")
RANK_RULES = ("compression", "energy", "vbmf")

#: ``checkpoint_name`` of a factorized layer's inner outputs (remat ``save:factor_hidden``).
FACTOR_HIDDEN = "factor_hidden"


def layer_method(method: str, kernel_shape: tuple[int, ...]) -> str:
    """The decomposition a layer of ``kernel_shape`` gets: ``method`` for a ``KH x KW > 1``
    convolution, ``lowrank`` for dense layers and 1x1 convolutions (a matrix either way)."""
    if len(kernel_shape) == 4 and kernel_shape[0] * kernel_shape[1] > 1:
        return method
    return "lowrank"


@dataclasses.dataclass(frozen=True)
class FactorConfig:
    """Which layers are factorized, how, and at what ranks. All fields are static.

    Attributes:
      method: ``cp`` (Lebedev et al. 2015: 1x1, KH x 1 and 1 x KW depthwise, 1x1), ``tucker``
        (Kim et al. 2016, Tucker-2: 1x1, KH x KW core, 1x1) or ``lowrank`` (KH x KW to R
        channels, 1x1) for convolutions; dense layers and 1x1 convolutions are always low-rank.
      compression: the fraction of a layer's parameters its factors keep, in ``(0, 1]``.
      hooi_iterations: Tucker-2 refinement sweeps after the HOSVD (0: HOSVD only).
      cp_iterations, cp_tolerance: the ALS sweeps at most, and the change in relative error that
        stops them.
      keep_first_last: the first and last layers stay dense (the WRN's stem and classifier; the
        Transformer's embeddings and output projection are never factorized; on any other model,
        :func:`~lowmem_jax.techniques.factorize.factorize_module`'s rule).
      layers: regular expressions; a model without a ``factorize`` field (any Linen or NNX
        model, :func:`~lowmem_jax.techniques.factorize.factorize_module`) factorizes only the layers
        whose path (``"block/Dense_0"``, ``"blocks/0/conv"``) one of them matches
        (``re.search``); ``()``: every layer it can.
      rank_rule: ``compression`` (ranks from ``compression``), or ranks chosen from a trained
        dense model's weights (decompose-and-fine-tune only): ``energy`` (the least rank that
        keeps ``energy`` of the squared singular values of each unfolding) or ``vbmf`` (Kim et
        al.: empirical VBMF on each unfolding); :mod:`lowmem_jax.techniques.factorize.ranks`. Not
        for ``cp`` (no closed-form CP rank).
      energy: the retained fraction for ``rank_rule="energy"``, in ``(0, 1]``.
      ranks: ``((layer name, dense kernel shape, ranks), ...)``: the ranks of the layers it
        lists, over any rule; filled by ``select_ranks`` (a scanned stack's layers share one
        entry: its name and shape).
    """

    method: str = "tucker"
    compression: float = 0.25
    hooi_iterations: int = 0
    cp_iterations: int = 50
    cp_tolerance: float = 1e-6
    keep_first_last: bool = True
    rank_rule: str = "compression"
    energy: float = 0.9
    ranks: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    layers: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"Unknown factorize method={self.method!r}; allowed values: {METHODS}")
        if not 0.0 < self.compression <= 1.0:
            raise ValueError(f"compression must be in (0, 1], got {self.compression}")
        for name in ("hooi_iterations", "cp_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.cp_tolerance >= 0.0:
            raise ValueError(f"cp_tolerance must be >= 0, got {self.cp_tolerance}")
        if self.rank_rule not in RANK_RULES:
            raise ValueError(f"Unknown rank_rule={self.rank_rule!r}; allowed values: {RANK_RULES}")
        if self.rank_rule != "compression" and self.method == "cp":
            raise ValueError(
                f"rank_rule={self.rank_rule!r} chooses Tucker-2 or low-rank ranks; "
                "method='cp' takes its ranks from compression"
            )
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        # Hashable (a Flax module field): lists from JSON become tuples.
        ranks = tuple((str(n), tuple(map(int, s)), tuple(map(int, r))) for n, s, r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        layers = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
        for pattern in layers:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"layers: {pattern!r} is not a regular expression ({err})"
                ) from None
        object.__setattr__(self, "layers", layers)

    def ranks_for(self, kernel_shape: tuple[int, ...], name: str | None = None) -> tuple[int, ...]:
        """The ranks of layer ``name`` with a dense kernel of ``kernel_shape``: ``(R1, R2)``
        for Tucker-2, ``(R,)`` otherwise; from the ``ranks`` table when it lists the layer, else
        by compression (:func:`compression_ranks`).

        Raises:
          ValueError: ``rank_rule`` is ``energy`` / ``vbmf`` and the table does not list the
            layer (its ranks come from trained weights: ``select_ranks`` first).
        """
        for entry_name, shape, ranks in self.ranks:
            if entry_name == name and shape == tuple(kernel_shape):
                return ranks
        if self.rank_rule != "compression":
            raise ValueError(
                f"rank_rule={self.rank_rule!r} takes ranks from a trained dense model, and none "
                f"were chosen for layer {name!r} {tuple(kernel_shape)}: decompose a checkpoint "
                "(lowmem train --decompose-from DIR, or factorization.select_ranks)"
            )
        return compression_ranks(self.method, kernel_shape, self.compression)

    def describe(self) -> dict:
        """The fields, JSON-able."""
        return dataclasses.asdict(self)


def compression_ranks(
    method: str, kernel_shape: tuple[int, ...], compression: float
) -> tuple[int, ...]:
    """Ranks that keep at most ``compression`` of a ``kernel_shape`` layer (module docstring)."""
    *spatial, s, t = kernel_shape
    k2 = math.prod(spatial)
    budget = compression * k2 * s * t
    method = layer_method(method, tuple(kernel_shape))
    if method == "lowrank":
        return (max(1, min(int(budget // (k2 * s + t)), k2 * s, t)),)
    if method == "cp":
        return (max(1, int(budget // (s + spatial[0] + spatial[1] + t))),)
    # Tucker-2, R2 = rho R1: k2 rho R1^2 + (S + rho T) R1 - budget = 0.
    rho = t / s
    a, b = k2 * rho, s + rho * t
    r1 = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
    r1 = max(1, min(r1, s))
    r2 = max(1, min(int(rho * r1), t))
    return (r1, r2)
