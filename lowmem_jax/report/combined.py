"""The memory report's combined rows: the settings of the technical report's study (Sohoni et
al. 2019) and of the headline, as data (``{plan field: value}``); each technique's rows alone
come from the registry (:attr:`lowmem_jax.core.technique_hooks.ReportHooks.rows`).
"""

from __future__ import annotations

import dataclasses

from lowmem_jax.core.report_hooks import GridContext, ReportRow
from lowmem_jax.techniques.factorize import FactorConfig
from lowmem_jax.techniques.sparsity import report_sparsity

__all__ = ["combined_rows"]

# (precision, examples per microbatch at most, remat): the report's least-memory combinations.
_STUDY = [
    ("mixed_fp16", 32, "full"),
    ("fp16", 32, "full"),
    ("fp16", 8, "full"),
    ("fp16", 4, "full"),
    ("bf16", 4, "full"),
    ("fp16", 2, "full"),
]


def combined_rows(context: GridContext) -> list[ReportRow]:
    """The rows that combine techniques: the optimizer-state formats with 90% sparsity, Tucker
    with full remat, the study's combinations, the in-envelope ones (microbatches of at least 8
    examples), ``lowmem plan``'s float32 answer for the IWSLT transformer and the least it
    compiled in the envelope at a smaller budget (and with its state in int8), and the least-memory
    ones at three sparsities (static masks at 70% and 90%, the 70% one with its state in int8 and
    int4, the 90% DSR one with int4). ``quick``: those the headline comes from (a row whose twin
    with ``uint8 input`` is in the grid leaves it to the twin: fewer bytes, the same compile)."""
    batch = context.batch_size
    uint8 = {"input_dtype": "uint8"} if context.images else None
    rows = [
        ReportRow(f"sparse 90% dsr + state {fmt}", "optimizer state",
                  {"optimizer_state": fmt, "sparsity": report_sparsity(0.9)},
                  section="sparse + state")
        for fmt in ("bf16", "int8", "int4")
    ]  # fmt: skip
    tucker = FactorConfig("tucker", 0.25)
    rows.append(ReportRow("factorize tucker 25% + remat full", "factorization",
                          {"remat": "full", "factorize": tucker},
                          section="factorize + remat"))  # fmt: skip

    def combined(name: str, fields: dict, quick: bool = False) -> None:
        rows.append(ReportRow(name, "combined", fields, quick, section="combined"))

    seen = set()
    for precision, target, remat in _STUDY:
        size = context.examples(target)
        if size and (precision, size) not in seen:
            seen.add((precision, size))
            fields = {"precision": precision, "microbatches": batch // size, "remat": remat}
            combined(f"{precision} + mb {size} + remat {remat}", fields)
    # Inside the report's envelope (lowmem_jax.planning.envelope): the smallest microbatch of at
    # least 8 examples, then with DSR 70%.
    size = min(d for d in range(8, batch + 1) if batch % d == 0) if batch > 8 else 0
    if 1 < size < batch:
        fields = {"precision": "mixed_fp16", "microbatches": batch // size, "remat": "full"}
        combined(f"mixed_fp16 + mb {size} + remat full", fields)
        fields = {**fields, "sparsity": report_sparsity(0.7)}
        name = f"mixed_fp16 + mb {size} + remat full + sparse 70%"
        combined(name, fields, quick=not uint8)
        if uint8:
            combined(f"{name} + uint8 input", {**fields, **uint8}, quick=True)
            # With its state in int8 (inside sparse training, updated a group at a time).
            name = f"mixed_fp16 + mb {size} + remat full + state int8 + sparse 70% + uint8 input"
            combined(name, {**fields, **uint8, "optimizer_state": "int8"}, quick=True)
        # Compression instead of recomputation: no second forward pass.
        fields = {**fields, "remat": "none", "activations": "int8"}
        combined(f"mixed_fp16 + mb {size} + act int8 + sparse 70%", fields)
        # What `lowmem plan` answers at 700 MiB for the IWSLT transformer: float32, remat dots.
        fields = {"microbatches": batch // size, "remat": "dots", "optimizer_state": "bf16",
                  "sparsity": report_sparsity(0.7)}  # fmt: skip
        combined(f"mb {size} + remat dots + state bf16 + sparse 70%", fields, quick=not uint8)
        # The least `lowmem plan` compiled in the envelope at 413 MiB when none fit (24436b6).
        fields = {**fields, "precision": "mixed_fp16", "remat": "sqrt"}
        combined(f"mixed_fp16 + mb {size} + remat sqrt + state bf16 + sparse 70%", fields)
        name = f"mixed_fp16 + mb {size} + remat sqrt + state int8 + sparse 70%"
        combined(name, {**fields, "optimizer_state": "int8"}, quick=not uint8)
    size = context.examples(2)
    if size:  # the least-memory combination, at three sparsities
        for sparsity in (0.7, 0.8, 0.9):
            fields = {"precision": "fp16", "microbatches": batch // size, "remat": "full",
                      "sparsity": report_sparsity(sparsity)}  # fmt: skip
            name = f"fp16 + mb {size} + remat full + sparse {sparsity:.0%}"
            combined(name, fields, quick=sparsity == 0.9 and not uint8)
            if sparsity in (0.7, 0.9):  # the mask fixed at initialisation: no rewiring
                static = {
                    **fields,
                    "sparsity": dataclasses.replace(fields["sparsity"], algorithm="static"),
                }
                name = f"fp16 + mb {size} + remat full + static sparse {sparsity:.0%}"
                combined(name, static, quick=sparsity == 0.7 and not uint8)
                for fmt in ("int8", "int4") if sparsity == 0.7 else ():  # within -1 BLEU
                    combined(f"{name} + state {fmt}", {**static, "optimizer_state": fmt},
                             quick=fmt == "int4" and not uint8)  # fmt: skip
        name = f"fp16 + mb {size} + remat full + sparse 90%"
        if uint8:
            combined(f"{name} + uint8 input", {**fields, **uint8}, quick=True)
        # The transformer's least-memory row (its pure fp16 parameters are cast to float32
        # one group of leaves at a time).
        combined(f"{name} + state int4", {**fields, "optimizer_state": "int4"}, quick=not uint8)
    return rows
