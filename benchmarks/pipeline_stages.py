"""Per-device bytes of GPipe pipeline stages (``Plan(pipeline=S)``) against one device.

For each configuration (model, batch, stages, where the rest of the model's state lives, remat,
a ZeRO stage over ``D`` data-parallel devices beside the stages) the pipelined step over
``S x D`` host devices and the same step on one device are compiled
(nothing runs): XLA's per-device argument bytes (the train state and the batch) and totals, the
share of the parameters' bytes the stages split (pipelined stacks) or partition (``pipeline_rest
partition``), the microbatches and the bubble, and what each device sends per step
(:mod:`lowmem_jax.analysis.collectives`).

Usage:
    python benchmarks/pipeline_stages.py            # WRN-28-2 b128 and the IWSLT transformer b32
    python benchmarks/pipeline_stages.py --configs wrn-28-2:3 --out-dir /tmp/p

Writes ``<out-dir>/pipeline_stages_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys

#: name -> (model, batch size, stages, pipeline_rest, remat, shard, data devices), in the
#: table's order.
CONFIGS = {
    "wrn-28-2:3": ("wrn-28-2", 128, 3, "replicate", "none", "none", 1),
    "wrn-28-2:3:partition": ("wrn-28-2", 128, 3, "partition", "none", "none", 1),
    "wrn-28-2:3:remat": ("wrn-28-2", 128, 3, "replicate", "full", "none", 1),
    "wrn-28-2:3:partition:zero2x2": ("wrn-28-2", 128, 3, "partition", "none", "zero2", 2),
    "wrn-28-2:3:partition:zero3x2": ("wrn-28-2", 128, 3, "partition", "none", "zero3", 2),
    "iwslt:2": ("dynamicconv-iwslt", 32, 2, "replicate", "none", "none", 1),
    "iwslt:4": ("dynamicconv-iwslt", 32, 4, "replicate", "none", "none", 1),
    "iwslt:4:partition": ("dynamicconv-iwslt", 32, 4, "partition", "none", "none", 1),
    "iwslt:4:partition:zero2x2": ("dynamicconv-iwslt", 32, 4, "partition", "none", "zero2", 2),
    "iwslt:4:partition:zero3x2": ("dynamicconv-iwslt", 32, 4, "partition", "none", "zero3", 2),
}


def measure(name: str, one_device: dict) -> dict:
    """One row: the pipelined step's per-device figures next to the one-device step's
    (``one_device`` caches those per (model, batch, remat))."""
    import lowmem_jax as lm

    model, batch_size, stages, rest, remat, shard, data = CONFIGS[name]
    plan = lm.Plan(pipeline=stages, pipeline_rest=rest, remat=remat, shard=shard,
                   devices=data if shard != "none" else 0)  # fmt: skip
    setup = lm.build(lm.workload(model, batch_size), plan)
    report = setup.analyze()
    (verdict,) = [v for v in setup.verdicts() if v.technique == "pipeline"]
    key = (model, batch_size, remat)
    if key not in one_device:
        single = lm.build(lm.workload(model, batch_size), plan.on_one_device()).analyze()
        one_device[key] = single.xla
    single = one_device[key]
    sent = report.xla.get("collectives") or {}
    return {
        "name": name,
        "model": model,
        "batch_size": batch_size,
        "stages": stages,
        "pipeline_rest": rest,
        "remat": remat,
        "shard": shard,
        "data_devices": data,
        "verdict": verdict.evidence,
        "argument_bytes": report.xla["argument_bytes"],
        "total_bytes": report.xla["total_bytes"],
        "one_device_argument_bytes": single["argument_bytes"],
        "one_device_total_bytes": single["total_bytes"],
        "input_bytes": report.analytic["input_bytes"],
        "sent_bytes": sent.get("sent_bytes", 0),
        "sent_by_kind": {k: v["bytes"] for k, v in sent.get("by_kind", {}).items()},
    }


def to_markdown(result: dict) -> str:
    mib = 2.0**20
    lines = [
        "# GPipe pipeline stages: per-device bytes against one device",
        "",
        f"`{result['command']}` ({result['backend']}, {result['machine']}, JAX "
        f"{result['jax_version']}): compile-only. Arguments: the train state and the batch, per "
        "device (the batch is on every stage, split over the data devices); one device: the "
        "same plan with `pipeline=1` and no `shard`. Sent: what each device sends per step "
        "under a ring schedule.",
        "",
        "| model | batch | stages | rest | remat | data devices | arguments MiB | one device | "
        "ratio | total MiB | one device | ratio | sent MiB | what took effect |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        data = "-" if r["shard"] == "none" else f"{r['shard']} x {r['data_devices']}"
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['stages']} | {r['pipeline_rest']} | "
            f"{r['remat']} | {data} | {r['argument_bytes'] / mib:.2f} | "
            f"{r['one_device_argument_bytes'] / mib:.2f} | {_ratio(r, 'argument_bytes'):.3f} | "
            f"{r['total_bytes'] / mib:.1f} | {r['one_device_total_bytes'] / mib:.1f} | "
            f"{_ratio(r, 'total_bytes'):.3f} | {r['sent_bytes'] / mib:.1f} | {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(row: dict, key: str) -> float:
    return row[key] / row[f"one_device_{key}"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']}\n{r['stages']} stages\n{r['pipeline_rest']}"
              + ("\nremat full" if r["remat"] != "none" else "")
              + (f"\n{r['shard']} x {r['data_devices']}" if r["shard"] != "none" else "")
              for r in rows]  # fmt: skip
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.4), 4))
    ax.bar([x - 0.2 for x in xs], [_ratio(r, "argument_bytes") for r in rows], 0.4,
           label="arguments")  # fmt: skip
    ax.bar([x + 0.2 for x in xs], [_ratio(r, "total_bytes") for r in rows], 0.4, label="total")
    ax.axhline(0.3, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("per device / one device")
    ax.set_title(f"GPipe stages, per device ({result['backend']}, compile-only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {list(CONFIGS)} (default all)")  # fmt: skip
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"--configs: unknown {unknown}; allowed values: {list(CONFIGS)}")
    import lowmem_jax as lm

    lm.core.mesh.set_cpu_devices(max(CONFIGS[n][2] * CONFIGS[n][6] for n in names))
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import result_writer

    rows, one_device = [], {}
    for name in names:
        rows.append(measure(name, one_device))
        print(f"{name}: arguments x{_ratio(rows[-1], 'argument_bytes'):.3f}, "
              f"total x{_ratio(rows[-1], 'total_bytes'):.3f}", flush=True)  # fmt: skip
    result = {**result_writer.metadata(__file__, argv), "rows": rows}
    stem = os.path.join(args.out_dir, f"pipeline_stages_{jax.default_backend()}")
    result_writer.write(stem, result, to_markdown, plot)
    print(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
