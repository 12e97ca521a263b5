"""Per-device bytes of one train step under each ZeRO stage, for N = 1, 2, 4, 8 devices.

Compile-only (nothing runs): for every stage of :mod:`lowmem_jax.sharding` and device count,
XLA's figures for the partitioned program one device runs (argument, output, alias, temp,
total), next to the one-device step's, and the fraction of the state each stage partitions.
On CPU the devices are host devices (``jax_num_cpu_devices``): the figures are XLA:CPU's
per-device buffer sizes; communication time is not modelled.

Usage:
    python benchmarks/sharding.py                          # WRN-28-2, batch 128
    python benchmarks/sharding.py --model dynamicconv-iwslt --batch-size 96 --plan-flags \
        "--remat full"

Writes ``<out-dir>/sharding_<model>_b<batch>_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

STAGES = ("dp", "zero1", "zero2", "zero3")
FIGURES = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes")
MIB = 2.0**20


def measure(model: str, batch_size: int, devices: list[int], plan_flags: str, seq_len: int):
    import dataclasses

    from lowmem_jax.plan import Plan
    from lowmem_jax.plan_flags import add_plan_flags, add_workload_flags, plan_from_args
    from lowmem_jax.workloads import build, workload

    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    add_plan_flags(parser, Plan())
    base = plan_from_args(parser.parse_args(shlex.split(plan_flags)), Plan())
    work = workload(model, batch_size, seq_len=seq_len)
    rows = []
    for count, stage in [(1, "none")] + [(n, s) for n in devices if n > 1 for s in STAGES]:
        plan = dataclasses.replace(base, shard=stage, devices=0 if stage == "none" else count)
        start = time.perf_counter()
        report = build(work, plan).analyze()
        rows.append({
            "devices": count,
            "shard": stage,
            **{k: report.xla[k] for k in FIGURES},
            "source": report.xla["source"],
            "compile_seconds": time.perf_counter() - start,
        })  # fmt: skip
        print(f"{count} x {stage}: total {report.xla['total_bytes'] / MIB:.1f} MiB per device",
              flush=True)  # fmt: skip
    one = rows[0]
    for row in rows:
        row["argument_vs_one"] = row["argument_bytes"] / one["argument_bytes"]
        row["total_vs_one"] = row["total_bytes"] / one["total_bytes"]
    return rows


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"# Per-device bytes by ZeRO stage: `{result['model']}`, batch {result['batch_size']}",
        "",
        f"Command: `{result['command']}`. Backend {result['source']} ({result['machine']}), "
        f"JAX {result['jax']}; compile-only. Plan flags: `{result['plan_flags'] or 'none'}`.",
        "",
        "Bytes are XLA's figures for the program one device runs (total = argument + output + "
        "temp - alias); `vs 1` is the ratio to the one-device step. With N devices each takes "
        "B/N examples, so activations fall with N under every stage; the stages differ in the "
        "state: zero1 partitions the optimizer state, zero2 also the gradients (temp), zero3 "
        "also the parameters.",
        "",
        "| devices | shard | argument MiB | temp MiB | total MiB | argument vs 1 | total vs 1 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['shard']} | {r['argument_bytes'] / MIB:.2f} | "
            f"{r['temp_bytes'] / MIB:.1f} | {r['total_bytes'] / MIB:.1f} | "
            f"{r['argument_vs_one']:.3f} | {r['total_vs_one']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["rows"]
    one = rows[0]
    for i, stage in enumerate(STAGES):
        sel = [one] + [r for r in rows if r["shard"] == stage]
        n = [r["devices"] for r in sel]
        for ax, key in zip(axes, ("argument_bytes", "total_bytes"), strict=True):
            ax.plot(n, [r[key] / MIB for r in sel], "o-", color=f"C{i}", label=stage)
    for ax, title in zip(axes, ("argument (state + batch)", "total"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel(f"{one['source']} MiB per device")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, batch {result['batch_size']}: per-device bytes by stage",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wrn-28-2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--devices", default="2,4,8", help="comma-separated device counts")
    parser.add_argument("--plan-flags", default="", help="technique flags, as lowmem analyze")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    devices = sorted({int(n) for n in args.devices.split(",")})
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from lowmem_jax import sharding

    sharding.set_cpu_devices(max(devices))  # before JAX starts (a no-op on GPU / TPU)
    import jax

    rows = measure(args.model, args.batch_size, devices, args.plan_flags, args.seq_len)
    command = "python benchmarks/sharding.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "plan_flags": args.plan_flags,
        "command": command.strip(),
        "source": rows[0]["source"],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "rows": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(
        args.out_dir, f"sharding_{args.model}_b{args.batch_size}_{jax.default_backend()}"
    )
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(result))
    plot(result, stem + ".png")
    print(f"wrote {stem}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
