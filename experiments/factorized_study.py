"""Factorized layers on the two CPU tasks: accuracy over seeds.

Each method (CP, Tucker-2, low-rank) at several compressions, trained from scratch (spectral
initialisation) and decomposed from the dense baseline of the same seed then fine-tuned for the
baseline's length (CTDR's recipe), with and without remat; on digits (WRN-16-2, 8x8) and on the
synthetic reversal task (the small DynamicConv Transformer, whose Linear layers are low-rank
under every method, so ``lowrank`` stands for all). Ranks also by VBMF (Kim et al. 2016) and
by retained energy, for the decomposed runs (ranks chosen from trained weights). The tasks are
those of :mod:`experiments.study`; every run is paired with the baseline of its seed.

Usage (from the repository root, package installed):
    python experiments/factorized_study.py                    # both tasks, seeds 0-2
    python experiments/factorized_study.py --task digits --seeds 0,1
    python experiments/factorized_study.py --summarize        # rewrite the tables from runs/

Writes ``experiments/results/factorized/{digits,translation}/`` (runs/, accuracy.{json,md,png});
the dense checkpoints the decomposed runs start from go to ``checkpoints/`` there (not
committed). Interrupted runs resume: rerun the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402

OUT = os.path.join(study.RESULTS, "factorized")
COMPRESSIONS = (0.1, 0.25, 0.5)


def variants(task: str) -> list[study.Variant]:
    """The baseline, then scratch runs, remat, decomposed runs (see the module docstring)."""
    import lowmem_jax as lm
    from lowmem_jax.techniques.factorize import FactorConfig

    methods = ("tucker", "cp", "lowrank") if task == "digits" else ("lowrank",)
    out = [study.Variant("baseline", "baseline", "dense fp32, no technique")]
    for method in methods:
        for c in COMPRESSIONS:
            plan = lm.Plan(factorize=FactorConfig(method, c))
            out.append(study.Variant(f"{method}{round(100 * c)}", "scratch", f"{method} {c:.0%}",
                                     plan))  # fmt: skip
    main = methods[0]
    plan = lm.Plan(factorize=FactorConfig(main, 0.25), remat="full")
    out.append(study.Variant(f"{main}25_remat", "scratch + remat", f"{main} 25% + remat full",
                             plan))  # fmt: skip
    for method in methods:
        plan = lm.Plan(factorize=FactorConfig(method, 0.25))
        out.append(study.Variant(f"{method}25_decomposed", "decomposed", f"{method} 25%", plan,
                                 decompose=True))  # fmt: skip
    for rule in ("vbmf", "energy"):
        plan = lm.Plan(factorize=FactorConfig(main, rank_rule=rule))
        setting = f"{main} ranks by {'VBMF' if rule == 'vbmf' else 'energy 0.9'}"
        out.append(study.Variant(f"{main}_{rule}_decomposed", "decomposed", setting, plan,
                                 decompose=True))  # fmt: skip
    return out


def write_accuracy(task: str, out_dir: str, command: str) -> dict:
    rows = study.summarize(study.load_runs(out_dir))
    order = {v.name: i for i, v in enumerate(variants(task))}
    rows.sort(key=lambda r: order.get(r["name"], len(order)))
    records = study.load_runs(out_dir)
    for row in rows:  # the parameters each factorized model keeps (seed 0's run)
        first = records[f"{row['name']}_seed{row['seeds'][0]}"]
        row["param_count"] = first.get("param_count")
    base = study.base_config(task, 0)
    result = {"task": task, "command": command, **study.environment(),
              "baseline_config": repr(base), "rows": rows}  # fmt: skip
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "accuracy.md"), "w") as f:
        f.write(f"# Factorized layers: accuracy, {task} (CPU scale)\n\n")
        f.write(
            f"Command: `{command}`\n\nBackend {result['backend']}, JAX {result['jax_version']}."
            f" Baseline: `{repr(base)}`.\n\nTask: {study.TASK_NOTES[task]}\n\n"
            "technique: `scratch` = trained factorized from a spectral initialisation for the "
            "baseline's length; `decomposed` = the dense baseline of the same seed decomposed "
            "(`--decompose-from`) and fine-tuned for the baseline's length again (so twice the "
            "baseline's steps in all).\n\n"
        )
        f.write(study.accuracy_table(rows, task))
        f.write("\n| config | technique | parameters (seed 0) |\n|---|---|---:|\n")
        for row in rows:
            f.write(f"| {row['setting']} | {row['technique']} | {row['param_count']:,} |\n")
        f.write(
            "\nPaired delta: the variant minus the baseline trained with the same seed "
            "(same data split and order).\n"
        )
    title = f"Factorized layers: {task} (CPU scale; colour: from scratch or decomposed)"
    study.plot_accuracy(rows, task, os.path.join(out_dir, "accuracy.png"), title)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=(*study.TASKS, "all"), default="all")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the tables")
    args = parser.parse_args(argv)
    tasks = study.TASKS if args.task == "all" else (args.task,)
    seeds = [int(s) for s in args.seeds.split(",")]
    for task in tasks:
        out_dir = os.path.join(OUT, task)
        command = f"python experiments/factorized_study.py --task {task} --seeds {args.seeds}"
        if not args.summarize:
            study.run_variants(task, variants(task), seeds, out_dir)
        write_accuracy(task, out_dir, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
