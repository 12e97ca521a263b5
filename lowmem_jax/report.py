"""``lowmem report``: where training memory goes, and what each technique does to it (RQ1).

Runs the compile-only memory analysis (:func:`lowmem_jax.workloads.analyze_model`) over a grid
of configurations: the plain Flax/Optax step, our step with no technique (``baseline``), each
technique alone at several settings, then combinations. Memory reductions are quoted against
``plain`` (what a user would otherwise run) and against ``baseline``; FLOPs against ``baseline``
(the same convolution implementation, so the jaxpr counts compare).
Writes ``report.json``, ``report.md`` and two plots: the model / optimizer / activation breakdown
per configuration (the report's breakdown figure) and memory reduction against FLOPs overhead
(the trade-off figure). Every figure names its source: ``analytic`` or ``XLA:<BACKEND>``.

With ``shard_devices`` (``lowmem report --shard-devices``) the report also has a sharding
section (:mod:`lowmem_jax.report_sharding`): XLA's per-device figures of the baseline plan under
each ZeRO stage for each device count, next to the one-device step, and a plot of them
(``sharding.png``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from lowmem_jax.envelope import ENVELOPES
from lowmem_jax.factorization import FactorConfig
from lowmem_jax.plan import Plan
from lowmem_jax.plan_flags import analyze_argv
from lowmem_jax.remat import CONV_OUT, DOT_OUT
from lowmem_jax.report_plot import plot_report
from lowmem_jax.report_sharding import (
    check_shard_devices,
    sharding_markdown,
    sharding_rows,
)
from lowmem_jax.sparsity import report_sparsity
from lowmem_jax.workloads import analyze_model

__all__ = [
    "ENVELOPE",
    "in_envelope",
    "standard_grid",
    "model_grid",
    "run_report",
    "write_report",
    "to_markdown",
    "summary_table",
]

MIB = 2.0**20
# Sohoni et al. 2019, best combined reduction (analytic)
PUBLISHED = {"wrn-28-2": 60.7, "dynamicconv-iwslt": 8.7}


# (name, group, plan); plan None is the plain step (lowmem_jax.workloads.build_plain).
GridRow = tuple[str, str, Plan | None]

#: The technical report's accuracy envelope (:data:`lowmem_jax.envelope.ENVELOPES`).
ENVELOPE = ENVELOPES["report"]


def divisor_at_most(batch_size: int, target: float) -> int:
    """The largest divisor of ``batch_size`` that is <= ``target`` (at least 1)."""
    return max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= max(target, 1))


def standard_grid(
    batch_size: int, saved_name: str = CONV_OUT, *, images: bool = True
) -> list[GridRow]:
    """``(name, group, plan)`` for ``plain`` (plan ``None``), the baseline, single techniques
    and combinations.

    Microbatch sizes are 64, 32, ..., 2 examples for a power-of-two batch; for another batch each
    becomes the largest divisor of ``batch_size`` below it (100: 50, 25, 10, 5, 2), so every
    row splits the batch evenly. ``saved_name``: the ``checkpoint_name`` the ``save:`` remat row
    keeps (``conv_out`` in the WideResNet, ``dot_out`` in the DynamicConv Transformer).
    ``images``: the batch holds images, so the ``uint8 input`` rows apply (``input_dtype``).
    """

    def micro(target: int) -> int:
        return divisor_at_most(batch_size, target)

    grid: list[GridRow] = [("plain", "plain", None), ("baseline", "baseline", Plan())]
    for precision in ("mixed_bf16", "mixed_fp16", "bf16", "fp16"):
        grid.append((precision, "precision", Plan(precision=precision)))
    sizes = sorted({micro(t) for t in (64, 32, 16, 8, 4, 2) if 1 < micro(t) < batch_size},
                   reverse=True)  # fmt: skip
    for size in sizes:
        grid.append((f"microbatch {size}", "microbatching", Plan(microbatches=batch_size // size)))
    for remat in ("dots", f"save:{saved_name}", "full", "every:2", "sqrt"):
        grid.append((f"remat {remat}", "remat", Plan(remat=remat)))
    for sparsity in (0.5, 0.7, 0.9):
        grid.append(
            (f"sparse {sparsity:.0%} dsr", "sparsity", Plan(sparsity=report_sparsity(sparsity)))
        )
    for fmt in ("bf16", "int8", "int4"):
        grid.append((f"state {fmt}", "optimizer state", Plan(optimizer_state=fmt)))
    uint8 = {"input_dtype": "uint8"} if images else None
    if uint8:
        grid.append(("uint8 input", "input", Plan(**uint8)))
    for fmt in ("bf16", "int8", "int4"):
        plan = Plan(optimizer_state=fmt, sparsity=report_sparsity(0.9))
        grid.append((f"sparse 90% dsr + state {fmt}", "optimizer state", plan))
    tucker = FactorConfig("tucker", 0.25)
    grid.append(("factorize tucker 25%", "factorization", Plan(factorize=tucker)))
    plan = Plan(remat="full", factorize=tucker)
    grid.append(("factorize tucker 25% + remat full", "factorization", plan))
    combos = [
        ("mixed_fp16", 32, "full"),
        ("fp16", 32, "full"),
        ("fp16", 8, "full"),
        ("fp16", 4, "full"),
        ("bf16", 4, "full"),
        ("fp16", 2, "full"),
    ]
    seen = set()
    for precision, target, remat in combos:
        size = micro(target)
        if 1 < size < batch_size and (precision, size) not in seen:
            seen.add((precision, size))
            plan = Plan(precision=precision, microbatches=batch_size // size, remat=remat)
            grid.append((f"{precision} + mb {size} + remat {remat}", "combined", plan))
    # Inside ENVELOPE: the smallest microbatch of at least 8 examples, then with DSR 70%.
    size = min(d for d in range(8, batch_size + 1) if batch_size % d == 0) if batch_size > 8 else 0
    if 1 < size < batch_size:
        plan = Plan(precision="mixed_fp16", microbatches=batch_size // size, remat="full")
        grid.append((f"mixed_fp16 + mb {size} + remat full", "combined", plan))
        plan = dataclasses.replace(plan, sparsity=report_sparsity(0.7))
        name = f"mixed_fp16 + mb {size} + remat full + sparse 70%"
        grid.append((name, "combined", plan))
        if uint8:
            grid.append((f"{name} + uint8 input", "combined", dataclasses.replace(plan, **uint8)))
        # What `lowmem plan` answers at 700 MiB for the IWSLT transformer: float32, remat dots.
        plan = Plan(microbatches=batch_size // size, remat="dots", optimizer_state="bf16",
                    sparsity=report_sparsity(0.7))  # fmt: skip
        name = f"mb {size} + remat dots + state bf16 + sparse 70%"
        grid.append((name, "combined", plan))
    size = micro(2)
    if 1 < size < batch_size:  # the least-memory combination, at three sparsities
        for sparsity in (0.7, 0.8, 0.9):
            plan = Plan(
                precision="fp16",
                microbatches=batch_size // size,
                remat="full",
                sparsity=report_sparsity(sparsity),
            )
            name = f"fp16 + mb {size} + remat full + sparse {sparsity:.0%}"
            grid.append((name, "combined", plan))
            if sparsity == 0.7:  # the mask fixed at initialisation: no rewiring in the step
                static = dataclasses.replace(plan.sparsity, algorithm="static")
                name = f"fp16 + mb {size} + remat full + static sparse 70%"
                grid.append((name, "combined", dataclasses.replace(plan, sparsity=static)))
        if uint8:
            grid.append((f"{name} + uint8 input", "combined", dataclasses.replace(plan, **uint8)))
        plan = dataclasses.replace(plan, optimizer_state="int4")
        grid.append((f"fp16 + mb {size} + remat full + sparse 90% + state int4", "combined", plan))
    return grid


#: Which rows a report analyses: ``quick`` (``lowmem report``'s default) the plain step, the
#: baseline, each technique alone at the report's setting and the combined rows the headline
#: comes from; ``full`` the whole :func:`standard_grid`.
GRIDS = ("quick", "full")


def quick_rows(grid: list[GridRow]) -> list[GridRow]:
    """The rows of ``grid`` that ``--grid quick`` keeps: ``plain`` and ``baseline``;
    ``mixed_fp16``, the microbatch row nearest 8 examples, ``remat full``, ``sparse 70% dsr``,
    ``state int8``, ``uint8 input`` and ``factorize tucker 25%``; of the combined rows, the
    in-envelope ones (``mixed_fp16`` with the most techniques; ``lowmem plan``'s float32 answer)
    and the least-memory ones at 90% sparsity or with a static mask (the last two)."""
    singles = {"mixed_fp16", "remat full", "sparse 70% dsr", "state int8", "uint8 input",
               "factorize tucker 25%"}  # fmt: skip
    micro = [name for name, group, _ in grid if group == "microbatching"]
    if micro:
        singles.add(min(micro, key=lambda n: abs(int(n.split()[-1]) - 8)))
    combined = [name for name, group, _ in grid if group == "combined"]
    inside = [n for n in combined if n.startswith("mixed_fp16 + ") and "sparse 70%" in n]
    planned = [n for n in combined if "remat dots + state bf16" in n]  # lowmem plan's answer
    least = [n for n in combined if n.startswith("fp16 + ") and
             ("sparse 90%" in n or "static sparse" in n) and "state" not in n]  # fmt: skip
    keep = {"plain", "baseline", *singles, *inside[-1:], *planned, *least[-2:]}
    return [row for row in grid if row[0] in keep]


def model_grid(model: str, batch_size: int, grid: str = "full") -> list[GridRow]:
    """:func:`standard_grid` for a named model (``grid="quick"``: its :func:`quick_rows`): the
    remat row saves its tagged outputs (``dot_out`` in the DynamicConv Transformer, else
    ``conv_out``); ``uint8 input`` rows for image models.

    Raises:
      ValueError: a ``grid`` not in :data:`GRIDS`.
    """
    if grid not in GRIDS:
        raise ValueError(f"Unknown grid={grid!r}; allowed values: {list(GRIDS)}")
    images = not model.startswith("dynamicconv")
    rows = standard_grid(batch_size, CONV_OUT if images else DOT_OUT, images=images)
    return rows if grid == "full" else quick_rows(rows)


def in_envelope(config: dict[str, Any]) -> bool:
    """Whether a row's ``config`` (``Setup.config``) lies inside :data:`ENVELOPE`; the plain
    step does."""
    return ENVELOPE.why_outside(config) is None


def run_report(
    model: str = "wrn-28-2",
    batch_size: int = 128,
    grid: list[GridRow] | None = None,
    progress: Callable[[str], None] | None = print,
    seq_len: int = 40,
    reuse: dict[str, dict[str, Any]] | None = None,
    shard_devices: tuple[int, ...] = (),
    jobs: int = 1,
) -> dict[str, Any]:
    """Analyses every configuration of ``grid``; returns the report as a JSON-able dict.

    Sparse rows store their sparse weights compressed, so their model and optimizer bytes are
    the non-zeros and indices, as the technical report counted them. ``reuse``: rows of an
    earlier report by name, taken as they are instead of analysed again (to refresh some rows
    of a report after a change that affects only them). ``shard_devices``: device counts for
    the sharding section (:func:`sharding_rows` of the baseline at each count and of
    ``remat="full"`` at the largest; JAX must see that many devices); ``()``: none.
    ``jobs``: configurations analysed at once, in threads (XLA's compiles release the GIL; the
    rows and figures are the same, in grid order, whatever ``jobs``).
    """
    check_shard_devices(batch_size, shard_devices)
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if grid is None:
        grid = model_grid(model, batch_size)

    def analyzed(plan):
        t0 = time.perf_counter()
        report = analyze_model(model, batch_size, plan, seq_len=seq_len).to_dict()
        return report, time.perf_counter() - t0

    todo = [(name, plan) for name, _, plan in grid if not (reuse and name in reuse)]
    rows, seconds = [], []
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = {name: pool.submit(analyzed, plan) for name, plan in todo}
        for i, (name, group, plan) in enumerate(grid, 1):
            argv = analyze_argv(model, batch_size, plan, seq_len)
            if name not in pending:
                rows.append({**reuse[name], "argv": argv})
                continue
            report, took = pending.pop(name).result()
            rows.append({"name": name, "group": group, "argv": argv, **report})
            seconds.append(took)
            if progress:
                elapsed = time.perf_counter() - start
                left = len(pending) * elapsed / len(seconds)  # at the pace so far
                progress(
                    f"[{i:2d}/{len(grid)}] {name:34s} XLA total "
                    f"{report['xla']['total_bytes'] / MIB:8.1f} MiB  analytic "
                    f"{report['analytic']['total_bytes'] / MIB:8.1f} MiB  ({took:.1f}s; "
                    f"{elapsed:.0f}s elapsed, ~{left:.0f}s left)"
                )
    rows_by_name = {r["name"]: r for r in rows}
    base = rows_by_name["baseline"]
    plain = rows_by_name.get("plain")
    for row in rows:
        row["reduction_xla"] = base["xla"]["total_bytes"] / row["xla"]["total_bytes"]
        row["reduction_analytic"] = base["analytic"]["total_bytes"] / row["analytic"]["total_bytes"]
        row["flops_overhead"] = row["flops"] / base["flops"]
        if plain is not None:
            row["reduction_xla_vs_plain"] = plain["xla"]["total_bytes"] / row["xla"]["total_bytes"]
            row["reduction_analytic_vs_plain"] = (
                plain["analytic"]["total_bytes"] / row["analytic"]["total_bytes"]
            )
    best = max(rows, key=lambda r: r["reduction_xla"])
    inside = max((r for r in rows if in_envelope(r["config"])), key=lambda r: r["reduction_xla"])
    result = {
        "model": model,
        "batch_size": batch_size,
        "backend": jax.default_backend(),
        "xla_source": base["xla"]["source"],
        "jax_version": jax.__version__,
        "seconds": time.perf_counter() - start,
        "best": {
            "name": best["name"],
            "argv": best["argv"],
            "reduction_xla": best["reduction_xla"],
            "reduction_analytic": best["reduction_analytic"],
            "reduction_xla_vs_plain": best.get("reduction_xla_vs_plain"),
            "reduction_analytic_vs_plain": best.get("reduction_analytic_vs_plain"),
            "published_reduction": PUBLISHED.get(model),
        },
        "best_in_envelope": {
            "envelope": ENVELOPE.describe(),
            "name": inside["name"],
            "argv": inside["argv"],
            "reduction_xla": inside["reduction_xla"],
            "reduction_analytic": inside["reduction_analytic"],
            "reduction_xla_vs_plain": inside.get("reduction_xla_vs_plain"),
            "reduction_analytic_vs_plain": inside.get("reduction_analytic_vs_plain"),
        },
        "configs": rows,
    }
    if shard_devices:
        # The baseline at every count; remat full at the largest, where zero3's per-block
        # gathering shows (without remat the backward pass keeps every gathered block).
        result["sharding"] = sharding_rows(
            model, batch_size, shard_devices, seq_len=seq_len, progress=progress
        ) + sharding_rows(
            model,
            batch_size,
            (max(shard_devices),),
            plan=Plan(remat="full"),
            label="remat full",
            seq_len=seq_len,
            progress=progress,
        )
    return result


def _vs_plain(row: dict[str, Any], key: str) -> str:
    value = row.get(f"{key}_vs_plain")
    return "-" if value is None else f"{value:.2f}x"


def to_markdown(result: dict[str, Any]) -> str:
    src = result["xla_source"]
    best = result["best"]
    lines = [
        f"# Training memory of `{result['model']}`, batch {result['batch_size']}",
        "",
        f"Compile-only analysis; XLA columns are {src} compiled figures (total = argument + output "
        "+ temp - alias), analytic columns sum tensor sizes (activations = residuals saved for "
        "the backward pass, per microbatch). FLOPs counted from the jaxpr (remat recomputation "
        "included). Reductions are against `plain` (a Flax/Optax step: `jax.grad` + the optax "
        "update, float32, the model unrolled with XLA's convolution) and against `baseline` (our "
        "step with no technique), both in the same run; FLOPs against `baseline`.",
        "",
    ]
    inside = result.get("best_in_envelope")
    if best.get("reduction_xla_vs_plain") is not None:
        lines += [
            f"Best reduction against the plain step: **{best['reduction_xla_vs_plain']:.1f}x "
            f"({src})**, {best['reduction_analytic_vs_plain']:.1f}x (analytic), by "
            f"`{best['name']}`: `lowmem analyze {' '.join(best['argv'])}`"
            + (
                f". The technical report: {best['published_reduction']}x (analytic, fp16 on "
                "GPU, with sparse weights)."
                if best["published_reduction"]
                else "."
            ),
            "",
        ]
    if inside and inside.get("reduction_xla_vs_plain") is not None:
        limits = inside["envelope"]
        lines += [
            "Best inside the technical report's envelope (fp32 master weights, microbatches of "
            f"at least {limits['min_microbatch_examples']} examples, at most "
            f"{limits['max_sparsity']:.0%} sparsity): **{inside['reduction_xla_vs_plain']:.1f}x "
            f"({src})**, {inside['reduction_analytic_vs_plain']:.1f}x (analytic), by "
            f"`{inside['name']}`: `lowmem analyze {' '.join(inside['argv'])}`.",
            "",
        ]
    lines += [
        f"| config | model MiB | optimizer MiB | activations MiB | dense weights MiB | inputs MiB "
        f"| analytic total MiB | {src} temp MiB | {src} total MiB | vs plain ({src}) "
        f"| vs plain (analytic) | vs baseline ({src}) | vs baseline (analytic) "
        "| FLOPs / baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["configs"]:
        a, x = r["analytic"], r["xla"]
        lines.append(
            f"| {r['name']} | {a['model_bytes'] / MIB:.2f} | {a['optimizer_bytes'] / MIB:.2f} | "
            f"{a['activation_bytes'] / MIB:.1f} | {a['dense_weight_bytes'] / MIB:.1f} | "
            f"{a['input_bytes'] / MIB:.2f} | "
            f"{a['total_bytes'] / MIB:.1f} | {x['temp_bytes'] / MIB:.1f} | "
            f"{x['total_bytes'] / MIB:.1f} | {_vs_plain(r, 'reduction_xla')} | "
            f"{_vs_plain(r, 'reduction_analytic')} | {r['reduction_xla']:.2f}x | "
            f"{r['reduction_analytic']:.2f}x | {r['flops_overhead']:.2f}x |"
        )
    notes = next(r for r in result["configs"] if r["name"] == "baseline")["notes"]
    lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    if result.get("sharding"):
        lines += ["", *sharding_markdown(result["sharding"])]
    return "\n".join(lines) + "\n"


def summary_table(result: dict[str, Any], names: list[str]) -> str:
    """A short markdown table of the rows ``names`` of a report (docs/measured.md quotes one):
    MiB by component (analytic; inputs and state only in the total), the analytic and XLA
    totals, the reductions against ``plain`` (XLA first, then analytic) and the FLOPs against
    ``baseline``.

    Raises:
      KeyError: for a name the report does not hold.
    """
    rows = {r["name"]: r for r in result["configs"]}
    src = result["xla_source"]
    lines = [
        f"| config | model | optimizer | activations | dense weights | analytic total "
        f"| {src} total | reduction vs plain ({src}) | reduction vs plain (analytic) "
        "| FLOPs / baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        r = rows[name]
        a = r["analytic"]
        lines.append(
            f"| {name} | {a['model_bytes'] / MIB:.2f} | {a['optimizer_bytes'] / MIB:.1f} | "
            f"{a['activation_bytes'] / MIB:.1f} | {a['dense_weight_bytes'] / MIB:.1f} | "
            f"{a['total_bytes'] / MIB:.1f} | "
            f"{r['xla']['total_bytes'] / MIB:.1f} | {r['reduction_xla_vs_plain']:.1f}x | "
            f"{r['reduction_analytic_vs_plain']:.1f}x | {r['flops_overhead']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def write_report(result: dict[str, Any], out_dir: str, command: str | None = None) -> list[str]:
    """Writes report.json, report.md, breakdown.png, tradeoff.png and (with a sharding
    section) sharding.png; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    if command:
        result = {**result, "command": command}
    paths = [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(to_markdown(result) + (f"\nMade by: `{command}`\n" if command else ""))
    return paths + plot_report(result, out_dir)
