"""Step time and FLOPs of the headline's rows against the plain step.

For each benchmark: the plain Flax/Optax step and every row the README's headline shows
(:func:`experiments.envelope_accuracy.headline_rows`), at the memory report's batch, each
compiled on a real state and a random batch of the workload's shapes; then ``--repeats`` rounds
that each time one step of every configuration in turn (:func:`experiments.rq3_compute.
time_interleaved`): a row's time ratio is taken within each round, and the median and range
over rounds are reported. Measured on the machine at hand (XLA:CPU here: half precision is not
faster on this backend, recomputation shows at full price). FLOPs: the memory report's jaxpr
count (loop bodies times their trip count) over the plain step's.

    python experiments/headline_cost.py [--repeats 5]

Writes ``experiments/results/envelope_accuracy/step_cost.json``; the README's headline table
(:func:`experiments.envelope_accuracy.headline_table`) reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.envelope_accuracy import OUT, REPORTS, TASKS, headline_rows  # noqa: E402
from experiments.memory_reports import MODELS, load_or_run_report  # noqa: E402
from experiments.rq3_compute import prepare, time_interleaved  # noqa: E402
from lowmem_jax.report.grid import model_grid  # noqa: E402

PATH = os.path.join(OUT, "step_cost.json")


def measure_task(task: str, repeats: int) -> list[dict]:
    """One entry per headline row of ``task``: time and FLOPs ratios to the plain step."""
    model = TASKS[task][0]
    batch_size, seq_len = MODELS[model][:2]
    report = load_or_run_report(model)
    with open(os.path.join(OUT, "accuracy.json")) as f:
        accuracy = json.load(f)["tasks"]
    names = [name for name, _ in headline_rows(task, report, accuracy)]
    plans = {name: plan for name, _, plan in model_grid(model, batch_size)}
    flops = {r["name"]: r["flops"] for r in report["configs"]}
    runs = []
    for name in ["plain", *names]:
        print(f"[{time.strftime('%H:%M:%S')}] {model}: compiling {name}", flush=True)
        runs.append(prepare(model, batch_size, plans[name], seq_len))
    rounds = time_interleaved(runs, repeats)
    rows = []
    for i, name in enumerate(names, start=1):
        ratios = [r[i] / r[0] for r in rounds]
        rows.append({
            "name": name,
            "time_ratio": statistics.median(ratios),
            "time_ratio_range": [min(ratios), max(ratios)],
            "step_seconds": statistics.median(r[i] for r in rounds),
            "plain_step_seconds": statistics.median(r[0] for r in rounds),
            "flops_ratio": flops[name] / flops["plain"],
        })  # fmt: skip
        print(f"    {name}: {rows[-1]['time_ratio']:.2f}x time, "
              f"{rows[-1]['flops_ratio']:.2f}x FLOPs", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--note", default="", help="a paragraph kept in the file (the machine, "
                        "what changed since the last measurement)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print(f"headline_cost.py: error: --repeats must be >= 1, got {args.repeats}",
              file=sys.stderr)  # fmt: skip
        return 2
    result = {
        "command": "python experiments/headline_cost.py"
        + ("" if args.repeats == 5 else f" --repeats {args.repeats}")
        + (" --note ..." if args.note else ""),  # the note is in the file itself
        **({"note": args.note} if args.note else {}),
        "repeats": args.repeats,
        "time_source": "measured steps, XLA:" + study.environment()["backend"].upper(),
        "flops_source": "jaxpr count of the memory report's step",
        "model_of_task": {task: TASKS[task][0] for task in REPORTS},
        "environment": study.environment(),
        "tasks": {task: measure_task(task, args.repeats) for task in REPORTS},
    }
    with open(PATH, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
