"""Accuracy side of the study (RQ2, RQ4, RQ5): configs, a resumable multi-seed runner, summaries.

CPU-scale tasks stand in for the benchmarks (their full recipes need a GPU, see
``experiments/README.md``); :data:`TASK_NOTES` describes them.

Every technique is a :class:`Variant` of the task's baseline config. :func:`run_variants` trains
each variant for each seed and writes ``<out>/runs/<variant>_seed<seed>.json`` at once, so an
interrupted invocation resumes by running the same command again (finished runs are read back).
:func:`summarize` pairs each variant with the baseline of the same seed (same data split, same
initialisation) and reports the mean and spread of the metric and of the paired difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.provenance import provenance
from lowmem_jax.techniques.sparsity import SparseConfig
from lowmem_jax.training.checkpointing import checkpoint_steps
from lowmem_jax.training.loop import TrainConfig, train_and_evaluate

#: The tasks of the single-technique studies (RQ2, RQ4); ``lm`` (the language model on real
#: text, ``experiments/lm_accuracy.py``) runs combined plans only.
TASKS = ("digits", "translation")
ALL_TASKS = (*TASKS, "lm")
#: The language model task's run: llama-18m on the bytes of the standard library's sources.
LM_STEPS = 250
TASK_NOTES = {
    "digits": "WideResNet-16-2 on the scikit-learn digits (real data shipped with the package), "
    "8x8 pixels (the original resolution), batch 128, 10 epochs, SGD Nesterov 0.9, lr 0.1 "
    "cosine, weight decay 5e-4; the seed sets the data split, initialisation and order. Metric: "
    "test accuracy (360 images: one image is 0.28 points).",
    "translation": "the small DynamicConv Transformer (`DynamicConvTransformer.small`) on the "
    "synthetic reversal task (`lowmem_jax.data.make_translation_task`: vocabulary 16, lengths "
    "1-8), 1,024 tokens per batch, 400 Adam steps (inverse-sqrt schedule, label smoothing 0.1). "
    "Metric: greedy BLEU on the 256 held-out pairs (token accuracy recorded too).",
    "lm": "llama-18m (6 layers, width 512, 8 heads on 4 key/value heads, a byte vocabulary) on "
    "the bytes of this Python's standard library sources (`lowmem train --dataset "
    "python-source`: 1 file in 20 held out), 8 sequences x 128 bytes per batch, "
    f"{LM_STEPS} AdamW steps (0.9, 0.98; lr 3e-4 cosine; weight decay 0.1). Metric: held-out "
    "loss in nats per byte over 256 held-out windows (lower is better).",
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of a task: a technique at one setting, or a combination.

    ``plan`` (sparsity included) replaces the baseline's; its sparsity is seeded per run.
    ``decompose``: start from the baseline trained with the same seed, its layers decomposed
    into ``plan.factorize``'s (``TrainConfig.decompose_from``), and fine-tune for the baseline's
    length, instead of training from scratch.
    """

    name: str
    technique: str  # baseline, precision, microbatching, remat, sparsity, optimizer state, ...
    setting: str
    plan: Plan = Plan()
    decompose: bool = False


def dsr(sparsity: float, seed: int = 0, target_pruned: int | None = None) -> SparseConfig:
    """The report's sparse training: DSR, uniform densities, compressed storage.

    ``target_pruned``: DSR's N_p (``None``: scaled to the model, see ``SparseConfig``).
    """
    return SparseConfig(
        dsr_target_pruned=target_pruned,
        algorithm="dsr",
        density=round(1.0 - sparsity, 6),
        distribution="uniform",
        compressed=True,
        seed=seed,
        update_period=20,
    )


def rigl(sparsity: float, seed: int = 0) -> SparseConfig:
    return SparseConfig(
        algorithm="rigl",
        density=round(1.0 - sparsity, 6),
        distribution="erk",
        compressed=True,
        seed=seed,
        update_period=20,
    )


def single_variants(task: str) -> list[Variant]:
    """The baseline and every technique alone (RQ2), at the settings the CPU task allows.

    The translation task runs fewer settings (a run costs ~2x a digits run): one microbatch
    count (its loss has no batch statistics: microbatching changes only the summation order),
    DSR at 50% and 90%.
    """
    _check_task(task)
    out = [Variant("baseline", "baseline", "fp32, no technique")]
    digits = task == "digits"
    for precision in ("mixed_fp16", "mixed_bf16", "fp16"):
        out.append(Variant(precision, "precision", precision, Plan(precision=precision)))
    if digits:  # microbatch size in examples; batch 128
        for micro in (32, 16, 8, 4, 2):
            plan = Plan(microbatches=128 // micro)
            out.append(Variant(f"mb{micro}", "microbatching", f"microbatch {micro}", plan))
    else:  # microbatches of a 1,024-token batch (rows per batch: 64 or 128)
        out.append(Variant("k8", "microbatching", "8 microbatches", Plan(microbatches=8)))
    out.append(Variant("remat_full", "remat", "remat full", Plan(remat="full")))
    for s in (0.5, 0.7, 0.9) if digits else (0.5, 0.9):
        # digits ran with the report's N_p for WRN-28-2 (20,000; ~2x the scaled default for
        # WRN-16-2), before the default scaled with the model.
        sparse = dsr(s, target_pruned=20_000 if digits else None)
        out.append(
            Variant(f"dsr{round(100 * s)}", "sparsity", f"DSR {s:.0%}", Plan(sparsity=sparse))
        )
    if digits:
        out.append(Variant("rigl90", "sparsity", "RigL 90% (ERK)", Plan(sparsity=rigl(0.9))))
    for fmt in ("bf16", "int8", "int4"):
        plan = Plan(optimizer_state=fmt)
        out.append(Variant(f"state_{fmt}", "optimizer state", f"{fmt} optimizer state", plan))
    if digits:  # the small transformer at 90% has no sparse slot of 4,096 values: none quantized
        plan = Plan(sparsity=dsr(0.9, target_pruned=20_000), optimizer_state="int8")
        out.append(Variant("dsr90_int8", "optimizer state", "DSR 90% + int8 state", plan))
    return out


def _check_task(task: str) -> None:
    if task not in ALL_TASKS:
        raise ValueError(f"Unknown task={task!r}; allowed values: {list(ALL_TASKS)}")


def base_config(task: str, seed: int) -> TrainConfig:
    """The task's baseline training config for ``seed``."""
    _check_task(task)
    if task == "digits":
        return TrainConfig(
            model="wrn-16-2",
            dataset="digits",
            image_size=8,
            plan=Plan(),
            seed=seed,
            progress=False,
        )
    if task == "lm":
        return TrainConfig(
            dataset="python-source",
            plan=Plan(),
            steps=LM_STEPS,
            eval_every=LM_STEPS,
            seed=seed,
            progress=False,
        )
    return TrainConfig(
        model="dynamicconv-small",
        dataset="synthetic-reverse",
        plan=Plan(),
        steps=400,
        seed=seed,
        beam_size=1,
        eval_every=400,
        eval_sentences=None,
        progress=False,
    )


def config_for(task: str, variant: Variant, seed: int, **overrides: Any) -> TrainConfig:
    plan = variant.plan
    if plan.sparsity is not None:
        plan = dataclasses.replace(plan, sparsity=dataclasses.replace(plan.sparsity, seed=seed))
    return dataclasses.replace(base_config(task, seed), plan=plan, **overrides)


def metric_name(task: str) -> str:
    return {"digits": "test_accuracy", "lm": "test_loss"}.get(task, "bleu_greedy")


def sparse_fields(sparse: SparseConfig) -> dict[str, Any]:
    """``sparse`` as JSON: its fields, callables by name."""
    out = {}
    for field in dataclasses.fields(sparse):
        value = getattr(sparse, field.name)
        out[field.name] = getattr(value, "__name__", repr(value)) if callable(value) else value
    return out


def train_once(task: str, variant: Variant, seed: int, **overrides: Any) -> dict[str, Any]:
    """Trains one variant for one seed; returns the run record (no history).

    ``overrides``: :class:`TrainConfig` fields (``checkpoint_dir``, ``decompose_from``)."""
    config = config_for(task, variant, seed, **overrides)
    start = time.perf_counter()
    summary = train_and_evaluate(config, log=None)
    plan = dataclasses.replace(variant.plan, sparsity=None)
    record = {
        "name": variant.name,
        "technique": variant.technique,
        "setting": variant.setting,
        "seed": seed,
        **({} if config.fold is None else {"fold": config.fold, "folds": config.folds}),
        "plan": plan.to_dict(),
        "decompose": variant.decompose,
        "sparse": None if config.plan.sparsity is None else sparse_fields(config.plan.sparsity),
        "metric": metric_name(task),
        "value": summary[metric_name(task)],
        "wall_seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    keep = (
        "test_examples",
        "test_accuracy",
        "token_accuracy",
        "bleu_greedy",
        "exact_match_greedy",
        "skipped_steps",
        "train_seconds",
        "steps",
        "sparsity",
        "param_count",
        "test_loss",
        "test_bits_per_byte",
        "corpus",
    )
    record.update({k: summary[k] for k in keep if k in summary})
    return record


def run_variants(
    task: str,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    out_dir: str,
    log: Callable[[str], None] | None = print,
    folds: int | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, dict]:
    """Trains every (variant, seed) not already in ``<out_dir>/runs``; returns all records.

    Seeds are the outer loop, so a cut-short invocation has every variant at the first seeds.
    ``folds`` (digits): cross-validation, every (variant, seed, fold) for fold in
    ``range(folds)`` (``TrainConfig.fold``), recorded as ``<variant>_seed<seed>_fold<fold>``;
    ``decompose`` variants are not supported there. ``config``: :class:`TrainConfig` fields
    every run takes instead of the task's (e.g. another ``dataset``).
    A ``decompose`` variant fine-tunes the baseline of its seed, whose checkpoint is kept in
    ``<out_dir>/checkpoints/baseline_seed<seed>`` (the baseline is trained, with checkpoints,
    when that directory has none; its record is the same either way).
    """
    runs_dir = os.path.join(out_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    records = load_runs(out_dir)
    baseline = next(
        (v for v in variants if v.name == "baseline"), Variant("baseline", "baseline", "")
    )

    def run(variant: Variant, seed: int, **overrides: Any) -> dict:
        key = run_key(variant.name, seed, overrides.get("fold"))
        if log:
            log(f"[{time.strftime('%H:%M:%S')}] {task}: {key}")
        record = train_once(task, variant, seed, **(config or {}), **overrides)
        path = os.path.join(runs_dir, key + ".json")
        with open(path + ".tmp", "w") as f:  # written whole, then renamed: never partial
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)
        records[key] = record
        if log:
            log(f"    {record['metric']} {record['value']:.4f}  ({record['wall_seconds']:.0f}s)")
        return record

    if folds is not None:
        if any(v.decompose for v in variants):
            raise ValueError("cross-validation (folds) does not run decompose variants")
        for seed in seeds:
            for fold in range(folds):
                for variant in variants:
                    if run_key(variant.name, seed, fold) not in records:
                        run(variant, seed, fold=fold, folds=folds)
        return records
    for seed in seeds:
        dense_dir = os.path.join(out_dir, "checkpoints", f"baseline_seed{seed}")
        needs_dense = any(v.decompose for v in variants)
        for variant in variants:
            if variant.decompose and not checkpoint_steps(dense_dir):
                run(baseline, seed, checkpoint_dir=dense_dir)
            if f"{variant.name}_seed{seed}" in records:
                continue
            if variant.decompose:
                run(variant, seed, decompose_from=dense_dir)
            elif variant.name == baseline.name and needs_dense:
                run(variant, seed, checkpoint_dir=dense_dir)
            else:
                run(variant, seed)
    return records


def run_key(name: str, seed: int, fold: int | None = None) -> str:
    """A run's record name: ``<name>_seed<seed>`` (``_fold<fold>`` under cross-validation)."""
    return f"{name}_seed{seed}" + ("" if fold is None else f"_fold{fold}")


def load_runs(out_dir: str) -> dict[str, dict]:
    runs_dir = os.path.join(out_dir, "runs")
    records = {}
    if os.path.isdir(runs_dir):
        for fname in sorted(os.listdir(runs_dir)):
            if fname.endswith(".json"):
                with open(os.path.join(runs_dir, fname)) as f:
                    records[fname[: -len(".json")]] = json.load(f)
    return records


def _spread(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
    }


def summarize(records: dict[str, dict], baseline: str = "baseline") -> list[dict[str, Any]]:
    """One row per variant: the metric's mean / std / range over seeds, and the paired
    difference to ``baseline`` (same seed) with its mean / std / range and, from two seeds on,
    its 95% t interval (``ci95``)."""
    by_name: dict[str, dict[int, dict]] = {}
    for r in records.values():
        by_name.setdefault(r["name"], {})[r["seed"]] = r
    base = by_name.get(baseline, {})
    rows = []
    for name, per_seed in by_name.items():
        seeds = sorted(per_seed)
        values = [per_seed[s]["value"] for s in seeds]
        paired = [per_seed[s]["value"] - base[s]["value"] for s in seeds if s in base]
        first = per_seed[seeds[0]]
        delta = _spread(paired) if paired else None
        if delta is not None and len(paired) >= 2 and name != baseline:
            delta.update(pairs=len(paired), ci95=list(corrected_t_interval(paired, 0.0)))
        rows.append(
            {
                "name": name,
                "technique": first["technique"],
                "setting": first["setting"],
                "metric": first["metric"],
                "seeds": seeds,
                "value": _spread(values),
                "delta_vs_baseline": delta,
                "skipped_steps": [per_seed[s].get("skipped_steps") for s in seeds],
                "density": [(per_seed[s].get("sparsity") or {}).get("density") for s in seeds],
                "train_seconds": statistics.mean(per_seed[s]["train_seconds"] for s in seeds),
            }
        )
    return rows


def corrected_t_interval(
    deltas: Sequence[float], test_fraction: float, level: float = 0.95
) -> tuple[float, float]:
    """The interval for the mean of cross-validated paired ``deltas`` by the corrected
    resampled t-test (Nadeau & Bengio 2003): ``mean +- t_{n-1} * sqrt((1/n + n_test/n_train)
    * s^2)``, ``n = len(deltas)``, ``s^2`` their sample variance. The ``n_test / n_train`` term
    (``test_fraction / (1 - test_fraction)``) accounts for the training sets overlapping, which
    the plain ``1/n`` would ignore (intervals too narrow). ``test_fraction=0``: the plain
    paired t interval (independent pairs, e.g. seeds)."""
    from scipy import stats

    n = len(deltas)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 deltas, got {n}")
    mean = statistics.mean(deltas)
    var = statistics.variance(deltas) * (1.0 / n + test_fraction / (1.0 - test_fraction))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * var**0.5
    return mean - half, mean + half


def _pooled(runs: dict[tuple[int, int], dict], seed: int, folds: int) -> float | None:
    """Accuracy over every fold of ``seed`` (each image once), ``None`` if a fold is missing."""
    mine = [r for (s, _), r in runs.items() if s == seed]
    if len(mine) < folds:
        return None
    return sum(r["value"] * r["test_examples"] for r in mine) / sum(
        r["test_examples"] for r in mine
    )


def summarize_cv(records: dict[str, dict], baseline: str = "baseline") -> list[dict[str, Any]]:
    """One row per variant of a cross-validated study (:func:`run_variants` with ``folds``).

    Per seed, the pooled accuracy over its folds (every image tested once: correct / images);
    per (seed, fold), the paired difference to ``baseline`` of the same split; their mean and
    the corrected resampled t interval (:func:`corrected_t_interval`, 95%). Only the (seed,
    fold) pairs both ran count."""
    by_name: dict[str, dict[tuple[int, int], dict]] = {}
    for r in records.values():
        if "fold" in r:
            by_name.setdefault(r["name"], {})[(r["seed"], r["fold"])] = r
    base = by_name.get(baseline, {})
    rows = []
    for name, runs in by_name.items():
        splits = sorted(runs)
        seeds = sorted({seed for seed, _ in splits})
        first = runs[splits[0]]
        folds = first["folds"]

        per_seed = {seed: _pooled(runs, seed, folds) for seed in seeds}
        paired = [runs[k]["value"] - base[k]["value"] for k in splits if k in base]
        row = {
            "name": name,
            "technique": first["technique"],
            "setting": first["setting"],
            "metric": first["metric"],
            "seeds": seeds,
            "folds": folds,
            "runs": len(splits),
            "pooled_by_seed": per_seed,
            "value": _spread([runs[k]["value"] for k in splits]),
            "delta_vs_baseline": None,
            "skipped_steps": sum(runs[k].get("skipped_steps") or 0 for k in splits),
            "train_seconds": statistics.mean(runs[k]["train_seconds"] for k in splits),
        }
        if name != baseline and len(paired) >= 2:
            low, high = corrected_t_interval(paired, 1.0 / folds)
            row["delta_vs_baseline"] = {**_spread(paired), "pairs": len(paired),
                                        "ci95": [low, high]}  # fmt: skip
        rows.append(row)
    return rows


def environment() -> dict[str, str]:
    return {
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "platform": platform.platform(),
    }


def _fmt(x: float | None, scale: float, digits: int, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x * scale:+.{digits}f}" if sign else f"{x * scale:.{digits}f}"


def accuracy_table(rows: list[dict[str, Any]], task: str) -> str:
    """Markdown: one line per variant, metric in points (accuracy in %, BLEU as is)."""
    scale = 100.0 if task == "digits" else 1.0
    unit = {"digits": "test acc %", "lm": "held-out loss (nats/byte)"}.get(task, "BLEU (greedy)")
    digits = 4 if task == "lm" else 2
    lines = [
        f"| config | technique | seeds | {unit} mean | std | min-max | paired delta vs baseline "
        "(mean, std) | skipped steps | train s (mean) |",
        "|---|---|---|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        v, d = r["value"], r["delta_vs_baseline"]
        delta = "-"
        if d is not None:
            delta = f"{_fmt(d['mean'], scale, digits, True)} ({_fmt(d['std'], scale, digits)})"
        lines.append(
            f"| {r['setting']} | {r['technique']} | {len(r['seeds'])} | "
            f"{_fmt(v['mean'], scale, digits)} | {_fmt(v['std'], scale, digits)} | "
            f"{_fmt(v['min'], scale, digits)}-{_fmt(v['max'], scale, digits)} | {delta} | "
            f"{r['skipped_steps']} | {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_accuracy(
    rows: list[dict[str, Any]], task: str, path: str, title: str | None = None
) -> None:
    """Bar chart of the paired difference to the baseline, with the seeds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = 100.0 if task == "digits" else 1.0
    sel = [r for r in rows if r["delta_vs_baseline"] is not None and r["name"] != "baseline"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(sel) + 1.5))
    techniques = sorted({r["technique"] for r in sel})
    colors = {t: f"C{i}" for i, t in enumerate(techniques)}
    for i, r in enumerate(sel):
        d = r["delta_vs_baseline"]
        ax.barh(i, d["mean"] * scale, color=colors[r["technique"]])
        ax.plot([d["min"] * scale, d["max"] * scale], [i, i], color="k", lw=1)
    ax.set_yticks(range(len(sel)), [r["setting"] for r in sel])
    ax.axvline(0, color="k", lw=0.8)
    ax.invert_yaxis()
    unit = "test accuracy (points)" if task == "digits" else "greedy BLEU"
    ax.set_xlabel(f"{unit} minus the baseline of the same seed (bar: mean, line: range)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[t]) for t in techniques]
    ax.legend(handles, techniques, fontsize=8, loc="lower left")
    ax.set_title(title or f"Each technique alone: {task} (CPU scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
