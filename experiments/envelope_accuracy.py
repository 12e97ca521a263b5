"""Accuracy of the memory reports' best rows, with intervals.

The headline quotes, per benchmark, the best reduction inside the technical report's envelope
and outside it (``report.json``'s ``best_in_envelope`` and ``best``). This trains those plans on
the CPU stand-in tasks next to the dense fp32 baseline:

* ``digits`` (for WRN-28-2): WideResNet-16-2 on the 8x8 digits, batch 128, 10 epochs, the
  exact plans (microbatches of 8 and 2 examples), with stratified 5-fold cross-validation x 3
  seeds: every image is a test image once per seed, and each (seed, fold) pairs a variant
  with the baseline trained on the same split. Interval: the corrected resampled t-test's
  (Nadeau & Bengio 2003) over the 15 paired differences.
* ``fashion`` (for WRN-28-2 too): WideResNet-16-2 on Fashion-MNIST (60,000 /
  10,000 28x28 images from Debian's ``dataset-fashion-mnist``; not saturated), batch 128, one
  epoch, the in-envelope plan exactly as for the digits, 3 seeds, paired t interval (the best
  row's microbatches of 2 images make an epoch about 20 minutes here: not run).
* ``translation`` (for the IWSLT DynamicConv Transformer): the small DynamicConv Transformer on
  ``synthetic-reverse-long`` (vocabulary 32, lengths 4-16), 1,200 Adam steps, 5 seeds, paired t
  interval. At 400 steps the dense baseline was still learning the reversal and its greedy BLEU
  spanned 60.5-75.7 over the seeds; at 1,200 it has learnt it. The plans' precision, remat and
  DSR are the rows'; microbatches are 8 per batch (the model has no batch statistics, so the
  microbatch size changes only the summation order; the token batches hold ~40 rows, not 100).

    python experiments/envelope_accuracy.py [--task digits|fashion|translation|all] [--seeds 0,1]
        [--variants baseline,best]

Runs are kept one file each in ``results/envelope_accuracy/<task>/runs`` (a cut-short
invocation resumes); ``results/envelope_accuracy/accuracy.{json,md,png}`` are rewritten from
every task's runs. About 4 minutes per (seed, fold) of digits, 6-30 per run of fashion and 2-4
per run of translation on 2 CPU cores (``--variants``: only those variants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from experiments.memory_reports import load_or_run_report  # noqa: E402
from lowmem_jax.compose.plan import Plan  # noqa: E402

OUT = os.path.join(study.RESULTS, "envelope_accuracy")
# The digits study's DSR (``study.single_variants``: N_p 20,000, rewired every 20 steps).
TARGET_PRUNED = 20_000
SEEDS = {"digits": (0, 1, 2), "fashion": (0, 1, 2), "translation": (0, 1, 2, 3, 4)}
TASKS = {  # task -> (memory report's model, cross-validation folds, TrainConfig fields)
    "digits": ("wrn-28-2", 5, {}),
    # Not saturated, unlike the digits; one epoch (469 steps) on 2 CPU cores.
    "fashion": ("wrn-28-2", None, {"dataset": "fashion-mnist", "epochs": 1, "image_size": 32}),
    # 1,200 steps: past the point where the dense baseline learns the reversal (at 400 steps
    # its greedy BLEU spanned 60.5-75.7 over five seeds).
    "translation": (
        "dynamicconv-iwslt",
        None,
        {"dataset": "synthetic-reverse-long", "steps": 1200, "eval_every": 1200},
    ),
}
IMAGES = ("digits", "fashion")  # the WideResNet's stand-ins, with the same plans


def variants(task: str) -> list[tuple[study.Variant, str | None]]:
    """``(variant, the memory report's row)``: the baseline, then the in-envelope best and the
    best, as plans of ``task``."""
    digits = task in IMAGES
    target = TARGET_PRUNED if digits else None
    inside_mb, best_mb = (128 // 8, 128 // 2) if digits else (8, 8)
    image = {"input_dtype": "uint8"} if digits else {}
    inside = Plan(
        precision="mixed_fp16",
        microbatches=inside_mb,
        remat="full",
        sparsity=study.dsr(0.7, target_pruned=target),
        **image,
    )
    best = Plan(
        precision="fp16",
        microbatches=best_mb,
        remat="full",
        sparsity=study.dsr(0.9, target_pruned=target),
        **image,
    )
    suffix = " + uint8 input" if digits else ""
    rows = (  # the full-size rows: microbatches of 8 and 2 examples (sentences)
        f"mixed_fp16 + mb {8 if digits else 10} + remat full + sparse 70%{suffix}",
        f"fp16 + mb 2 + remat full + sparse 90%{suffix}",
    )
    mb = ("8", "2") if digits else ("8 per batch", "8 per batch")
    out = [
        (study.Variant("baseline", "baseline", "fp32, no technique"), "plain"),
        (
            study.Variant(
                "in_envelope",
                "combined",
                f"mixed_fp16 + mb {mb[0]} + remat full + DSR 70%{suffix}",
                inside,
            ),
            rows[0],
        ),
        (
            study.Variant(
                "best", "combined", f"fp16 + mb {mb[1]} + remat full + DSR 90%{suffix}", best
            ),
            rows[1],
        ),
    ]
    if digits:  # the in-envelope row with its state in int8, the best row with int4
        out += [
            (
                study.Variant(
                    "in_envelope_int8",
                    "combined",
                    f"mixed_fp16 + mb 8 + remat full + state int8 + DSR 70%{suffix}",
                    dataclasses.replace(inside, optimizer_state="int8"),
                ),
                f"mixed_fp16 + mb 8 + remat full + state int8 + sparse 70%{suffix}",
            ),
            (
                study.Variant(
                    "best_int4",
                    "combined",
                    f"fp16 + mb 2 + remat full + DSR 90% + state int4{suffix}",
                    dataclasses.replace(best, optimizer_state="int4"),
                ),
                # Not a report row yet (`fp16 + mb 2 + remat full + sparse 90% + state int4`).
                None,
            ),
        ]
    if task == "fashion":  # the baseline and the headline's rows (an epoch: 26 of digits')
        return out
    # Compressed activations alone, at two widths.
    out += [
        (
            study.Variant(f"act_{fmt}", "activations", f"activations {fmt}", Plan(activations=fmt)),
            None,
        )
        for fmt in ("int8", "int2")
    ]
    if not digits:  # which part of the best row costs the accuracy: each half alone
        dense = dataclasses.replace(best, sparsity=None)
        mixed = dataclasses.replace(best, precision="mixed_fp16")
        for sparsity in (0.7, 0.8):  # the best row at lower sparsities
            out.append(
                (
                    study.Variant(
                        f"best_dsr{sparsity * 100:.0f}",
                        "combined",
                        f"fp16 + mb 8 per batch + remat full + DSR {sparsity:.0%}",
                        dataclasses.replace(best, sparsity=study.dsr(sparsity)),
                    ),
                    f"fp16 + mb 2 + remat full + sparse {sparsity:.0%}",
                )
            )
        static = dataclasses.replace(study.dsr(0.7), algorithm="static")
        planned = Plan(
            microbatches=8, remat="dots", optimizer_state="bf16", sparsity=study.dsr(0.7)
        )
        least = dataclasses.replace(planned, precision="mixed_fp16", remat="sqrt")
        out += [
            (
                study.Variant(
                    "in_envelope_least",
                    "combined",
                    "mixed_fp16 + mb 8 per batch + remat sqrt + state bf16 + DSR 70% "
                    "(lowmem plan's least at 413 MiB)",
                    least,
                ),
                "mixed_fp16 + mb 10 + remat sqrt + state bf16 + sparse 70%",
            ),
            (
                study.Variant(
                    "in_envelope_least_int8",
                    "combined",
                    "mixed_fp16 + mb 8 per batch + remat sqrt + state int8 + DSR 70%",
                    dataclasses.replace(least, optimizer_state="int8"),
                ),
                "mixed_fp16 + mb 10 + remat sqrt + state int8 + sparse 70%",
            ),
            (
                study.Variant(
                    "in_envelope_planned",
                    "combined",
                    "mb 8 per batch + remat dots + state bf16 + DSR 70% (lowmem plan, 700 MiB)",
                    planned,
                ),
                "mb 10 + remat dots + state bf16 + sparse 70%",
            ),
            (
                study.Variant(
                    "best_static70",
                    "combined",
                    "fp16 + mb 8 per batch + remat full + static sparse 70%",
                    dataclasses.replace(best, sparsity=static),
                ),
                "fp16 + mb 2 + remat full + static sparse 70%",
            ),
            *(
                (
                    study.Variant(
                        f"best_static70_{fmt}",
                        "combined",
                        f"fp16 + mb 8 per batch + remat full + static sparse 70% + state {fmt}",
                        dataclasses.replace(best, sparsity=static, optimizer_state=fmt),
                    ),
                    f"fp16 + mb 2 + remat full + static sparse 70% + state {fmt}",
                )
                for fmt in ("int8", "int4")
            ),
            (
                study.Variant(
                    "best_static90",
                    "combined",
                    "fp16 + mb 8 per batch + remat full + static sparse 90%",
                    dataclasses.replace(
                        best, sparsity=dataclasses.replace(study.dsr(0.9), algorithm="static")
                    ),
                ),
                "fp16 + mb 2 + remat full + static sparse 90%",
            ),
            (
                study.Variant(
                    "best_int4",
                    "combined",
                    "fp16 + mb 8 per batch + remat full + DSR 90% + state int4",
                    dataclasses.replace(best, optimizer_state="int4"),
                ),
                "fp16 + mb 2 + remat full + sparse 90% + state int4",
            ),
            (
                study.Variant(
                    "best_dense", "combined", "fp16 + mb 8 per batch + remat full (no DSR)", dense
                ),
                "fp16 + mb 2 + remat full",
            ),
            (
                study.Variant(
                    "best_mixed",
                    "combined",
                    "mixed_fp16 + mb 8 per batch + remat full + DSR 90%",
                    mixed,
                ),
                None,
            ),
        ]
    return out


SCALE = {"digits": 100.0, "fashion": 100.0, "translation": 1.0}  # accuracy in points; BLEU
UNIT = {"digits": "points of test accuracy", "fashion": "points of test accuracy",
        "translation": "greedy BLEU"}  # fmt: skip
# The goal for the mean paired delta, in the task's unit (points, BLEU): the report's envelope.
GOAL = {"digits": -0.5, "fashion": -0.5, "translation": -1.0}


def summary(task: str, records: dict[str, dict], report: dict) -> list[dict]:
    """One row per variant: the metric per seed, the paired delta with its 95% interval, and
    its memory row's XLA:CPU total and reduction against the plain step."""
    folds = TASKS[task][1]
    if folds:
        rows = {r["name"]: r for r in study.summarize_cv(records)}
    else:
        rows = {r["name"]: r for r in study.summarize(records)}
    memory = {r["name"]: r for r in report["configs"]}
    out = []
    for variant, row_name in variants(task):
        if variant.name not in rows:
            continue
        r = rows[variant.name]
        mem = memory.get(row_name)
        if folds:
            per_seed, runs, skipped = r["pooled_by_seed"], r["runs"], r["skipped_steps"]
        else:
            by_seed = {x["seed"]: x["value"] for x in records.values() if x["name"] == r["name"]}
            per_seed, runs = {s: by_seed[s] for s in r["seeds"]}, len(r["seeds"])
            skipped = sum(x or 0 for x in r["skipped_steps"])
        out.append(
            {
                "name": variant.name,
                "setting": variant.setting,
                "runs": runs,
                "folds": folds,
                "by_seed": {str(k): v for k, v in per_seed.items()},
                "delta_vs_baseline": r["delta_vs_baseline"],
                "skipped_steps": skipped,
                "memory_row": row_name,
                "xla_total_mib": None if mem is None else mem["xla"]["total_bytes"] / 2**20,
                "reduction_xla_vs_plain": None
                if mem is None
                else mem.get("reduction_xla_vs_plain"),
            }
        )
    return out


def _signed(x: float, task: str) -> str:
    return f"{SCALE[task] * x:+.2f}"


def delta_text(row: dict, task: str) -> str:
    """``mean [low, high]`` of a row's paired delta, in the task's unit."""
    d = row["delta_vs_baseline"]
    low, high = d["ci95"]
    return f"{_signed(d['mean'], task)} [{_signed(low, task)}, {_signed(high, task)}]"


def to_markdown(result: dict) -> str:
    lines = [
        "# The memory reports' best rows: accuracy with intervals",
        "",
        f"`{result['command']}` (the protocol: the script's docstring). "
        "Paired delta: the variant minus the dense fp32 baseline of the same seed (and fold), "
        "mean [95% interval]. Memory: the report row's XLA:CPU compiled total at full size "
        "(WRN-28-2 batch 128; DynamicConv IWSLT 100 x 40 tokens) and its reduction against "
        "the plain Flax/Optax step.",
    ]
    for task, rows in result["tasks"].items():
        folds = TASKS[task][1]
        protocol = (
            f"stratified {folds}-fold cross-validation x seeds, metric pooled over the folds "
            "per seed, interval by the corrected resampled t-test"
            if folds
            else "seeds, paired t interval"
        )
        lines += [
            "",
            f"## {task} ({UNIT[task]}; {protocol})",
            "",
            "| config | runs | per seed | paired delta, mean [95% interval] | min..max | "
            "skipped steps | memory row | XLA:CPU MiB | reduction vs plain |",
            "|---|---:|---|---|---|---:|---|---:|---:|",
        ]
        for r in rows:
            per_seed = ", ".join(
                "-" if v is None else f"{SCALE[task] * v:.2f}" for v in r["by_seed"].values()
            )
            d = r["delta_vs_baseline"]
            delta, span = "-", "-"
            if d is not None and "ci95" in d:
                delta = delta_text(r, task)
                span = f"{_signed(d['min'], task)}..{_signed(d['max'], task)}"
            mib = "-" if r["xla_total_mib"] is None else f"{r['xla_total_mib']:.2f}"
            red = r["reduction_xla_vs_plain"]
            lines.append(
                f"| {r['setting']} | {r['runs']} | {per_seed} | {delta} | {span} | "
                f"{r['skipped_steps']} | {r['memory_row'] or '-'} | {mib} | "
                f"{'-' if red is None else f'{red:.1f}x'} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    shown = {
        task: [r for r in result["tasks"][task] if (r["delta_vs_baseline"] or {}).get("ci95")]
        for task in tasks
    }
    heights = [0.6 + 0.55 * len(shown[task]) for task in tasks]  # two label lines per row
    fig, axes = plt.subplots(
        len(tasks),
        1,
        figsize=(9, sum(heights) + 0.8),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        rows = shown[task]
        scale = SCALE[task]
        labels = []
        for i, r in enumerate(rows):
            d = r["delta_vs_baseline"]
            low, high = (scale * x for x in d["ci95"])
            ax.plot([low, high], [i, i], color="k", lw=2)
            ax.plot(scale * d["mean"], i, "o", color="C0")
            red = r["reduction_xla_vs_plain"]
            labels.append(r["setting"] + ("" if red is None else f"\n{red:.1f}x less memory"))
        ax.axvline(0, color="k", lw=0.8)
        goal = f"{GOAL[task]:+g} (goal)"
        ax.axvline(GOAL[task], color="C3", lw=0.8, ls="--", label=goal)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel(f"{task}: {UNIT[task]} minus dense fp32 (mean, 95% interval)", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        "Accuracy of the memory reports' best rows (CPU stand-in tasks; memory: XLA:CPU vs plain)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


REPORTS = {  # task -> the benchmark its memory rows are of
    "digits": "WideResNet-28-2, CIFAR-10 shapes, batch 128",
    "translation": "DynamicConv Transformer (IWSLT'14), 100 x 40 tokens",
}
ALSO = {"digits": ("fashion",)}  # the headline's other evidence for a benchmark's rows
STAND_IN = {"digits": "digits", "fashion": "Fashion-MNIST", "translation": "translation"}


def held(task: str, rows: list[dict]) -> dict | None:
    """Of ``rows`` (``summary``'s, of ``task``), the one with the largest measured reduction
    whose mean paired delta meets :data:`GOAL`; ``None`` when none does."""
    ok = [
        r
        for r in rows
        if r["reduction_xla_vs_plain"] is not None
        and (r["delta_vs_baseline"] or {}).get("ci95")
        and SCALE[task] * r["delta_vs_baseline"]["mean"] >= GOAL[task]
    ]
    return max(ok, key=lambda r: r["reduction_xla_vs_plain"], default=None)


def headline_rows(task: str, report: dict, accuracy: dict) -> list[tuple[str, str]]:
    """``(memory row name, envelope label)`` of the rows the headline shows for ``task``: the
    best inside the technical report's envelope, the best overall and, where it is another
    row, the largest measured reduction whose stand-in accuracy meets :data:`GOAL`."""
    shown = [(report["best_in_envelope"]["name"], "the report's"), (report["best"]["name"], "any")]
    kept = held(task, accuracy.get(task, []))
    if kept is not None and kept["memory_row"] not in {name for name, _ in shown}:
        goal = f"{GOAL[task]:+g} {UNIT[task].split(' of ')[0]}"
        shown.append((kept["memory_row"], f"any, accuracy within {goal}"))
    return shown


def _cost_cells(cost: dict | None) -> str:
    if cost is None:
        return "not measured | not counted"
    lo, hi = cost["time_ratio_range"]
    return f"{cost['time_ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {cost['flops_ratio']:.2f}"


def _accuracy_text(task: str, row: dict | None) -> str | None:
    """``mean [interval] unit (protocol)`` of a :func:`summary` row; ``None`` without one."""
    if row is None or not (row["delta_vs_baseline"] or {}).get("ci95"):
        return None
    seeds = len(row["by_seed"])
    protocol = f"{row['folds']}-fold CV x {seeds} seeds" if row["folds"] else f"{seeds} seeds"
    epochs = TASKS[task][2].get("epochs")
    protocol += f", {epochs} epoch{'s' * (epochs != 1)}" if epochs else ""
    return f"{delta_text(row, task)} {UNIT[task]} ({protocol})"


def headline_table(results: str = study.RESULTS) -> str:
    """The README's first table: each benchmark's :func:`headline_rows`, measured (XLA:CPU) and
    analytic against the plain step, each row's step time and FLOPs against the plain step's
    (``step_cost.json``, :mod:`experiments.headline_cost`), and the accuracy of that plan on
    the CPU stand-in task (``accuracy.json``)."""
    with open(os.path.join(results, "envelope_accuracy", "accuracy.json")) as f:
        accuracy = json.load(f)["tasks"]
    cost_path = os.path.join(results, "envelope_accuracy", "step_cost.json")
    costs = {}
    if os.path.exists(cost_path):
        with open(cost_path) as f:
            costs = {(t, r["name"]): r for t, rows in json.load(f)["tasks"].items() for r in rows}
    lines = [
        "| benchmark | envelope | configuration | XLA:CPU MiB (plain) | reduction vs plain, "
        "measured (XLA:CPU) | reduction vs plain, analytic | step time / plain, measured "
        "(XLA:CPU, median (range) of paired rounds) | FLOPs / plain (jaxpr) | accuracy vs "
        "dense fp32 on the CPU stand-in: mean [95% interval] |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for task, bench in REPORTS.items():
        report = load_or_run_report(TASKS[task][0])
        rows = {r["name"]: r for r in report["configs"]}
        evidence = {r["memory_row"]: r for r in accuracy.get(task, [])}
        plain_mib = rows["plain"]["xla"]["total_bytes"] / 2**20
        for name, label in headline_rows(task, report, accuracy):
            best = rows[name]
            text = _accuracy_text(task, evidence.get(name)) or "not measured for this plan yet"
            if task in ALSO:  # the same plan on other stand-ins
                text = f"{STAND_IN[task]}: {text}"
            for other in ALSO.get(task, ()):
                found = {r["memory_row"]: r for r in accuracy.get(other, [])}.get(name)
                text += f"; {STAND_IN[other]}: {_accuracy_text(other, found) or 'not measured yet'}"
            lines.append(
                f"| {bench} | {label} | `{name}` | "
                f"{best['xla']['total_bytes'] / 2**20:.1f} ({plain_mib:.1f}) | "
                f"**{best['reduction_xla_vs_plain']:.1f}x** | "
                f"{best['reduction_analytic_vs_plain']:.1f}x | "
                f"{_cost_cells(costs.get((task, name)))} | {text} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="all", choices=[*TASKS, "all"])
    parser.add_argument(
        "--seeds", help="comma-separated. Default: 0,1,2 for digits, 0,1,2,3,4 for translation"
    )
    parser.add_argument(
        "--variants", help="comma-separated variant names to train (default: all of the task's)"
    )
    args = parser.parse_args(argv)
    for task in TASKS if args.task == "all" else [args.task]:
        _, folds, config = TASKS[task]
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else SEEDS[task]
        study_task = "digits" if task in IMAGES else "translation"
        chosen = [v for v, _ in variants(task)]
        if args.variants:
            names = args.variants.split(",")
            unknown = sorted(set(names) - {v.name for v in chosen})
            if unknown:
                parser.error(
                    f"--variants: {unknown} are not variants of {task!r}; allowed values: "
                    f"{[v.name for v in chosen]}"
                )
            chosen = [v for v in chosen if v.name in names]
        study.run_variants(
            study_task,
            chosen,
            seeds,
            os.path.join(OUT, task),
            folds=folds,
            config=config,
        )
    result = {"command": "python experiments/envelope_accuracy.py", "tasks": {}}
    for task, (model, _, _) in TASKS.items():
        records = study.load_runs(os.path.join(OUT, task))
        if records:
            result["tasks"][task] = summary(task, records, load_or_run_report(model))
    result["environment"] = study.environment()
    with open(os.path.join(OUT, "accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(OUT, "accuracy.md"), "w") as f:
        f.write(to_markdown(result))
    plot(result, os.path.join(OUT, "accuracy.png"))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
