"""What sits at the peak of the bundled models' steps, and what remat and the headline plans
remove from it (:mod:`lowmem_jax.inspector`, XLA's buffer assignment; compile-only).

For each model, the plain Flax/Optax step and each plan in ``PLANS``: the peak's bytes by
category, its largest buffers with their source lines, the reconciliation with XLA's total, and
what the plan removed from or added to the plain step's peak. The WRN-28-2 plans are the
committed report's (``experiments/results/report``): remat alone, and the combined rows.

Usage: python benchmarks/inspect_report.py [--out-dir benchmarks/results/inspect]
Writes ``inspect_<backend>.json`` and ``inspect_<backend>.md``, and ``<model>_<plan>.png``
timelines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from lowmem_jax import inspector
from lowmem_jax.plan_flags import analyze_argv, plan_from_args
from lowmem_jax.workloads import build, build_plain, workload

MIB = 2.0**20
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "inspect")
COMMAND = "python benchmarks/inspect_report.py"
#: model -> (batch size, {name: plan flags})
PLANS = {
    "wrn-28-2": (128, {
        "remat full": "--remat full",
        "int8 state": "--optimizer-state int8",
        "fp16 + mb 4 + remat + int8": (
            "--precision fp16 --loss-scale dynamic --microbatches 4 --remat full "
            "--optimizer-state int8"
        ),
    }),
}  # fmt: skip


def _plan(flags: str):
    import shlex

    from lowmem_jax.cli import build_parser

    args = build_parser().parse_args(["analyze", *shlex.split(flags)])
    return plan_from_args(args, __import__("lowmem_jax").Plan())


def _summary(found: inspector.Inspection, top: int = 12) -> dict:
    return {
        "peak_bytes": found.peak_bytes,
        "peak_position": found.peak_position,
        "positions": found.positions,
        "peak_instruction": found.peak_instruction,
        "xla": found.xla,
        "reconciliation": found.reconciliation,
        "by_category": found.by_category(),
        "by_source": dict(list(found.by_source().items())[:top]),
        "top_buffers": [
            {k: getattr(b, k) for k in ("counted_bytes", "category", "shape", "source", "op_name")}
            for b in found.buffers[:top]
        ],
    }


def run(out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    result = {"command": COMMAND, "backend": jax.default_backend(), "models": {}}
    for model, (batch, plans) in PLANS.items():
        work = workload(model, batch)
        plain_setup = build_plain(work)
        plain = inspector.inspect(
            plain_setup.step, plain_setup.abstract_state(), plain_setup.abstract_batch()
        )
        plain.plot(os.path.join(out_dir, f"{model}_plain.png"), f"{model}, batch {batch}: plain")
        entry = {"batch_size": batch, "plain": _summary(plain), "plans": {}}
        for name, flags in plans.items():
            plan = _plan(flags)
            setup = build(work, plan)
            found = inspector.inspect(setup.step, setup.abstract_state(), setup.abstract_batch())
            slug = name.replace(" + ", "_").replace(" ", "_")
            found.plot(
                os.path.join(out_dir, f"{model}_{slug}.png"), f"{model}, batch {batch}: {name}"
            )
            entry["plans"][name] = {
                "flags": analyze_argv(model, batch, plan),
                **_summary(found),
                "compare_to_plain": inspector.compare(plain, found),
            }
            print(model, name, f"{found.peak_bytes / MIB:.1f} MiB", flush=True)
        result["models"][model] = entry
    return result


def markdown(result: dict) -> str:
    lines = [
        "# What sits at the peak",
        "",
        f"Made by `{result['command']}` (XLA:{result['backend'].upper()}, compile-only: XLA's "
        "buffer assignment and live ranges, read by `lm.inspect` / `lowmem inspect`). Peak: the "
        "most bytes live at once in the compiled step's schedule; categories as "
        "`lowmem_jax.inspector` defines them.",
        "",
    ]
    for model, entry in result["models"].items():
        rows = [("plain", entry["plain"])] + list(entry["plans"].items())
        cats = [c for c in inspector.CATEGORIES if any(r["by_category"].get(c, 0) for _, r in rows)]
        lines += [
            f"## {model}, batch {entry['batch_size']}",
            "",
            "| step | peak MiB | XLA total MiB | " + " | ".join(cats) + " |",
            "|---|---|---|" + "---|" * len(cats),
        ]
        for name, r in rows:
            lines.append(
                f"| {name} | {r['peak_bytes'] / MIB:.1f} | {r['xla']['total_bytes'] / MIB:.1f} | "
                + " | ".join(f"{r['by_category'].get(c, 0) / MIB:.1f}" for c in cats)
                + " |"
            )
        lines.append("")
        for name, r in entry["plans"].items():
            change = r["compare_to_plain"]
            lines += [f"**{name}** against plain: " + "; ".join(change["sentences"]) + ".", ""]
            lines += ["| MiB | buffers | source line |", "|---|---|---|"]
            lines += [f"| {s['bytes'] / MIB:+.1f} | {s['buffers']:+d} | `{s['key']}` |"
                      for s in change["sources"][:5]]  # fmt: skip
            lines.append("")
        top = entry["plain"]["top_buffers"][:5]
        lines += ["Plain step, largest buffers at the peak:", "",
                  "| MiB | category | shape | source |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {b['counted_bytes'] / MIB:.1f} | {b['category']} | `{b['shape']}` | "
                  f"`{b['source'] or b['op_name']}` |" for b in top]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=OUT)
    args = parser.parse_args(argv)
    result = run(args.out_dir)
    stem = os.path.join(args.out_dir, f"inspect_{result['backend']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
