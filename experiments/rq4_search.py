"""RQ4: which combination gives the most memory reduction within an accuracy tolerance?

The search, per benchmark (WRN-28-2 <- the digits task; DynamicConv Transformer <- the
translation task):

1. **Admissible settings** (accuracy): a technique's setting is admissible when its mean paired
   difference to the baseline in the RQ2 accuracy study is >= ``-tolerance`` (points of test
   accuracy, or BLEU).
2. **Best setting per technique** (memory): among the admissible settings of each technique, the
   one whose single-technique row of the full-size memory report has the smallest XLA:CPU total.
3. **Greedy combination** (memory): starting from the baseline, add the technique whose best
   setting lowers the combined step's XLA:CPU total the most (compile-only analysis of the
   full-size step, analytic figure beside it); stop when no technique lowers it. This is the
   technical report's procedure (techniques added one at a time), with XLA's figure as judge:
   settings that look free analytically can cost temp bytes (e.g. sparse rewiring), and the
   greedy order exposes that.
4. **Measured**: the chosen combination is trained on the CPU task for the same seeds as the
   baseline (accuracy, paired), and its full-size step is timed against the baseline step in
   the same run.

Usage:
    python experiments/rq4_search.py                                   # both benchmarks
    python experiments/rq4_search.py --task digits --tolerance 0.5     # points of accuracy
    python experiments/rq4_search.py --task translation --tolerance 1  # BLEU

Needs the RQ2 accuracy results (``experiments/rq2_techniques.py --part accuracy``). Writes
``experiments/results/rq4/<task>/search_tol<tolerance>.{json,md}`` and the combination's runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.memory_reports import MODELS, load_or_run_report  # noqa: E402
from experiments.rq3_compute import prepare, time_interleaved  # noqa: E402
from lowmem_jax.compose.plan import Plan  # noqa: E402
from lowmem_jax.report.grid import divisor_at_most  # noqa: E402
from lowmem_jax.workloads import analyze_model  # noqa: E402

OUT = os.path.join(study.RESULTS, "rq4")
RQ2 = os.path.join(study.RESULTS, "rq2")
MODEL_OF = {"digits": "wrn-28-2", "translation": "dynamicconv-iwslt"}
DEFAULT_TOLERANCE = {"digits": 0.5, "translation": 1.0}  # points of accuracy; BLEU
SCALE = {"digits": 100.0, "translation": 1.0}  # stored metric -> points
AXES = ("precision", "microbatching", "remat", "sparsity")
MIB = 2.0**20


@dataclasses.dataclass(frozen=True)
class Setting:
    """One technique's setting on both scales: the CPU task's variant and the full-size row."""

    variant: study.Variant
    delta: float  # mean paired difference to the baseline, in points
    memory_row: str | None  # the single-technique row of the full-size memory report
    full_plan: dict  # Plan fields at full size
    full_sparse: object  # SparseConfig or None

    @property
    def axis(self) -> str:
        return self.variant.technique


def full_size(task: str, variant: study.Variant) -> tuple[str | None, dict, object]:
    """(memory row name, Plan fields, sparse config) of ``variant`` on the full-size model."""
    plan, technique = variant.plan, variant.technique
    if technique == "precision":
        return plan.precision, {"precision": plan.precision}, None
    if technique == "remat":
        return f"remat {plan.remat}", {"remat": plan.remat}, None
    if technique == "sparsity":
        sparse = variant.plan.sparsity
        if sparse.algorithm != "dsr":
            return None, {}, sparse  # the memory grid has DSR rows only
        return f"sparse {1 - sparse.density:.0%} dsr", {}, sparse
    if technique == "optimizer state":
        sparse = plan.sparsity
        if sparse is None:
            return f"state {plan.optimizer_state}", {"optimizer_state": plan.optimizer_state}, None
        if sparse.algorithm != "dsr":
            return None, {}, sparse
        row = f"sparse {1 - sparse.density:.0%} dsr + state {plan.optimizer_state}"
        return row, {"optimizer_state": plan.optimizer_state}, sparse
    if technique == "microbatching":
        batch = MODELS[MODEL_OF[task]][0]
        if task == "digits":  # the same batch (128) on both scales: the same microbatch size
            size = batch // plan.microbatches
        else:  # k microbatches of the token batch -> rows per microbatch at 100 rows, rounded
            size = divisor_at_most(batch, batch / plan.microbatches)
        return f"microbatch {size}", {"microbatches": batch // size}, None
    raise ValueError(f"variant {variant.name!r} is not a single technique")


def admissible_settings(task: str, tolerance: float) -> tuple[list[Setting], list[dict]]:
    """The settings within ``tolerance`` of the baseline, and every setting's verdict."""
    rows = study.summarize(study.load_runs(os.path.join(RQ2, task)))
    by_name = {r["name"]: r for r in rows}
    if "baseline" not in by_name:
        raise SystemExit(
            f"no RQ2 accuracy results for {task}: run "
            f"python experiments/rq2_techniques.py --part accuracy --task {task}"
        )
    settings, verdicts = [], []
    for variant in study.single_variants(task):
        row = by_name.get(variant.name)
        if variant.technique == "baseline" or row is None or row["delta_vs_baseline"] is None:
            continue
        delta = row["delta_vs_baseline"]["mean"] * SCALE[task]
        memory_row, plan, sparse = full_size(task, variant)
        ok = delta >= -tolerance
        verdicts.append(
            {
                "name": variant.name,
                "technique": variant.technique,
                "setting": variant.setting,
                "delta": delta,
                "delta_std": (row["delta_vs_baseline"]["std"] or 0.0) * SCALE[task],
                "seeds": row["seeds"],
                "admissible": ok,
                "memory_row": memory_row,
            }
        )
        if ok:
            settings.append(Setting(variant, delta, memory_row, plan, sparse))
    return settings, verdicts


def combine(settings: list[Setting]) -> tuple[dict, object]:
    fields, sparse = {}, None
    for s in settings:
        fields.update(s.full_plan)
        sparse = s.full_sparse or sparse
    return fields, sparse


def cpu_variant(task: str, settings: list[Setting]) -> study.Variant:
    """The combination as a variant of the CPU task (its own settings, not the full-size ones)."""
    fields, sparse = {}, None
    for s in settings:
        p = s.variant.plan
        if s.axis == "precision":
            fields["precision"] = p.precision
        elif s.axis == "microbatching":
            fields["microbatches"] = p.microbatches
        elif s.axis == "remat":
            fields["remat"] = p.remat
        else:
            sparse = s.variant.plan.sparsity
    name = "+".join(s.variant.name for s in settings) or "baseline"
    setting = " + ".join(s.variant.setting for s in settings) or "baseline"
    return study.Variant(name, "combined", setting, Plan(**fields, sparsity=sparse))


def search(task: str, tolerance: float, log=print) -> dict:
    model = MODEL_OF[task]
    batch = MODELS[model][0]
    report = load_or_run_report(model)
    rows = {r["name"]: r for r in report["configs"]}
    base = rows["baseline"]
    settings, verdicts = admissible_settings(task, tolerance)
    best: dict[str, Setting] = {}
    for s in settings:
        if s.memory_row not in rows:
            continue
        total = rows[s.memory_row]["xla"]["total_bytes"]
        if s.axis not in best or total < rows[best[s.axis].memory_row]["xla"]["total_bytes"]:
            best[s.axis] = s
    chosen: list[Setting] = []
    current = base["xla"]["total_bytes"]
    path = [
        {
            "step": 0,
            "added": "baseline",
            "xla_total_bytes": current,
            "analytic_total_bytes": base["analytic"]["total_bytes"],
            "accepted": True,
        }
    ]
    while True:
        trials = []
        for axis, s in best.items():
            if any(c.axis == axis for c in chosen):
                continue
            fields, sparse = combine([*chosen, s])
            log(f"[{time.strftime('%H:%M:%S')}] {model}: trying {fields} sparse={sparse}")
            plan = Plan(**fields, sparsity=sparse)
            r = analyze_model(model, batch, plan, seq_len=MODELS[model][1])
            trials.append((r.xla["total_bytes"], r.analytic["total_bytes"], r.flops, s, fields))
        if not trials:
            break
        for xla_total, analytic_total, _, s, fields in sorted(trials, key=lambda t: t[0]):
            path.append(
                {
                    "step": len(chosen) + 1,
                    "added": s.variant.setting,
                    "plan": fields,
                    "sparse": s.full_sparse is not None
                    or any(c.full_sparse is not None for c in chosen),
                    "xla_total_bytes": xla_total,
                    "analytic_total_bytes": analytic_total,
                    "accepted": False,
                }
            )
        xla_total, analytic_total, flops, s, fields = min(trials, key=lambda t: t[0])
        if xla_total >= current:
            break
        chosen.append(s)
        current = xla_total
        accepted = next(
            p for p in path if p["step"] == len(chosen) and p["added"] == s.variant.setting
        )
        accepted["accepted"] = True
        final = {
            "xla_total_bytes": xla_total,
            "analytic_total_bytes": analytic_total,
            "flops_overhead": flops / base["flops"],
            "plan": fields,
        }
    if not chosen:
        final = {
            "xla_total_bytes": current,
            "analytic_total_bytes": base["analytic"]["total_bytes"],
            "flops_overhead": 1.0,
            "plan": {},
        }
    final["reduction_xla"] = base["xla"]["total_bytes"] / final["xla_total_bytes"]
    final["reduction_analytic"] = base["analytic"]["total_bytes"] / final["analytic_total_bytes"]
    final["sparse"] = None
    fields, sparse = combine(chosen)
    if sparse is not None:
        final["sparse"] = study.sparse_fields(sparse)
    return {
        "task": task,
        "model": model,
        "batch_size": batch,
        "tolerance": tolerance,
        "metric_unit": "points of test accuracy" if task == "digits" else "BLEU",
        "verdicts": verdicts,
        "best_per_technique": {a: s.variant.setting for a, s in best.items()},
        "path": path,
        "chosen": [s.variant.name for s in chosen],
        "full_size": final,
        "xla_source": base["xla"]["source"],
    }


def measure(task: str, result: dict, seeds: list[int], repeats: int, log=print) -> dict:
    """Trains the chosen combination on the CPU task (paired with RQ2's baseline runs) and
    times its full-size step against the baseline's in the same run."""
    settings, _ = admissible_settings(task, result["tolerance"])
    chosen = [s for s in settings if s.variant.name in result["chosen"]]
    variant = cpu_variant(task, chosen)
    out_dir = os.path.join(OUT, task)
    records = study.run_variants(task, [variant], seeds, out_dir, log=log)
    baseline = {
        k: v
        for k, v in study.load_runs(os.path.join(RQ2, task)).items()
        if v["name"] == "baseline" and v["seed"] in seeds
    }
    rows = study.summarize({**baseline, **records})
    row = next(r for r in rows if r["name"] == variant.name)
    model = result["model"]
    fields, sparse = combine(chosen)
    seq_len = MODELS[model][1]
    runs = [
        prepare(model, result["batch_size"], Plan(), seq_len),
        prepare(model, result["batch_size"], Plan(**fields, sparsity=sparse), seq_len),
    ]
    rounds = time_interleaved(runs, repeats)  # both in every round: ratios paired per round
    ratios = [combined / base for base, combined in rounds]
    result = dict(result)
    result["cpu_task"] = {
        "variant": variant.setting,
        "plan": variant.plan.to_dict(),
        "summary": row,
        "unit_scale": SCALE[task],
    }
    result["time"] = {
        "baseline_step_seconds": statistics.median(r[0] for r in rounds),
        "combined_step_seconds": statistics.median(r[1] for r in rounds),
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "repeats": repeats,
        "source": "measured, same run, interleaved rounds, " + study.environment()["backend"],
    }
    return result


def to_markdown(result: dict) -> str:
    unit = result["metric_unit"]
    f = result["full_size"]
    lines = [
        f"# RQ4: the largest memory reduction within {result['tolerance']} {unit} "
        f"({result['task']} -> {result['model']}, batch {result['batch_size']})",
        "",
        "## Settings and their accuracy (CPU task, paired with the baseline)",
        "",
        f"| setting | technique | delta ({unit}) | std | seeds | admissible | full-size row |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for v in result["verdicts"]:
        lines.append(
            f"| {v['setting']} | {v['technique']} | {v['delta']:+.2f} | "
            f"{v['delta_std']:.2f} | {len(v['seeds'])} | "
            f"{'yes' if v['admissible'] else 'no'} | {v['memory_row'] or '-'} |"
        )
    lines += [
        "",
        "Best admissible setting per technique (smallest single-technique XLA total): "
        + ", ".join(f"{a}: {s}" for a, s in result["best_per_technique"].items()),
        "",
        "## Greedy search (compile-only, full-size step)",
        "",
        f"| round | adding | {result['xla_source']} total MiB | analytic MiB | accepted |",
        "|---:|---|---:|---:|---|",
    ]
    for p in result["path"]:
        lines.append(
            f"| {p['step']} | {p['added']} | {p['xla_total_bytes'] / MIB:.1f} | "
            f"{p['analytic_total_bytes'] / MIB:.1f} | {'**yes**' if p['accepted'] else 'no'} |"
        )
    lines += [
        "",
        "## The answer",
        "",
        f"Chosen: **{', '.join(result['chosen']) or 'nothing'}** -> full-size plan "
        f"`{f['plan']}`{' + DSR sparse (compressed)' if f['sparse'] else ''}.",
        "",
        f"- memory: {f['xla_total_bytes'] / MIB:.1f} MiB {result['xla_source']} "
        f"(**{f['reduction_xla']:.1f}x** less than the baseline), "
        f"{f['analytic_total_bytes'] / MIB:.1f} MiB analytic ({f['reduction_analytic']:.1f}x)",
        f"- FLOPs: {f['flops_overhead']:.2f}x the baseline (jaxpr count)",
    ]
    if "cpu_task" in result:
        s = result["cpu_task"]["summary"]
        k = result["cpu_task"]["unit_scale"]
        d = s["delta_vs_baseline"]
        lines.append(
            f"- accuracy (CPU task, `{result['cpu_task']['variant']}`, seeds "
            f"{s['seeds']}): {s['value']['mean'] * k:.2f} mean, paired delta "
            f"{d['mean'] * k:+.2f} (std {(d['std'] or 0) * k:.2f}, range "
            f"{d['min'] * k:+.2f} to {d['max'] * k:+.2f}) {unit}"
        )
        t = result["time"]
        lines.append(
            f"- step time (full size, {t['source']}): {t['ratio']:.2f}x the baseline "
            f"(median of {t['repeats']} rounds, range "
            f"{t.get('ratio_range', [t['ratio']] * 2)[0]:.2f}-"
            f"{t.get('ratio_range', [t['ratio']] * 2)[1]:.2f}; "
            f"{t['combined_step_seconds']:.2f} s vs {t['baseline_step_seconds']:.2f} s)"
        )
    lines += ["", f"Command: `{result.get('command', '')}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("both", *study.TASKS), default="both")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"accuracy points (digits) or BLEU (translation); default {DEFAULT_TOLERANCE}",
    )
    parser.add_argument("--seeds", default="0,1,2", help="Default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps. Default: %(default)s")
    parser.add_argument("--no-measure", action="store_true", help="search only")
    args = parser.parse_args(argv)
    if args.tolerance is not None and args.tolerance < 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    command = "python experiments/rq4_search.py " + " ".join(argv or sys.argv[1:])
    for task in study.TASKS if args.task == "both" else (args.task,):
        tolerance = DEFAULT_TOLERANCE[task] if args.tolerance is None else args.tolerance
        result = search(task, tolerance)
        if not args.no_measure:
            seeds = [int(s) for s in args.seeds.split(",")]
            result = measure(task, result, seeds, args.repeats)
        result["command"] = command.strip()
        out_dir = os.path.join(OUT, task)
        os.makedirs(out_dir, exist_ok=True)
        name = f"search_tol{tolerance:g}"
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(out_dir, name + ".md"), "w") as f:
            f.write(to_markdown(result))
        print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
