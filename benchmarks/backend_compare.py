"""The same configurations compiled by XLA:CPU and XLA:GPU: how well the CPU figures predict.

Reads a GPU run of :mod:`gpu_validate` (``validate_gpu.json``) and the committed memory reports
(``lowmem report`` JSON, compiled on CPU) and writes, per model, every configuration both have:
XLA:CPU total, XLA:GPU total, their ratio, each backend's reduction against its own ``plain``,
and the GPU's runtime peak where the step set it.

Usage::

    python benchmarks/backend_compare.py          # the committed files, defaults below

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/validate_gpu_vs_cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.validate_results import MIB, step_raised_peak  # noqa: E402

GPU = "benchmarks/results/validate_gpu.json"
REPORTS = ("experiments/results/memory_report/report.json",
           "experiments/results/memory_report_dynamicconv/report.json")  # fmt: skip
OUT = "benchmarks/results/validate_gpu_vs_cpu"


def compare(gpu: dict[str, Any], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per model both sides have: ``{"model", "rows": [...]}``."""
    by_model = {r["model"]: r for r in reports}
    out = []
    for model in gpu["models"]:
        report = by_model.get(model["model"])
        if report is None or report["batch_size"] != model["batch_size"]:
            continue
        cpu = {c["name"]: c["xla"]["total_bytes"] for c in report["configs"]}
        gpu_rows = {c["name"]: c for c in model["configs"] if "error" not in c}
        cpu_plain, gpu_plain = cpu.get("plain"), gpu_rows.get("plain")
        rows = []
        for name, row in gpu_rows.items():
            if name not in cpu:
                continue
            total = row["xla"]["total_bytes"]
            raised = step_raised_peak(row)
            rows.append({
                "name": name,
                "cpu_total_bytes": cpu[name],
                "gpu_total_bytes": total,
                "gpu_over_cpu": total / cpu[name],
                "reduction_cpu": cpu_plain / cpu[name] if cpu_plain else None,
                "reduction_gpu": gpu_plain["xla"]["total_bytes"] / total if gpu_plain else None,
                "gpu_runtime_peak_bytes": row["runtime_peak_bytes"] if raised else None,
            })  # fmt: skip
        out.append({"model": model["model"], "batch_size": model["batch_size"], "rows": rows})
    return out


def to_markdown(models: list[dict[str, Any]], device: str, command: str) -> str:
    def cell(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [
        f"# XLA:CPU against XLA:GPU ({device}): compiled step totals",
        "",
        "Total = argument + output + temp - alias, as each backend's compiler reports it for "
        "the same step; reductions are against each backend's own `plain` row. The runtime "
        "peak is the GPU's `peak_bytes_in_use`, shown only where the step set it.",
        "",
        f"Made by: `{command}`",
    ]
    for model in models:
        lines += [
            "",
            f"## `{model['model']}`, batch {model['batch_size']}",
            "",
            "| config | XLA:CPU MiB | XLA:GPU MiB | GPU / CPU | reduction (CPU), x "
            "| reduction (GPU), x | GPU runtime peak MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in model["rows"]:
            peak = r["gpu_runtime_peak_bytes"]
            lines.append(
                f"| {r['name']} | {r['cpu_total_bytes'] / MIB:.1f} | "
                f"{r['gpu_total_bytes'] / MIB:.1f} | {r['gpu_over_cpu']:.2f} | "
                f"{cell(r['reduction_cpu'], '.2f')} | {cell(r['reduction_gpu'], '.2f')} | "
                f"{cell(peak and peak / MIB, '.1f')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default=GPU, help=f"a GPU validate JSON (default: {GPU})")
    parser.add_argument("--reports", default=",".join(REPORTS), help="comma-separated reports")
    parser.add_argument("--out", default=OUT, help=f"output stem (default: {OUT})")
    args = parser.parse_args(argv)
    for path in [args.gpu, *args.reports.split(",")]:
        if not os.path.isfile(path):
            print(f"backend_compare.py: error: no such file: {path}", file=sys.stderr)
            return 2
    with open(args.gpu) as f:
        gpu = json.load(f)
    reports = []
    for path in args.reports.split(","):
        with open(path) as f:
            reports.append(json.load(f))
    models = compare(gpu, reports)
    command = "python benchmarks/backend_compare.py" + "".join(f" {a}" for a in (argv or []))
    result = {"device": gpu["device"], "gpu": args.gpu, "reports": args.reports.split(","),
              "command": command, "models": models}  # fmt: skip
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(models, gpu["device"], command))
    print(f"wrote {args.out}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
