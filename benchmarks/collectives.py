"""What a sharded train step sends between devices, by ZeRO stage, gradient compression and
microbatch count.

For each model, stage (``dp``, ``zero1``, ``zero2``, ``zero3``; ``dp`` and ``zero1`` also with
``grad_compression="int8"``, ``dp`` with ``"powersgd"`` at its default rank 4 and ``"topk"`` at
its default 1%) and microbatch count, the lowmem step over ``--devices`` host devices is
compiled (nothing runs) and its collectives counted
(:func:`lowmem_jax.analysis.collectives.collectives`: per kind, runs per step and tensor bytes; what
each device sends under a ring schedule), next to the model's float32 parameter bytes and to what
``dp`` without compression sends at the same microbatch count.

Usage:
    python benchmarks/collectives.py                      # WRN-28-2, batch 128, 8 devices
    python benchmarks/collectives.py --models wrn-10-1 --batch-size 16 --out-dir /tmp/c

Writes ``<out-dir>/collectives_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys

# (stage, gradient compression) in the table's order.
RUNS = (
    ("dp", "none"),
    ("dp", "int8"),
    ("dp", "powersgd"),
    ("dp", "topk"),
    ("zero1", "none"),
    ("zero1", "int8"),
    ("zero2", "none"),
    ("zero3", "none"),
)


def measure(
    model: str, batch_size: int, stage: str, microbatches: int, devices: int, grads: str = "none"
) -> dict:
    """One row: the step's collectives (``None``: it sends nothing) and its parameter bytes."""
    import lowmem_jax as lm

    plan = lm.Plan(shard=stage, devices=devices, microbatches=microbatches, grad_compression=grads)
    report = lm.build(lm.workload(model, batch_size), plan).analyze()
    sent = report.xla.get("collectives")
    return {
        "model": model,
        "batch_size": batch_size,
        "shard": stage,
        "grad_compression": grads,
        "powersgd_rank": plan.powersgd_rank if grads == "powersgd" else None,
        "topk_fraction": plan.topk_fraction if grads == "topk" else None,
        "microbatches": microbatches,
        "devices": devices,
        "param_bytes": 4 * report.param_count,
        "collectives": sent,
        "sent_bytes": 0 if sent is None else sent["sent_bytes"],
    }


def to_markdown(result: dict) -> str:
    mib = 2.0**20
    lines = [
        "# What a sharded step sends, by ZeRO stage, gradient compression and microbatches",
        "",
        f"`{result['command']}` ({result['backend']}, {result['machine']}, JAX "
        f"{result['jax_version']}): compile-only, counted in the compiled program "
        "(`lowmem_jax.analysis.collectives`); sent: what each device sends per step under a ring "
        "schedule. Parameters: the model's float32 bytes. vs dp: against `dp` without "
        "compression at the same microbatch count.",
        "",
        "| model | stage | gradients | microbatches | parameters MiB | collectives (runs per "
        "step, tensor MiB) | sent per device MiB | sent / parameters | vs dp |",
        "|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        dp = _dp_row(result["rows"], row)
        kinds = (row["collectives"] or {}).get("by_kind", {})
        text = ", ".join(f"{k} x{v['count']} ({v['bytes'] / mib:.2f})" for k, v in kinds.items())
        lines.append(
            f"| {row['model']} | {row['shard']} | {_gradients(row)} | "
            f"{row['microbatches']} | {row['param_bytes'] / mib:.2f} | {text or 'none'} | "
            f"{row['sent_bytes'] / mib:.2f} | {row['sent_bytes'] / row['param_bytes']:.2f} | "
            f"{row['sent_bytes'] / dp['sent_bytes']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _gradients(row: dict) -> str:
    """The row's gradient compression, with PowerSGD's rank."""
    name = row.get("grad_compression", "none")
    if name == "powersgd":
        return f"{name} r{row['powersgd_rank']}"
    return f"{name} {row['topk_fraction']:.0%}" if name == "topk" else name


def _dp_row(rows: list[dict], row: dict) -> dict:
    """The uncompressed ``dp`` row of ``row``'s model and microbatch count."""
    return next(
        r for r in rows
        if r["model"] == row["model"] and r["microbatches"] == row["microbatches"]
        and r["shard"] == "dp" and r.get("grad_compression", "none") == "none"
    )  # fmt: skip


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [
        f"{r['shard']}\n{'' if _gradients(r) == 'none' else _gradients(r)}\nmb {r['microbatches']}"
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    ax.bar(range(len(rows)), [r["sent_bytes"] / r["param_bytes"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("sent per device / parameter bytes")
    ax.set_title(f"{rows[0]['model']}, {rows[0]['devices']} devices ({result['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="wrn-28-2", help="comma-separated (default wrn-28-2)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--devices", type=int, default=8, help="host devices (default 8)")
    parser.add_argument("--microbatches", default="1,4", help="comma-separated (default 1,4)")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    counts = [int(m) for m in args.microbatches.split(",") if m]
    if args.devices < 2 or any(m < 1 or args.batch_size % (m * args.devices) for m in counts):
        parser.error(
            f"--devices must be >= 2 and --batch-size={args.batch_size} divisible by each of "
            f"--microbatches={counts} x --devices={args.devices}"
        )
    import lowmem_jax as lm

    lm.core.mesh.set_cpu_devices(args.devices)  # before JAX starts its backends
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import result_writer

    rows = []
    for model in args.models.split(","):
        for stage, grads in RUNS:
            for m in counts:
                rows.append(measure(model, args.batch_size, stage, m, args.devices, grads))
                print(
                    f"{model} {stage} {grads} mb {m}: sent {rows[-1]['sent_bytes'] / 2**20:.2f} MiB"
                )
    result = {**result_writer.metadata(__file__, argv), "rows": rows}
    stem = os.path.join(args.out_dir, f"collectives_{jax.default_backend()}")
    result_writer.write(stem, result, to_markdown, plot)
    print(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
