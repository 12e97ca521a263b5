"""Loops or straight-line code: the compiled bytes of a train step whose block stacks are scanned
or unrolled.

For each model and plan, compile-only (nothing runs), the lowmem step with the model's
``unroll`` set to ``False`` (every stack a ``lax.scan`` loop), ``True`` (every stack
straight-line code) and ``None`` (the default of the bundled WideResNet: straight-line unless
the stack is remat'd or computes in float16, :func:`lowmem_jax.blocks.scanned.straight_line`),
each through :meth:`lowmem_jax.Plan.configure_model` (which also picks XLA's convolution when
the step has no loop), against the plain Flax/Optax step (``plain``, once per model). Figures:
XLA's compiled total (argument + output + temp - alias, source XLA:<backend>).

Usage:
    python benchmarks/unroll.py                        # WRN-28-2 b128 and the IWSLT transformer
    python benchmarks/unroll.py --models wrn-10-1 --batch-size 8 --image-size 8

Writes ``<out-dir>/unroll_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import jax

import lowmem_jax as lm
from lowmem_jax import workloads

UNROLLS = (False, True, None)
# Plans (lowmem analyze flags as Plan keywords): the precisions alone, microbatches, remat.
PLANS = {
    "fp32": {},
    "mixed_bf16": {"precision": "mixed_bf16"},
    "bf16": {"precision": "bf16"},
    "mixed_fp16": {"precision": "mixed_fp16"},
    "fp16": {"precision": "fp16"},
    "microbatches 4": {"microbatches": 4},
    "remat full": {"remat": "full"},
}
MODEL_PLANS = {"dynamicconv-iwslt": ("fp32", "microbatches 4", "remat full")}


def _mib(report: lm.analysis.memory.MemoryReport) -> float:
    return report.xla["total_bytes"] / 2**20


def measure(model: str, batch_size: int | None, image_size: int, plans: list[str]) -> dict:
    work = workloads.workload(model, batch_size, image_size=image_size)
    plain = _mib(workloads.build_plain(work).analyze())
    print(f"{model} plain: {plain:.1f} MiB", flush=True)
    rows = []
    for name in plans:
        plan = lm.Plan(**PLANS[name])
        totals = {}
        for unroll in UNROLLS:
            unrolled = dataclasses.replace(work, model=work.model.clone(unroll=unroll))
            totals[str(unroll)] = _mib(workloads.build(unrolled, plan).analyze())
        default = workloads.build(work, plan).model.unroll
        rows.append({"plan": name, "model_default": str(default), "total_mib": totals})
        print(f"{model} {name}: {totals} (default {default})", flush=True)
    return {"model": model, "batch_size": work.batch_size, "plain_mib": plain, "rows": rows}


def markdown(result: dict) -> str:
    lines = [
        f"# Scanned or unrolled block stacks ({result['backend_source']})",
        "",
        f"`{result['command']}`. Compile-only; XLA total MiB of the lowmem step with the model's "
        "`unroll` set to False (loops), True (straight-line) and None (straight-line unless "
        "remat'd or float16), each through `Plan.configure_model`; `plain` is the plain "
        "Flax/Optax step (unrolled, XLA's convolution). **Bold**: the model's default.",
        "",
    ]
    for m in result["models"]:
        lines += [
            f"## {m['model']}, batch {m['batch_size']} (plain: {m['plain_mib']:.1f} MiB)",
            "",
            "| plan | unroll=False | unroll=True | unroll=None | default / plain |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in m["rows"]:
            cells = [
                f"**{r['total_mib'][u]:.1f}**" if u == r["model_default"] else
                f"{r['total_mib'][u]:.1f}"
                for u in map(str, UNROLLS)
            ]  # fmt: skip
            ratio = r["total_mib"][r["model_default"]] / m["plain_mib"]
            lines.append(f"| {r['plan']} | {' | '.join(cells)} | {ratio:.3f} |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        names = [r["plan"] for r in m["rows"]]
        height = 0.8 / len(UNROLLS)
        for i, unroll in enumerate(map(str, UNROLLS)):
            ys = [j + i * height for j in range(len(names))]
            totals = [r["total_mib"][unroll] for r in m["rows"]]
            ax.barh(ys, totals, height, label=f"unroll={unroll}")
        ax.axvline(m["plain_mib"], color="k", ls="--", lw=1, label="plain")
        ax.set_yticks([j + height for j in range(len(names))], names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"compiled step total, MiB ({result['backend_source']})")
        ax.set_title(f"{m['model']}, batch {m['batch_size']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wrn-28-2,dynamicconv-iwslt")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="Default: each model's recipe batch"
    )
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--plans", default=",".join(PLANS), help="Default: %(default)s")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        parser.error(f"--plans: unknown {unknown}; choose from {list(PLANS)}")

    models = []
    for model in args.models.split(","):
        chosen = [p for p in plans if p in MODEL_PLANS.get(model, PLANS)]
        models.append(measure(model, args.batch_size, args.image_size, chosen))
    backend = jax.default_backend()
    result = {
        "command": " ".join(["python benchmarks/unroll.py", *sys.argv[1:]]),
        "backend_source": f"XLA:{backend.upper()}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jax_version": jax.__version__,
        "models": models,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"unroll_{backend}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, stem + ".png")
    print(f"wrote {stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
