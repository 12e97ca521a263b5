"""Accuracy on real text of the plans the LLM scaling table quotes, against dense float32 AdamW.

``benchmarks/llm_scaling.py`` quotes, per decoder size, the least memory found inside the
technical report's envelope and outside it. This trains those two plans on the CPU member of the
family, ``llama-18m`` on the bytes of this Python's standard library (``study.TASK_NOTES["lm"]``:
250 steps of 8 x 128 bytes), next to the dense float32 baseline, for 3 seeds; each seed pairs
a plan with the baseline of the same initialisation and data order. Reported: held-out loss
(nats per byte) per variant, the paired difference's mean and 95% t interval, and the relative
difference ``(plan - baseline) / baseline``.

The plans are the scaling table's for ``llama-1b`` (:data:`PLANS`), at this model's batch:
microbatches at most the batch's 8 sequences (each plan's count divides it; the table's 4 stay
4); ``tests/test_lm_accuracy.py`` checks they are the committed table's plans, field by field.

    python experiments/lm_accuracy.py [--seeds 0,1,2] [--variants baseline,report]
    python experiments/lm_accuracy.py --plans precision   # bf16 + stochastic rounding (issue 81)

Runs are kept one file each in ``results/lm_accuracy/runs`` (a cut-short invocation resumes);
``results/lm_accuracy/accuracy.{json,md,png}`` are rewritten from every run. About 8 minutes per
run on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import study  # noqa: E402
from lowmem_jax.compose.plan import Plan  # noqa: E402
from lowmem_jax.core.provenance import provenance  # noqa: E402
from lowmem_jax.planning.search import plan_name  # noqa: E402
from lowmem_jax.techniques.factorize import FactorConfig  # noqa: E402
from lowmem_jax.techniques.sparsity import report_sparsity  # noqa: E402

OUT = os.path.join(study.RESULTS, "lm_accuracy")
SCALING = os.path.join(os.path.dirname(study.RESULTS), "..", "benchmarks", "results",
                       "llm_scaling_cpu.json")  # fmt: skip
#: The scaling table's model whose plans are trained here.
QUOTED_MODEL = "llama-1b"
SEEDS = (0, 1, 2)
BATCH_ROWS = 8
#: The scaling table's least-memory plans of llama-1b: inside the report's envelope, and any.
PLANS = {
    "report": Plan(remat="full", optimizer_state="int8", sparsity=report_sparsity(0.7)),
    "any": Plan(
        factorize=FactorConfig("tucker", 0.25),
        precision="fp16",
        microbatches=4,
        remat="sqrt",
        optimizer_state="int4",
        sparsity=report_sparsity(0.9),
    ),
}


#: Issue 81's departures from float32 master weights, each against the same baseline (its own
#: runs, in their own folder: :data:`SETS`).
PRECISION_PLANS = {"bf16-sr": Plan(precision="bf16", param_rounding="stochastic")}
#: ``--plans``: which plans, where their runs go, the figure's title.
SETS = {
    "table": (PLANS, OUT, "Quoted LLM plans on llama-18m (Python source bytes)"),
    "precision": (PRECISION_PLANS, os.path.join(study.RESULTS, "lm_precision"),
                  "bf16 parameters, stochastic rounding, on llama-18m (Python source bytes)"),
}  # fmt: skip


def quoted_plans(path: str = SCALING, model: str = QUOTED_MODEL) -> dict[str, dict]:
    """The committed scaling table's best plans of ``model``: ``{envelope: search summary}``."""
    with open(path) as f:
        entries = {e["model"]: e for e in json.load(f)["sizes"]}
    return entries[model]["searches"]


def at_batch(plan: Plan, rows: int = BATCH_ROWS) -> Plan:
    """``plan`` with at most ``rows`` microbatches (one sequence each)."""
    return dataclasses.replace(plan, microbatches=min(plan.microbatches, rows))


def variants(plans: dict[str, Plan]) -> list[study.Variant]:
    """The baseline, then each quoted plan (``{envelope: plan}``) at this model's batch."""
    out = [study.Variant("baseline", "baseline", "fp32 AdamW, no technique")]
    for envelope, plan in plans.items():
        small = at_batch(plan)
        out.append(study.Variant(envelope, "combined", plan_name(small), small))
    return out


def summarize(records: dict[str, dict]) -> dict:
    rows = study.summarize(records)
    base = next(r for r in rows if r["name"] == "baseline")["value"]["mean"]
    for r in rows:
        d = r["delta_vs_baseline"]
        if d is not None and r["name"] != "baseline":
            d["relative_mean"] = d["mean"] / base
    return {"task": study.TASK_NOTES["lm"], "provenance": provenance(), "rows": rows,
            "commits": sorted({r["provenance"]["commit"] for r in records.values()})}  # fmt: skip


def to_markdown(result: dict) -> str:
    lines = ["# Accuracy on real text: llama-18m on Python source bytes", "", result["task"], "",
             f"Runs from commit(s) {', '.join(result['commits'])}.", "",
             study.accuracy_table(result["rows"], "lm"), "",
             "| config | paired delta, 95% interval (nats/byte) | relative to the baseline |",
             "|---|---|---:|"]  # fmt: skip
    for r in result["rows"]:
        d = r["delta_vs_baseline"]
        if d is None or r["name"] == "baseline" or "ci95" not in d:
            continue
        lo, hi = d["ci95"]
        lines.append(f"| {r['setting']} | [{lo:+.4f}, {hi:+.4f}] | {d['relative_mean']:+.2%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument(
        "--plans",
        default="table",
        choices=sorted(SETS),
        help="the scaling table's plans, or issue 81's precision departures",
    )
    parser.add_argument("--variants", default=None, help="default: the baseline and every plan")
    args = parser.parse_args(argv)
    plans, out, title = SETS[args.plans]
    names = args.variants.split(",") if args.variants else ["baseline", *plans]
    chosen = [v for v in variants(plans) if v.name in names]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    records = study.run_variants("lm", chosen, seeds, out)
    result = summarize(records)
    with open(os.path.join(out, "accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "accuracy.md"), "w") as f:
        f.write(to_markdown(result))
    study.plot_accuracy(result["rows"], "lm", os.path.join(out, "accuracy.png"), title=title)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
