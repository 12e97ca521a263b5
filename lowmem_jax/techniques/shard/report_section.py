"""The sharding technique's section of ``lowmem report`` (:data:`SECTION`, flag
``--shard-devices``): per-device bytes of a step under each ZeRO stage.

:func:`sharding_rows` compiles (never runs) a plan's step on one device and under every stage of
:data:`SHARD_STAGES` (:mod:`.zero`) for each device count, and keeps XLA's figures
for the program one device runs; :func:`sharding_markdown` and :func:`sharding_plot` render
them. JAX must see the devices (on CPU: host devices, asked for before it starts:
:func:`use_host_devices`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax

from lowmem_jax.core.mesh import set_cpu_devices
from lowmem_jax.core.report_hooks import ReportSection
from lowmem_jax.core.units import MIB

__all__ = [
    "SECTION",
    "SHARD_STAGES",
    "check_shard_devices",
    "use_host_devices",
    "sharding_rows",
    "sharding_markdown",
    "sharding_plot",
]

SHARD_STAGES = ("dp", "zero1", "zero2", "zero3")
_SHARD_FIGURES = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes")
# --shard-devices auto: those of these that divide the batch (and the backend has).
_AUTO_DEVICES = (2, 4, 8)


def _device_counts(text: str) -> tuple[int, ...] | str | None:
    """``--shard-devices``: ``auto`` (``None``), ``none`` or comma-separated counts; left out,
    ``"grid"`` (auto with ``--grid full``, none with ``--grid quick``: :func:`_requested`)."""
    if text in ("auto", "none", "grid"):
        return {"auto": None, "none": (), "grid": "grid"}[text]
    try:
        counts = tuple(sorted({int(n) for n in text.split(",")}))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give auto, none or comma-separated device counts >= 2, e.g. 2,4,8"
        )
    return counts


def _add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shard-devices",
        type=_device_counts,
        default="grid",
        help="device counts for the sharding section (per-device bytes of the baseline under "
        "each ZeRO stage; host devices on CPU), e.g. 2,4,8; auto: those of 2, 4, 8 that divide "
        "the batch and the backend has (host devices on CPU); none: no section. Default: auto "
        "with --grid full, none with --grid quick",
    )


def _requested(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--shard-devices`` as given: counts, ``()`` (none) or ``None`` (auto)."""
    counts = getattr(args, "shard_devices", ())
    if counts == "grid":  # left out: the grid decides
        return None if getattr(args, "grid", "quick") == "full" else ()
    return counts


def use_host_devices(args: argparse.Namespace) -> None:
    """Asks XLA:CPU for the devices the sharding flags need, before JAX starts
    (:func:`lowmem_jax.core.mesh.set_cpu_devices`): ``--devices N`` with ``--shard``, N;
    ``lowmem report --shard-devices``, the most it names, or with ``auto`` 8, taking what the
    backend then has.

    Raises:
      ValueError: JAX already runs with fewer devices than a count the flags name.
    """
    counts = _requested(args)
    if counts != ():
        set_cpu_devices(max(counts or _AUTO_DEVICES), require=counts is not None)
    devices, stage = getattr(args, "devices", 0), getattr(args, "shard", None)
    if devices and stage not in (None, "none"):
        set_cpu_devices(devices)


def _setting(args: argparse.Namespace, batch_size: int) -> tuple[int, ...]:
    counts = _requested(args)
    if counts is None:  # auto: what the backend has (e.g. one GPU: no section)
        visible = len(jax.devices())
        counts = tuple(n for n in _AUTO_DEVICES if batch_size % n == 0 and n <= visible)
    return counts


def check_shard_devices(batch_size: int, devices: tuple[int, ...]) -> None:
    """Raises ``ValueError`` (naming ``shard_devices``) unless every count is >= 2, divides
    ``batch_size`` and is visible to JAX; checked before a report compiles anything."""
    bad = [n for n in devices if n < 2 or batch_size % n]
    if bad:
        raise ValueError(
            f"shard_devices={list(devices)}: each count must be >= 2 (the one-device step is "
            f"always there) and divide batch_size={batch_size}; {bad} do not"
        )
    if devices and max(devices) > len(jax.devices()):
        raise ValueError(
            f"shard_devices={list(devices)}: JAX sees {len(jax.devices())} device(s); on CPU, "
            "`lowmem report --shard-devices ...` (or lowmem_jax.core.mesh.set_cpu_devices(N) "
            "before JAX starts) gives host devices"
        )


def sharding_rows(
    analyze: Callable[[dict[str, Any]], dict[str, Any]],
    devices: tuple[int, ...] = (2, 4, 8),
    *,
    fields: dict[str, Any] | None = None,
    label: str = "baseline",
    progress: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """XLA's per-device bytes of a step (``analyze(fields)``: XLA's figures of the report's
    workload under ``Plan(**fields)``; ``fields`` default: no technique) under every stage of
    :data:`SHARD_STAGES` on each count of ``devices``, after the one-device step (the first
    row, ``shard="none"``). Compile-only. Each row: ``plan`` (``label``), ``devices``,
    ``shard``, the :func:`lowmem_jax.analysis.memory.xla_memory` byte figures, ``source``,
    ``compile_seconds``, ``argument_vs_one`` and ``total_vs_one`` (ratios to the first row).
    """
    runs = [(1, "none")] + [(n, stage) for n in sorted(set(devices)) for stage in SHARD_STAGES]
    rows = []
    for count, stage in runs:
        start = time.perf_counter()
        sharded = {**(fields or {}), "shard": stage, "devices": 0 if stage == "none" else count}
        xla = analyze(sharded)
        rows.append({
            "plan": label,
            "devices": count,
            "shard": stage,
            **{k: xla[k] for k in _SHARD_FIGURES},
            "source": xla["source"],
            "compile_seconds": time.perf_counter() - start,
        })  # fmt: skip
        if progress:
            progress(
                f"[sharding] {label}, {count} x {stage:5s}: XLA total per device "
                f"{xla['total_bytes'] / MIB:8.1f} MiB ({rows[-1]['compile_seconds']:.1f}s)"
            )
    for row in rows:
        row["argument_vs_one"] = row["argument_bytes"] / rows[0]["argument_bytes"]
        row["total_vs_one"] = row["total_bytes"] / rows[0]["total_bytes"]
    return rows


def _section_rows(analyze, devices, progress):
    """The baseline at every count; remat full at the largest, where zero3's per-block
    gathering shows (without remat the backward pass keeps every gathered block)."""
    return sharding_rows(analyze, devices, progress=progress) + sharding_rows(
        analyze, (max(devices),), fields={"remat": "full"}, label="remat full", progress=progress
    )


def sharding_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's sharding section (rows of :func:`sharding_rows`), as markdown lines."""
    src = rows[0]["source"]
    lines = [
        "## Per device, by ZeRO stage",
        "",
        f"The `baseline` step over N devices (`--shard STAGE --devices N`), and with `--remat "
        f"full` at the largest N, {src} figures for the "
        "program one device runs (compile-only; on CPU the devices are host devices sharing one "
        "memory, so communication is not measured). Each device takes B/N examples, so "
        "activations fall with N under every stage; zero1 partitions the optimizer state, zero2 "
        "also the gradients, zero3 also the parameters, each scanned block's gathered inside "
        "its loop (without remat the backward pass keeps every gathered block). `vs 1`: "
        "against the same plan's one-device step.",
        "",
        "| plan | devices | shard | argument MiB | temp MiB | total MiB | argument vs 1 "
        "| total vs 1 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('plan', 'baseline')} | {r['devices']} | {r['shard']} | "
            f"{r['argument_bytes'] / MIB:.2f} | "
            f"{r['temp_bytes'] / MIB:.1f} | {r['total_bytes'] / MIB:.1f} | "
            f"{r['argument_vs_one']:.3f} | {r['total_vs_one']:.3f} |"
        )
    return lines


def sharding_plot(rows: list[dict[str, Any]], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("plan", "baseline") == "baseline"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    one = rows[0]
    for i, stage in enumerate(SHARD_STAGES):
        sel = [one] + [r for r in rows if r["shard"] == stage]
        for ax, key in zip(axes, ("argument_bytes", "total_bytes"), strict=True):
            ax.plot([r["devices"] for r in sel], [r[key] / MIB for r in sel], "o-",
                    color=f"C{i}", label=stage)  # fmt: skip
    for ax, name in zip(axes, ("argument (state + batch)", "total"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel(f"{one['source']} MiB per device")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: The sharding technique's section of ``lowmem report`` (``--shard-devices``).
SECTION = ReportSection(
    key="sharding",
    add_flag=_add_flag,
    setting=_setting,
    argv=lambda counts: ["--shard-devices", ",".join(map(str, counts)) or "none"],
    check=check_shard_devices,
    rows=_section_rows,
    markdown=sharding_markdown,
    plot=lambda rows, title, path: sharding_plot(rows, f"{title}: per-device bytes by stage", path),
)
