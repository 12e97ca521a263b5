"""`lowmem plan` against exhaustive search: every plan of a reduced space compiled.

    python benchmarks/plan_exhaustive.py --out-dir benchmarks/results

Per workload (WRN-10-1 and a three-layer DynamicConv transformer, batch 16: three blocks each,
so all 3^3 per-block remat schedules can be compiled), every plan of :data:`SPACE` (each
schedule x precision x microbatches x sparsity) is compiled and its FLOPs counted from the
jaxpr. For budgets from the fp32 step's compiled total down to the least total of the space,
the exhaustive answer is the plan with the fewest FLOPs whose compiled total fits, and the
planner's is :func:`lowmem_jax.planning.planner.plan_for_budget` on the same space (the report
envelope). The transformer's flags name ``dynamicconv-small``: its kernel sizes are set
here. Writes ``plan_exhaustive_<models>_<backend>.{json,md,png}`` (one process per model
runs them side by side).

The compiles go through JAX's persistent compilation cache (``--cache-dir``, default a new
temporary directory), so the planner's compiles of a plan the exhaustive pass compiled are cache
hits (its wall time is not the point here; ``plan_budgets.py`` times the planner as a user runs
it). Given a cache directory that an earlier run filled, a re-run (say, after a planner change)
reads every compile back.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time

import jax

from lowmem_jax.analysis import memory
from lowmem_jax.analysis.flops import count_flops
from lowmem_jax.blocks.policy import schedule_name
from lowmem_jax.compose.plan import Plan
from lowmem_jax.planning import planner
from lowmem_jax.planning.search import plan_of
from lowmem_jax.workloads import Workload, build, workload
from lowmem_jax.workloads.flags import analyze_argv

MIB = 2.0**20

#: The searched settings per model besides the schedules (the planner gets the same, with
#: ``blocks`` for them). The transformer's sparse steps take ~3x as long to compile on 2 CPU
#: cores, so its space is dense.
SPACES = {
    "wrn-10-1": {
        "factorize": (None,),
        "precision": ("fp32", "mixed_fp16"),
        "microbatches": (1, 2),
        "sparsity": (0.0, 0.7),
        "optimizer_state": ("auto",),
    },
    "dynamicconv-small-3": {
        "factorize": (None,),
        "precision": ("fp32", "mixed_fp16"),
        "microbatches": (1, 2),
        "sparsity": (0.0,),
        "optimizer_state": ("auto",),
    },
}


def workloads(batch: int) -> dict[str, Workload]:
    return {
        "wrn-10-1": workload("wrn-10-1", batch),
        # dynamicconv-small with one encoder layer fewer and two decoder layers fewer: blocks
        # [1, 1] + [1] (each run of equal kernel sizes is a stack).
        "dynamicconv-small-3": workload(
            "dynamicconv-small", batch, encoder_kernel_sizes=(3, 5), decoder_kernel_sizes=(3,)
        ),
    }


def every_plan(work: Workload, space: dict[str, tuple]) -> list:
    """Every plan of ``space``: all per-block schedules (uniform ones by their names)."""
    blocks = sum(work.model.block_stacks())
    remats = [
        p[0] if len(set(p)) == 1 else schedule_name(p)
        for p in itertools.product(("none", "dots", "full"), repeat=blocks)
    ]
    plans = []
    for remat, precision, micro, sparsity, state in itertools.product(
        remats, space["precision"], space["microbatches"], space["sparsity"],
        space["optimizer_state"],
    ):  # fmt: skip
        plans.append(plan_of({"remat": remat, "precision": precision, "microbatches": micro,
                              "sparsity": sparsity, "optimizer_state": state}))  # fmt: skip
    return plans


def measure(work: Workload, plan) -> dict:
    setup = build(work, plan)
    state = setup.abstract_state()
    xla = memory.xla_memory(setup.step.lower(state, work.batch).compile())
    flops = count_flops(getattr(setup.step, "__wrapped__", setup.step), state, work.batch)[0]
    return {"xla_total_bytes": xla["total_bytes"], "flops": flops}


def budgets(baseline: int, least: int, count: int) -> list[int]:
    """``count`` budgets from ``baseline`` down to ``least``, evenly in log space."""
    ratio = least / baseline
    return [int(baseline * ratio ** (i / (count - 1))) for i in range(count - 1)] + [least]


def compare(name: str, work: Workload, count: int, log) -> dict:
    space = SPACES[name]
    plans = every_plan(work, space)
    start = time.perf_counter()
    rows = []
    for i, plan in enumerate(plans):
        rows.append({"plan": plan, "argv": analyze_argv(work.name, work.batch_size, plan, 40),
                     **measure(work, plan)})  # fmt: skip
        log(
            f"{name} {i + 1}/{len(plans)} ({time.perf_counter() - start:.0f} s): "
            f"{' '.join(rows[-1]['argv'][4:]) or '(none)'}: "
            f"{rows[-1]['xla_total_bytes'] / MIB:.3f} MiB, FLOPs {rows[-1]['flops']:.4g}"
        )
    exhaustive_seconds = time.perf_counter() - start
    reference = next(r for r in rows if r["plan"] == Plan())
    least = min(r["xla_total_bytes"] for r in rows)
    space = {**space, "remat": ("none", "dots", "full", "blocks")}
    out = []
    for budget in budgets(reference["xla_total_bytes"], least, count):
        fits = [r for r in rows if r["xla_total_bytes"] <= budget]
        best = min(fits, key=lambda r: r["flops"])
        t = time.perf_counter()
        try:
            answer = planner.plan_for_budget(work, budget, envelope="report", space=space)
        except planner.NoPlanFits as err:  # a miss: the exhaustive search found one that fits
            answer, missed = None, str(err)
        seconds = time.perf_counter() - t
        got = None
        if answer is not None:
            compiles = sum(c["xla_total_bytes"] is not None for c in answer.considered)
            got = {"argv": answer.argv, "xla_total_bytes": answer.xla["total_bytes"],
                   "flops": answer.flops, "seconds": seconds, "compiles": compiles}  # fmt: skip
        out.append({
            "budget_bytes": budget,
            "plans_that_fit": len(fits),
            "exhaustive": {k: best[k] for k in ("argv", "xla_total_bytes", "flops")},
            "planner": got,
            "planner_error": None if answer is not None else missed,
            "flops_over_exhaustive": None if got is None else got["flops"] / best["flops"],
        })  # fmt: skip
        ratio = out[-1]["flops_over_exhaustive"]
        said = "found no plan" if ratio is None else f"{ratio:.4f} of the exhaustive best"
        log(f"{name} {budget / MIB:.2f} MiB: planner {said}")
    return {
        "model": name,
        "batch_size": work.batch_size,
        "block_stacks": work.model.block_stacks(),
        "space": {k: [str(v) for v in vs] for k, vs in space.items()},
        "plans": len(rows),
        "exhaustive_seconds": exhaustive_seconds,
        "reference_flops": reference["flops"],
        "all": [{k: r[k] for k in ("argv", "xla_total_bytes", "flops")} for r in rows],
        "budgets": out,
    }


def table(results: list[dict], backend: str) -> str:
    source = f"XLA:{backend.upper()}"
    models = " ".join(r["model"] for r in results)
    lines = [
        f"# `lowmem plan` against exhaustive search ({source})",
        "",
        f"Command: `python benchmarks/plan_exhaustive.py --models {models}` "
        "(every plan of the space compiled: all 27 per-block remat schedules x precision "
        "fp32 / mixed_fp16 x microbatches 1 / 2, sparsity 0 / 70% (DSR, compressed) for the "
        "WRN, 0 for the transformer, optimizer state auto; the planner searches the same "
        "space in the report envelope, its schedules those of its dynamic program). FLOPs "
        "counted from the jaxpr; ratio = the planner's FLOPs / the exhaustive best's.",
        "",
        f"| model | budget MiB | fit | exhaustive best | its FLOPs / fp32 | planner's answer | "
        f"{source} MiB | FLOPs / exhaustive |",
        "|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for res in results:
        for b in res["budgets"]:
            best, got = b["exhaustive"], b["planner"]
            if got is None:
                got = {"argv": ["", "", "", "", "MISS: no plan found"], "xla_total_bytes": 0}
            ratio = b["flops_over_exhaustive"]
            lines.append(
                f"| {res['model']} b{res['batch_size']} | {b['budget_bytes'] / MIB:.2f} | "
                f"{b['plans_that_fit']} | `{' '.join(best['argv'][4:]) or '(none)'}` | "
                f"{best['flops'] / res['reference_flops']:.3f} | "
                f"`{' '.join(got['argv'][4:]) or '(none)'}` | "
                f"{got['xla_total_bytes'] / MIB:.2f} | {'-' if ratio is None else f'{ratio:.4f}'} |"
            )
    ratios = [b["flops_over_exhaustive"] for r in results for b in r["budgets"]]
    found = [x for x in ratios if x is not None]
    lines += ["", f"Worst ratio: {max(found, default=float('nan')):.4f}; budgets with no "
              f"answer from the planner: {len(ratios) - len(found)} of {len(ratios)}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        ref = res["reference_flops"]
        ax.scatter([r["flops"] / ref for r in res["all"]],
                   [r["xla_total_bytes"] / MIB for r in res["all"]], s=8, color="C0",
                   alpha=0.5, label="every plan (compiled)")  # fmt: skip
        answers = [b["planner"] for b in res["budgets"] if b["planner"] is not None]
        ax.scatter([a["flops"] / ref for a in answers],
                   [a["xla_total_bytes"] / MIB for a in answers], marker="*",
                   s=120, color="C3", label="planner's answers")  # fmt: skip
        for b in res["budgets"]:
            ax.axhline(b["budget_bytes"] / MIB, color="k", lw=0.5, ls=":")
        ax.set_title(f"{res['model']} b{res['batch_size']}", fontsize=10)
        ax.set_xlabel("FLOPs / fp32 step (jaxpr)")
        ax.set_ylabel("compiled total MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--budgets", type=int, default=6, help="budgets per model (>= 2)")
    parser.add_argument("--models", nargs="+", default=list(SPACES), choices=list(SPACES))
    parser.add_argument(
        "--cache-dir",
        default="",
        help="JAX's persistent compilation cache (default: a new temporary one)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="plan_exhaustive_")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    backend = jax.default_backend()
    works = workloads(args.batch_size)
    results = [compare(m, works[m], args.budgets, lambda s: print(s, flush=True))
               for m in args.models]  # fmt: skip
    stem = os.path.join(args.out_dir, f"plan_exhaustive_{'_'.join(args.models)}_{backend}")
    command = f"python benchmarks/plan_exhaustive.py --models {' '.join(args.models)}"
    with open(f"{stem}.json", "w") as f:
        json.dump({"command": command, "backend": backend, "results": results}, f, indent=1)
    with open(f"{stem}.md", "w") as f:
        f.write(table(results, backend))
    plot(results, f"{stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
