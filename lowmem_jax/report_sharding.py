"""The sharding section of ``lowmem report``: per-device bytes of a step under each ZeRO stage.

:func:`sharding_rows` compiles (never runs) a plan's step on one device and under every stage of
:data:`SHARD_STAGES` (:mod:`lowmem_jax.sharding`) for each device count, and keeps XLA's figures
for the program one device runs; :func:`sharding_markdown` and :func:`sharding_plot` render
them. JAX must see the devices (on CPU: host devices, set before it starts).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from lowmem_jax.plan import Plan
from lowmem_jax.workloads import analyze_model

__all__ = [
    "SHARD_STAGES",
    "check_shard_devices",
    "sharding_rows",
    "sharding_markdown",
    "sharding_plot",
]

MIB = 2.0**20
SHARD_STAGES = ("dp", "zero1", "zero2", "zero3")
_SHARD_FIGURES = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes")


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
            "`lowmem report --shard-devices ...` (or lowmem_jax.sharding.set_cpu_devices(N) "
            "before JAX starts) gives host devices"
        )


def sharding_rows(
    model: str,
    batch_size: int,
    devices: tuple[int, ...] = (2, 4, 8),
    *,
    plan: Plan | None = None,
    label: str = "baseline",
    seq_len: int = 40,
    progress: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """XLA's per-device bytes of ``plan``'s step (default: no technique) under every stage of
    :data:`SHARD_STAGES` on each count of ``devices``, after the one-device step (the first
    row, ``shard="none"``). Compile-only. Each row: ``plan`` (``label``), ``devices``,
    ``shard``, the :func:`lowmem_jax.memory.xla_memory` byte figures, ``source``,
    ``compile_seconds``, ``argument_vs_one`` and ``total_vs_one`` (ratios to the first row).

    Raises:
      ValueError: see :func:`check_shard_devices`.
    """
    plan = plan or Plan()
    check_shard_devices(batch_size, devices)
    runs = [(1, "none")] + [(n, stage) for n in sorted(set(devices)) for stage in SHARD_STAGES]
    rows = []
    for count, stage in runs:
        sharded = dataclasses.replace(plan, shard=stage, devices=0 if stage == "none" else count)
        start = time.perf_counter()
        xla = analyze_model(model, batch_size, sharded, seq_len=seq_len).xla
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
