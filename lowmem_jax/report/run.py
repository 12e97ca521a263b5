"""``lowmem report``: where training memory goes, and what each technique does to it (RQ1).

Runs the compile-only memory analysis (:func:`lowmem_jax.workloads.analyze_model`) over a grid
of configurations (:mod:`lowmem_jax.report.grid`): the plain Flax/Optax step, our step with no
technique (``baseline``), each technique alone at several settings, then combinations. Memory
reductions are quoted against ``plain`` (what a user would otherwise run) and against
``baseline``; FLOPs against ``baseline`` (the same convolution implementation, so the jaxpr
counts compare).
Writes ``report.json``, ``report.md`` and two plots: the model / optimizer / activation breakdown
per configuration (the report's breakdown figure) and memory reduction against FLOPs overhead
(the trade-off figure). Every figure names its source: ``analytic`` or ``XLA:<BACKEND>``.

A technique may add a section of its own after the grid, with its own flag
(:class:`lowmem_jax.core.report_hooks.ReportSection`; ``run_report``'s ``sections``): the
sharding technique's per-device bytes by ZeRO stage and device count (``--shard-devices``,
``sharding.png``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.units import MIB
from lowmem_jax.planning.envelope import ENVELOPES, in_words
from lowmem_jax.report.grid import GridRow, model_grid
from lowmem_jax.report.plot import plot_report
from lowmem_jax.techniques import report_sections
from lowmem_jax.workloads.builder import analyze_model
from lowmem_jax.workloads.flags import analyze_argv

__all__ = [
    "ENVELOPE",
    "in_envelope",
    "run_report",
    "write_report",
    "to_markdown",
    "summary_table",
]

# Sohoni et al. 2019, best combined reduction (analytic)
PUBLISHED = {"wrn-28-2": 60.7, "dynamicconv-iwslt": 8.7}

#: The technical report's accuracy envelope (:data:`lowmem_jax.planning.envelope.ENVELOPES`).
ENVELOPE = ENVELOPES["report"]


def in_envelope(config: dict[str, Any]) -> bool:
    """Whether a row's ``config`` (``Setup.config``) lies inside :data:`ENVELOPE`; the plain
    step does."""
    return ENVELOPE.why_outside(config) is None


def run_report(
    model: str = "wrn-28-2",
    batch_size: int = 128,
    grid: list[GridRow] | None = None,
    progress: Callable[[str], None] | None = print,
    seq_len: int | None = None,
    reuse: dict[str, dict[str, Any]] | None = None,
    sections: dict[str, Any] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Analyses every configuration of ``grid``; returns the report as a JSON-able dict.

    Sparse rows store their sparse weights compressed, so their model and optimizer bytes are
    the non-zeros and indices, as the technical report counted them. ``reuse``: rows of an
    earlier report by name, taken as they are instead of analysed again (to refresh some rows
    of a report after a change that affects only them). ``sections``: ``{key: setting}`` of
    the techniques' report sections (:func:`lowmem_jax.techniques.report_sections`; e.g.
    ``{"sharding": (2, 4, 8)}``: per-device bytes at each count, JAX must see that many
    devices); a section left out or with an empty setting is not run.
    ``jobs``: XLA compiles at once, in threads; one more configuration is traced and lowered
    meanwhile (Python, while a compile has released the GIL). The rows and figures are the
    same, in grid order, whatever ``jobs``.
    """
    known = report_sections()
    sections = {key: setting for key, setting in (sections or {}).items() if setting}
    for key, setting in sections.items():
        if key not in known:
            raise ValueError(f"Unknown report section {key!r}; allowed values: {list(known)}")
        known[key].check(batch_size, setting)
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if grid is None:
        grid = model_grid(model, batch_size)

    compiling = threading.Semaphore(jobs)

    def analyzed(plan):
        return analyze_model(model, batch_size, plan, seq_len=seq_len, compiling=compiling)

    todo = [(name, plan) for name, _, plan in grid if not (reuse and name in reuse)]
    weights = {name: 1.0 if plan is None else plan.compile_cost() for name, plan in todo}
    rows, done, shown = [], 0.0, 0.0
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs + 1) as pool:
        pending = {name: pool.submit(analyzed, plan) for name, plan in todo}
        for i, (name, group, plan) in enumerate(grid, 1):
            argv = analyze_argv(model, batch_size, plan, seq_len)
            if name not in pending:
                rows.append({**reuse[name], "argv": argv})
                continue
            report = pending.pop(name).result().to_dict()
            rows.append({"name": name, "group": group, "argv": argv, **report})
            done += weights[name]
            if progress:
                # Each row's seconds: the wall time since the row before it was done (rows
                # overlap: one traces while another compiles).
                elapsed = time.perf_counter() - start
                took, shown = elapsed - shown, elapsed
                # At the pace so far, each row weighed by its plan's compile cost.
                left = sum(weights[n] for n in pending) * elapsed / done
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
        "seconds": time.perf_counter() - start,  # of the rows analysed, not those reused
        "rows_reused": len(grid) - len(todo),
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
    for key, setting in sections.items():
        result[key] = known[key].rows(
            lambda fields: analyze_model(model, batch_size, Plan(**fields), seq_len=seq_len).xla,
            setting,
            progress,
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
        lines += [
            f"Best inside the technical report's envelope ({in_words(inside['envelope'])}): "
            f"**{inside['reduction_xla_vs_plain']:.1f}x "
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
    for key, section in report_sections().items():
        if result.get(key):
            lines += ["", *section.markdown(result[key])]
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
    """Writes report.json, report.md, breakdown.png, tradeoff.png and a plot per section
    (``<key>.png``, e.g. sharding.png); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    if command:
        result = {**result, "command": command}
    paths = [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(to_markdown(result) + (f"\nMade by: `{command}`\n" if command else ""))
    return paths + plot_report(result, out_dir)
