"""RQ3: what does each technique cost in computation?

Two figures per technique, both as ratios to the fp32 baseline without any technique:

- FLOPs per step, counted from the jaxpr (loop bodies times their trip count, remat
  recomputation included), from the full-size memory reports (:mod:`experiments.memory_reports`).
- Measured step time on the machine at hand: real steps on random data of the workload's
  shapes, every configuration compiled first, then ``--repeats`` rounds that each time one step
  of every configuration in turn; the ratio to the baseline is taken within each round and
  its median reported with its range. On CPU this is XLA:CPU's speed, not a GPU's: fp16/bf16
  do not run faster here and remat's recomputation shows at full price.

Usage:
    python experiments/rq3_compute.py                               # both models
    python experiments/rq3_compute.py --models wrn-28-2 --repeats 5
    python experiments/rq3_compute.py --models dynamicconv-iwslt --batch-size 25

Writes ``experiments/results/rq3/compute_<model>.json`` and ``compute.{md,png}`` (all models
measured so far).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.memory_reports import MODELS, load_or_run_report  # noqa: E402
from lowmem_jax.report.grid import divisor_at_most, standard_grid  # noqa: E402
from lowmem_jax.workloads import build, build_plain, workload  # noqa: E402

OUT = os.path.join(study.RESULTS, "rq3")


def timed_rows(batch_size: int, saved_name: str) -> list:
    """The single-technique rows of the standard grid whose step time is measured."""
    wanted = {
        "baseline",
        "mixed_fp16",
        "mixed_bf16",
        "remat dots",
        "remat full",
        "remat sqrt",
        "sparse 90% dsr",
        f"microbatch {divisor_at_most(batch_size, batch_size / 4)}",
        f"microbatch {divisor_at_most(batch_size, batch_size / 16)}",
    }
    return [row for row in standard_grid(batch_size, saved_name) if row[0] in wanted]


def prepare(model: str, batch_size: int, plan, seq_len: int) -> dict:
    """Compiles one configuration's step on a real state and batch; runs one warm-up step.
    ``plan`` ``None``: the plain Flax/Optax step."""
    work = workload(model, batch_size, seq_len=seq_len)
    setup = build_plain(work) if plan is None else build(work, plan)
    batch = setup.example_batch()
    state = setup.init_state(batch)
    start = time.perf_counter()
    compiled = setup.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, _ = compiled(state, batch)  # warm-up
    jax.block_until_ready(state)
    return {"compiled": compiled, "state": state, "batch": batch, "compile_seconds": compile_s}


def time_once(run: dict) -> float:
    """One timed step of a prepared configuration (its state advances)."""
    start = time.perf_counter()
    run["state"], _ = run["compiled"](run["state"], run["batch"])
    jax.block_until_ready(run["state"])
    return time.perf_counter() - start


def time_step(model: str, batch_size: int, plan, repeats: int, seq_len: int) -> dict:
    """Median step time of one configuration (for a pair, prefer :func:`time_interleaved`)."""
    run = prepare(model, batch_size, plan, seq_len)
    times = [time_once(run) for _ in range(repeats)]
    return {
        "compile_seconds": run["compile_seconds"],
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
    }


def time_interleaved(runs: list[dict], repeats: int) -> list[list[float]]:
    """``repeats`` rounds, each timing one step of every prepared run in turn: a change in the
    machine's load hits all configurations of a round alike (ratios are taken per round)."""
    rounds = []
    for _ in range(repeats):
        rounds.append([time_once(run) for run in runs])
    return rounds


def measure_model(model: str, batch_size: int, repeats: int, seq_len: int = 40) -> dict:
    saved = "dot_out" if model.startswith("dynamicconv") else "conv_out"
    report = load_or_run_report(model)
    flops = {r["name"]: r["flops_overhead"] for r in report["configs"]}
    grid = timed_rows(batch_size, saved)
    runs = []
    for name, _, plan in grid:
        print(f"[{time.strftime('%H:%M:%S')}] {model} b{batch_size}: compiling {name}", flush=True)
        runs.append(prepare(model, batch_size, plan, seq_len))
    rounds = time_interleaved(runs, repeats)
    rows = []
    for i, (name, group, _) in enumerate(grid):
        times = [r[i] for r in rounds]
        ratios = [r[i] / r[0] for r in rounds]
        rows.append(
            {
                "name": name,
                "group": group,
                "flops_overhead": flops.get(name),
                "compile_seconds": runs[i]["compile_seconds"],
                "step_seconds": statistics.median(times),
                "step_seconds_all": times,
                "time_ratio": statistics.median(ratios),
                "time_ratio_range": [min(ratios), max(ratios)],
            }
        )
        print(
            f"    {name}: {rows[-1]['step_seconds']:.3f} s/step, {rows[-1]['time_ratio']:.2f}x",
            flush=True,
        )
    return {
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "repeats": repeats,
        **study.environment(),
        "flops_source": f"jaxpr count, memory report at batch {report['batch_size']}",
        "rows": rows,
    }


def write_summary() -> None:
    results = []
    for fname in sorted(os.listdir(OUT)):
        if fname.startswith("compute_") and fname.endswith(".json"):
            with open(os.path.join(OUT, fname)) as f:
                results.append(json.load(f))
    lines = [
        "# RQ3: the compute cost of each technique",
        "",
        "FLOPs: counted from the jaxpr of the full-size step (analytic). Time: measured "
        "steps, every row in the same run as its baseline, on the machine named below "
        "(XLA:CPU here: half precision is not faster on this backend and the cores were "
        "shared, so treat time ratios as +-15%).",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['model']}, batch {res['batch_size']} ({res['backend']}, JAX "
            f"{res['jax_version']}, median of {res['repeats']} steps)",
            "",
            f"Command: `{res['command']}`",
            "",
            "| config | technique | FLOPs / baseline | step s | time / baseline | compile s |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in res["rows"]:
            fl = "-" if r["flops_overhead"] is None else f"{r['flops_overhead']:.2f}x"
            lo, hi = r.get("time_ratio_range", (r["time_ratio"], r["time_ratio"]))
            lines.append(
                f"| {r['name']} | {r['group']} | {fl} | {r['step_seconds']:.3f} | "
                f"{r['time_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | {r['compile_seconds']:.0f} |"
            )
        lines.append("")
    lines.append("![compute](compute.png)")
    with open(os.path.join(OUT, "compute.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(results), 1)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    for ax, res in zip(axes[0], results, strict=False):
        for r in res["rows"]:
            x = r["flops_overhead"] or 1.0
            ax.scatter(x, r["time_ratio"], s=30)
            ax.annotate(
                r["name"],
                (x, r["time_ratio"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.axhline(1, color="k", lw=0.5)
        ax.axvline(1, color="k", lw=0.5)
        ax.set_xlabel("FLOPs / baseline (jaxpr count)")
        ax.set_ylabel(f"measured step time / baseline ({res['backend']})")
        ax.set_title(f"{res['model']}, batch {res['batch_size']}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "compute.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="Default: %(default)s")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="Default: the memory report's (128 / 100 x 40 tokens)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="Default: %(default)s")
    parser.add_argument("--summarize", action="store_true", help="only rewrite compute.md/png")
    args = parser.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    command = "python experiments/rq3_compute.py " + " ".join(argv or sys.argv[1:])
    if not args.summarize:
        for model in args.models.split(","):
            if model not in MODELS:
                parser.error(f"--models: unknown {model!r}; allowed values: {list(MODELS)}")
            batch = args.batch_size or MODELS[model][0]
            result = measure_model(model, batch, args.repeats)
            result["command"] = command.strip()
            with open(os.path.join(OUT, f"compute_{model}.json"), "w") as f:
                json.dump(result, f, indent=1)
    write_summary()
    print(open(os.path.join(OUT, "compute.md")).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
