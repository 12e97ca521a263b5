"""What sits at the peak of the bundled models' steps, and what remat and the headline plans
remove from it (:mod:`lowmem_jax.analysis.inspector`, XLA's buffer assignment; compile-only).

For each benchmark, the rows of its committed memory report (``experiments/results/
memory_report*/report.json``, their ``lowmem analyze`` flags): the plain Flax/Optax step, the
report's baseline, remat full alone, and the two headline rows (the largest reduction inside the
report's accuracy envelope and outside it). Each row: the peak's bytes by category, its largest
buffers with their source lines, the reconciliation with XLA's total, and what it removed from
or added to the plain step's peak.

Usage: python benchmarks/inspect_report.py [--out-dir benchmarks/results/inspect] [--models ...]
Writes ``inspect_<backend>.json`` and ``inspect_<backend>.md``, and ``<model>_<row>.png``
timelines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax

from lowmem_jax.analysis import inspector
from lowmem_jax.cli.dispatch import build_parser
from lowmem_jax.compose.flags import plan_or_plain
from lowmem_jax.workloads import build, build_plain, workload

MIB = 2.0**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "inspect")
COMMAND = "python benchmarks/inspect_report.py"
#: model -> its committed memory report
REPORTS = {
    "wrn-28-2": "experiments/results/memory_report/report.json",
    "dynamicconv-iwslt": "experiments/results/memory_report_dynamicconv/report.json",
}


def rows(model: str) -> dict[str, list[str]]:
    """``{row: lowmem analyze argv}``: plain, baseline, remat full, the two headline rows."""
    with open(os.path.join(ROOT, REPORTS[model])) as f:
        report = json.load(f)
    argv = {c["name"]: c["argv"] for c in report["configs"]}
    names = ["plain", "baseline", "remat full", report["best_in_envelope"]["name"],
             report["best"]["name"]]  # fmt: skip
    return {name: argv[name] for name in names}


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


_COST_CHILD = """
import json, time, jax
from jax.experimental.compilation_cache import compilation_cache
jax.config.update("jax_enable_compilation_cache", False)
compilation_cache.reset_cache()
from lowmem_jax import inspector
from lowmem_jax.workloads import build_plain, workload
setup = build_plain(workload("wrn-28-2", 128))
args = (setup.abstract_state(), setup.abstract_batch())
start = time.perf_counter()
setup.step.lower(*args).compile()
compile_s = time.perf_counter() - start
start = time.perf_counter()
inspector.inspect(setup.step, *args)
print(json.dumps({"compile_s": compile_s, "inspect_s": time.perf_counter() - start}))
"""


def cost(repeats: int = 3) -> dict:
    """What inspecting the WRN-28-2 batch-128 plain step costs against compiling it: each in a
    fresh process (lower and compile with the persistent cache off, then ``inspect``: a second
    compile, with dumps, and the parsing), ``repeats`` times; medians."""
    import statistics
    import subprocess

    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _COST_CHILD], capture_output=True, text=True,
                             check=True)  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = [r["inspect_s"] / r["compile_s"] for r in runs]
    return {
        "what": "wrn-28-2 batch 128, plain step: lm.inspect time / compile time, fresh processes",
        "runs": runs,
        "median_compile_s": statistics.median(r["compile_s"] for r in runs),
        "median_inspect_s": statistics.median(r["inspect_s"] for r in runs),
        "median_ratio": statistics.median(ratios),
    }


def run(out_dir: str, models: list[str]) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    result = {"command": COMMAND, "backend": jax.default_backend(), "models": {}}
    for model in models:
        entry = {"rows": {}}
        plain = None
        for name, argv in rows(model).items():
            args = build_parser().parse_args(["analyze", *argv])
            plan = plan_or_plain(args)
            work = workload(args.model, args.batch_size, seq_len=args.seq_len)
            setup = build_plain(work) if plan is None else build(work, plan)
            found = inspector.inspect(setup.step, setup.abstract_state(), setup.abstract_batch())
            slug = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
            found.plot(
                os.path.join(out_dir, f"{model}_{slug}.png"),
                f"{model}, batch {work.batch_size}: {name}",
            )
            entry["batch_size"] = work.batch_size
            entry["rows"][name] = {"argv": argv, **_summary(found)}
            if plain is None:
                plain = found
            else:
                entry["rows"][name]["compare_to_plain"] = inspector.compare(plain, found)
            print(model, name, f"{found.peak_bytes / MIB:.1f} MiB", flush=True)
        result["models"][model] = entry
    return result


def markdown(result: dict) -> str:
    lines = [
        "# What sits at the peak",
        "",
        f"Made by `{result['command']}` (XLA:{result['backend'].upper()}, compile-only: XLA's "
        "buffer assignment and live ranges, read by `lm.inspect` / `lowmem inspect`). Peak: the "
        "most bytes live at once in the compiled step's schedule, against XLA's total "
        "(`memory_analysis()`: argument + output + temp - alias); categories as "
        "`lowmem_jax.analysis.inspector` defines them (MiB).",
        "",
    ]
    if "cost" in result:
        c = result["cost"]
        lines += [
            f"Cost ({c['what']}, medians of {len(c['runs'])}): compile {c['median_compile_s']:.1f} "
            f"s, inspect {c['median_inspect_s']:.1f} s: {c['median_ratio']:.2f}x.",
            "",
        ]
    for model, entry in result["models"].items():
        table = entry["rows"]
        shown = [c for r in table.values() for c, v in r["by_category"].items() if v >= MIB / 20]
        cats = [c for c in inspector.CATEGORIES if c in shown]
        lines += [
            f"## {model}, batch {entry['batch_size']}",
            "",
            "| row | peak | XLA total | peak / total | " + " | ".join(cats) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(cats),
        ]
        for name, r in table.items():
            total = r["xla"]["total_bytes"]
            lines.append(
                f"| {name} | {r['peak_bytes'] / MIB:.1f} | {total / MIB:.1f} | "
                f"{r['peak_bytes'] / total:.1%} | "
                + " | ".join(f"{r['by_category'].get(c, 0) / MIB:.1f}" for c in cats)
                + " |"
            )
        lines.append("")
        for name, r in table.items():
            if "compare_to_plain" not in r:
                continue
            change = r["compare_to_plain"]
            lines += [f"**{name}** against plain: " + "; ".join(change["sentences"]) + ".", ""]
            lines += ["| MiB | buffers | source line |", "|---:|---:|---|"]
            lines += [f"| {s['bytes'] / MIB:+.1f} | {s['buffers']:+d} | `{s['key']}` |"
                      for s in change["sources"][:5]]  # fmt: skip
            lines.append("")
        for name, r in table.items():
            lines += [f"{name}: largest buffers at the peak ({r['peak_instruction'][:80]}):", "",
                      "| MiB | category | shape | source |", "|---:|---|---|---|"]  # fmt: skip
            for b in r["top_buffers"][:5]:
                where = b["source"] or b["op_name"]
                lines.append(f"| {b['counted_bytes'] / MIB:.1f} | {b['category']} | "
                             f"`{b['shape']}` | `{where}` |")  # fmt: skip
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=OUT)
    parser.add_argument("--models", default=",".join(REPORTS))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = sorted(set(models) - set(REPORTS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed values: {list(REPORTS)}")
    result = run(args.out_dir, models)
    result["cost"] = cost()
    stem = os.path.join(args.out_dir, f"inspect_{result['backend']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
