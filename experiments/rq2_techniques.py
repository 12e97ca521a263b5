"""RQ2: what does each technique alone do to memory and to accuracy?

Memory (compile-only, full-size models): the single-technique rows of the memory reports of
WRN-28-2 (batch 128) and the DynamicConv Transformer (IWSLT preset, 100 x 40 tokens), made by
``lowmem report`` (:func:`lowmem_jax.report.run.run_report`); they are computed here if missing.

Accuracy (CPU scale, several seeds): every technique alone on the two CPU tasks of
:mod:`experiments.study` (WRN-16-2 on digits, the small DynamicConv Transformer on synthetic
reversal), paired with the baseline of the same seed.

Usage (from the repository root, package installed):
    python experiments/rq2_techniques.py                       # both parts, both tasks, seeds 0-2
    python experiments/rq2_techniques.py --part accuracy --task digits --seeds 0,1,2,3,4
    python experiments/rq2_techniques.py --part memory
    python experiments/rq2_techniques.py --summarize           # rewrite tables from runs/

Writes ``experiments/results/rq2/{digits,translation}/`` (runs/, accuracy.{json,md,png}) and
``experiments/results/rq2/memory.{json,md}``. Interrupted runs resume: rerun the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.memory_reports import MODELS, load_or_run_report  # noqa: E402

OUT = os.path.join(study.RESULTS, "rq2")
MIB = 2.0**20


def write_accuracy(task: str, out_dir: str, command: str) -> dict:
    rows = study.summarize(study.load_runs(out_dir))
    order = {v.name: i for i, v in enumerate(study.single_variants(task))}
    rows.sort(key=lambda r: order.get(r["name"], len(order)))
    base = study.base_config(task, 0)
    result = {
        "task": task,
        "command": command,
        **study.environment(),
        "baseline_config": repr(base),
        "rows": rows,
    }
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    doc = f"Task: {study.TASK_NOTES[task]}"
    with open(os.path.join(out_dir, "accuracy.md"), "w") as f:
        f.write(f"# RQ2 accuracy: each technique alone, {task} (CPU scale)\n\n")
        f.write(
            f"Command: `{command}`\n\nBackend {result['backend']}, JAX {result['jax_version']}."
            f" Baseline: `{repr(base)}`.\n\n{doc}\n\n"
        )
        f.write(study.accuracy_table(rows, task))
        f.write(
            "\nPaired delta: the variant minus the baseline trained with the same seed "
            "(same data split and initialisation), over seeds.\n"
        )
        f.write("\n![accuracy deltas](accuracy.png)\n")
    study.plot_accuracy(rows, task, os.path.join(out_dir, "accuracy.png"))
    return result


def memory_rows(report: dict) -> list[dict]:
    """The baseline and single-technique rows of a memory report, with their reductions."""
    return [r for r in report["configs"] if r["group"] != "combined"]


def write_memory(reports: dict[str, dict], command: str) -> None:
    os.makedirs(OUT, exist_ok=True)
    lines = [
        "# RQ2 memory: each technique alone (full-size models, compile-only)",
        "",
        f"Command: `{command}`. XLA figures are XLA:CPU compiled totals (argument + output "
        "+ temp - alias); analytic = model + optimizer + saved activations + inputs. "
        "Reductions against the baseline of the same report.",
        "",
    ]
    out = {}
    for model, report in reports.items():
        rows = memory_rows(report)
        out[model] = [
            {
                k: r[k]
                for k in ("name", "group", "reduction_xla", "reduction_analytic", "flops_overhead")
            }
            | {
                "xla_total_bytes": r["xla"]["total_bytes"],
                "analytic_total_bytes": r["analytic"]["total_bytes"],
            }
            for r in rows
        ]
        lines += [
            f"## {model}, batch {report['batch_size']}",
            "",
            "| config | technique | XLA:CPU total MiB | reduction (XLA:CPU) | analytic MiB "
            "| reduction (analytic) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in out[model]:
            lines.append(
                f"| {r['name']} | {r['group']} | {r['xla_total_bytes'] / MIB:.1f} | "
                f"{r['reduction_xla']:.2f}x | {r['analytic_total_bytes'] / MIB:.1f} | "
                f"{r['reduction_analytic']:.2f}x |"
            )
        lines.append("")
    with open(os.path.join(OUT, "memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(OUT, "memory.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "memory", "accuracy"), default="all")
    parser.add_argument("--task", choices=("both", *study.TASKS), default="both")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated. Default: %(default)s")
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the tables")
    args = parser.parse_args(argv)
    command = "python experiments/rq2_techniques.py " + " ".join(argv or sys.argv[1:])
    tasks = study.TASKS if args.task == "both" else (args.task,)
    if args.part in ("all", "memory") and not args.summarize:
        write_memory({m: load_or_run_report(m) for m in MODELS}, command.strip())
    if args.part in ("all", "accuracy"):
        seeds = [int(s) for s in args.seeds.split(",")]
        for task in tasks:
            out_dir = os.path.join(OUT, task)
            variants = study.single_variants(task)
            if args.only:
                unknown = set(args.only.split(",")) - {v.name for v in variants}
                if unknown:
                    parser.error(
                        f"--only: unknown {sorted(unknown)}; allowed: {[v.name for v in variants]}"
                    )
                variants = [v for v in variants if v.name in args.only.split(",")]
            if not args.summarize:
                study.run_variants(task, variants, seeds, out_dir)
            if study.load_runs(out_dir):
                write_accuracy(task, out_dir, command.strip())
                print(f"wrote {out_dir}/accuracy.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
