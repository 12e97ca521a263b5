"""The conformance table: every technique, a strong combination and six optimizers on
models nobody on this project wrote (:mod:`experiments.conformance_models`).

Each cell builds the step through the public API (``plan.configure_model``,
``plan.wrap_optimizer``, ``TrainState.create``, ``make_train_step``), compiles it (XLA:CPU
figures), runs ``STEPS`` steps on one batch (the loss must fall, no step skipped) and reads
``lm.verdicts``. A plan the model cannot take is a refusal: its one-line error is the cell.
Optimizer-state rows also check the conformance rule against the model's plain step with the same
optimizer: total <= plain total - 0.9 x the argument bytes saved.

Usage: python experiments/conformance.py [--models a,b] [--rows "row,row"] [--smallest]
[--out-dir DIR]; the smallest plans were computed one model per process (``for m in gpt2
linen_resnet linen_lm_scan nnx_scan nnx_cnn; do python experiments/conformance.py --smallest
--models $m; done``): one process holding every search's executables ran out of memory for
LLVM's code.
Writes ``conformance.json`` and ``conformance.md`` (default ``experiments/results/conformance``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import jax
import numpy as np
import optax

import lowmem_jax as lm
from lowmem_jax.planning.smallest import smallest_plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import conformance_models  # noqa: E402
from experiments.conformance_models import MODELS  # noqa: E402

STEPS = 4
MIB = 2.0**20
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "conformance")
COMMAND = "python experiments/conformance.py"

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-4),
    "lamb": lambda: optax.lamb(1e-3),
}


def techniques(block: str) -> dict[str, dict]:
    """Plan fields per row: each technique alone, then one strong combination. Remat names no
    block: the plan finds the model's repeated blocks (``block`` is the one a user would name;
    the verdict counts the regions)."""
    remat = {"remat": "full"}
    sparse = lm.sparsity.report_sparsity(0.7)  # DSR, uniform, compressed (the report's)
    return {
        "plain": {},
        "mixed_fp16": {"precision": "mixed_fp16"},
        "fp16": {"precision": "fp16"},
        "microbatches 2": {"microbatches": 2},
        "remat full": remat,
        "sparse 70% dsr": {"sparsity": sparse},
        "remat full + sparse 70% dsr": {"sparsity": sparse, **remat},
        "act int8": {"activations": "int8"},
        "remat full + act int8": {"activations": "int8", **remat},
        "state bf16": {"optimizer_state": "bf16"},
        "state int8": {"optimizer_state": "int8"},
        "state int4": {"optimizer_state": "int4"},
        "factorize tucker": {"factorize": lm.FactorConfig()},
        "mixed_fp16 + microbatches 2 + remat + int8": {
            "precision": "mixed_fp16",
            "microbatches": 2,
            "optimizer_state": "int8",
            **remat,
        },
    }


def run_cell(model: str, fields: dict, optimizer: str) -> dict:
    """One cell: ``status`` (ok / refused / error), figures, verdicts, and the warnings the
    library gave while building, tracing and compiling it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cell = _run_cell(model, fields, optimizer)
    if cell["status"] not in ("refused", "error"):
        cell["warnings"] = sorted({str(w.message).splitlines()[0] for w in caught})
        mine = {str(w.message).splitlines()[0] for w in caught if _LIBRARY in w.filename}
        cell["library_warnings"] = sorted(mine)
    return cell


_LIBRARY = os.path.dirname(lm.__file__)


def _run_cell(model: str, fields: dict, optimizer: str) -> dict:
    workload, _, _ = MODELS[model]
    started = time.perf_counter()
    try:  # the library's checks: a plan the model cannot take is refused here, in one line
        plan = lm.Plan(**fields)
        subject = conformance_models.subject(workload(), plan)
        tx = plan.wrap_optimizer(OPTIMIZERS[optimizer](), subject.params)
        state = lm.TrainState.create(
            params=subject.params,
            tx=tx,
            plan=plan,
            model_state=subject.model_state,
            rng=jax.random.key(0),
        )
        step = lm.make_train_step(subject.loss_fn, tx, plan)  # donated, as users run it
    except (ValueError, TypeError, NotImplementedError) as err:
        return {"status": "refused", "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    try:  # past the checks, anything that breaks is a failure of the technique
        verdicts = lm.verdicts(
            step, state, subject.batch, plan=plan, tx=tx, loss_fn=subject.loss_fn
        )
        compiled = step.lower(state, subject.batch).compile()
    except Exception as err:  # noqa: BLE001 -- the table records what broke
        message = str(err).splitlines()[0][:300] if str(err) else ""
        return {"status": "error", "error": f"{type(err).__name__}: {message}"}
    memory = compiled.memory_analysis()
    peak = None
    if plan.activations != "none":  # where the step's peak is: can compression reach it?
        inspection = lm.inspect(step, state, subject.batch)
        peak = {
            "bytes": inspection.peak_bytes,
            "instruction": inspection.peak_instruction,
            "saved_residual_bytes": inspection.by_category().get("saved residual", 0),
        }
    losses, skipped = [], 0
    for _ in range(STEPS):
        state, metrics = compiled(state, subject.batch)
        losses.append(float(metrics["loss"]))
        skipped = int(metrics["skipped_steps"])
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )
    falls = bool(np.isfinite(losses).all() and losses[-1] < losses[0])
    return {
        "status": "ok" if falls and skipped == 0 else "no progress",
        "losses": losses,
        "skipped_steps": skipped,
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "total_bytes": int(total),
        **({"peak": peak} if peak else {}),
        "verdicts": [
            {"technique": v.technique, "took_effect": v.took_effect, "evidence": v.evidence}
            for v in verdicts
        ],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _state_rule(cell: dict, plain: dict) -> dict | None:
    """The rule for a stored-state row against the plain step with the same optimizer:
    total <= plain total - 0.9 x the argument bytes saved."""
    if cell.get("status") != "ok" or plain.get("status") != "ok":
        return None
    saved = plain["argument_bytes"] - cell["argument_bytes"]
    limit = plain["total_bytes"] - 0.9 * saved
    return {"saved_bytes": saved, "limit_bytes": int(limit), "holds": cell["total_bytes"] <= limit}


def _sparse_rule(cell: dict, plain: dict) -> dict | None:
    """The rule for compressed sparse storage: the dense weights built from it raise temp
    by at most 10% of the argument bytes it saves (against the same plan without sparsity)."""
    if cell.get("status") != "ok" or plain.get("status") != "ok":
        return None
    saved = plain["argument_bytes"] - cell["argument_bytes"]
    limit = plain["temp_bytes"] + 0.1 * saved
    return {"saved_bytes": saved, "limit_bytes": int(limit), "holds": cell["temp_bytes"] <= limit}


def _activation_rule(cell: dict, twin: dict) -> dict | None:
    """Compressed activations must lower the step's total against the same plan without them,
    or, where saved residuals are under 1% of the bytes live at the step's peak (the
    inspector's count: nothing there for them to compress), raise it by at most 0.1% (their
    scales and offsets)."""
    if cell.get("status") != "ok" or twin.get("status") != "ok":
        return None
    limit = twin["total_bytes"]
    rule = {"limit_bytes": int(limit), "holds": cell["total_bytes"] < limit}
    peak = cell.get("peak")
    if not rule["holds"] and peak and peak["saved_residual_bytes"] < 0.01 * peak["bytes"]:
        rule["holds"] = cell["total_bytes"] <= 1.001 * limit
        rule["peak_without_residuals"] = peak["instruction"].split(":")[0]
    return rule


STATE_ROWS = ("state bf16", "state int8", "state int4")
#: Each compressed-activations row and the row it is measured against (the same plan without).
ACTIVATION_ROWS = {"act int8": "plain", "remat full + act int8": "remat full"}
#: Each compressed sparse row and the row it is measured against (the same plan, dense).
SPARSE_ROWS = {"sparse 70% dsr": "plain", "remat full + sparse 70% dsr": "remat full"}


#: Each combination row and the rows of its parts.
COMBINATION_ROWS = {
    "remat full + sparse 70% dsr": ("remat full", "sparse 70% dsr"),
    "remat full + act int8": ("remat full", "act int8"),
    "mixed_fp16 + microbatches 2 + remat + int8": (
        "mixed_fp16", "microbatches 2", "remat full", "state int8",
    ),
}  # fmt: skip
#: How far a combination's temp and total may exceed the worst of its parts'.
COMBINATION_TOLERANCE = 0.05


def _combination_rule(cell: dict, parts: list[dict]) -> dict | None:
    """A combination costs no more than its parts: its temp and its total each at most
    ``1 + COMBINATION_TOLERANCE`` times the largest of its parts' (same optimizer)."""
    if cell.get("status") != "ok" or any(p.get("status") != "ok" for p in parts) or not parts:
        return None
    limits = {
        key: int(max(p[f"{key}_bytes"] for p in parts) * (1 + COMBINATION_TOLERANCE))
        for key in ("temp", "total")
    }
    holds = all(cell[f"{key}_bytes"] <= limit for key, limit in limits.items())
    return {"temp_limit_bytes": limits["temp"], "total_limit_bytes": limits["total"],
            "holds": holds}  # fmt: skip


def _exactness(cell: dict, plain: dict) -> dict | None:
    """A remat row's losses against the plain step's (same initialisation, batch and dropout
    keys: remat recomputes, it must not change the values): bitwise, or the largest relative
    difference (XLA may fuse the recomputed program differently)."""
    if cell.get("status") != "ok" or plain.get("status") != "ok":
        return None
    a, b = np.asarray(cell["losses"]), np.asarray(plain["losses"])
    diff = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))
    return {"bitwise": bool(np.array_equal(a, b)), "max_relative_difference": diff}


def add_rules(result: dict) -> dict:
    """Each state row's and sparse row's rule against its model's plain row (same optimizer),
    the remat row's exactness, and each combination row's parts rule."""
    for entry in result["models"].values():
        rows = entry["rows"]
        if "remat full" in rows:
            rows["remat full"]["adam"]["exact"] = _exactness(
                rows["remat full"]["adam"], rows["plain"]["adam"]
            )
        for twins, rule, key in (
            (dict.fromkeys(STATE_ROWS, "plain"), _state_rule, "total"),
            (SPARSE_ROWS, _sparse_rule, "temp"),
            (ACTIVATION_ROWS, _activation_rule, "total"),
        ):
            for name, twin in twins.items():
                for optimizer, cell in rows.get(name, {}).items():
                    plain = rows.get(twin, {}).get(optimizer, {})
                    cell["rule"] = rule(cell, plain)
                    if cell["rule"] is not None:
                        cell["rule"]["of"] = key
                    cell.pop("state_rule", None)
        for name, parts in COMBINATION_ROWS.items():
            for optimizer, cell in rows.get(name, {}).items():
                found = [rows.get(p, {}).get(optimizer, {}) for p in parts]
                cell["combination"] = _combination_rule(cell, found)
    return result


def run(models: list[str], only: list[str] | None = None, previous: dict | None = None) -> dict:
    """The table for ``models``; ``only``: just these rows, the rest kept from ``previous``."""
    out: dict = {"command": COMMAND, "jax_version": jax.__version__, "steps": STEPS, "models": {}}
    if previous is not None:
        out["models"] = previous["models"]
    for model in models:
        _, block, source = MODELS[model]
        rows: dict = dict(out["models"].get(model, {}).get("rows", {})) if only else {}
        for name, fields in techniques(block).items():
            if only and name not in only:
                continue
            rows[name] = {"adam": run_cell(model, fields, "adam")}
            jax.clear_caches()  # each cell's executables: LLVM ran out of memory holding them all
            print(model, name, rows[name]["adam"]["status"], flush=True)
            if name not in ("plain", "state int8"):
                continue
            for optimizer in OPTIMIZERS:
                if optimizer != "adam":
                    rows[name][optimizer] = run_cell(model, fields, optimizer)
                    jax.clear_caches()
                    print(model, name, optimizer, rows[name][optimizer]["status"], flush=True)
        order = list(techniques(block))
        rows = {name: rows[name] for name in sorted(rows, key=order.index)}
        entry = {**out["models"].get(model, {}), "source": source, "remat_block": block}
        out["models"][model] = {**entry, "rows": rows}
    return out


def run_smallest(result: dict, models: list[str]) -> dict:
    """Each model's smallest plan inside the report's envelope and outside it, against its plain
    step (``lm.workloads.build_plain``: float32, no technique, the same Adam)."""
    for model in models:
        work = MODELS[model][0]()
        plain = lm.workloads.build_plain(work).analyze().xla["total_bytes"]
        found = {"plain_total_bytes": plain}
        for envelope in ("report", "any"):
            _, found[envelope] = smallest_plan(work, envelope)
            print(model, envelope, found[envelope]["plan"], flush=True)
        result["models"][model]["smallest"] = found
    return result


def _cell_text(cell: dict) -> str:
    if cell["status"] in ("refused", "error"):
        return f"{cell['status']}: {cell['error']}"
    text = f"{cell['status']}; total {cell['total_bytes'] / MIB:.1f} MiB, temp "
    text += f"{cell['temp_bytes'] / MIB:.1f}"
    rule = cell.get("rule")
    if rule is not None:
        verdict = "holds" if rule["holds"] else "FAILS"
        relation = "<" if "saved_bytes" not in rule else "<="
        text += f" (rule {verdict}: {rule['of']} {relation} {rule['limit_bytes'] / MIB:.1f}"
        if "peak_without_residuals" in rule:
            where = rule["peak_without_residuals"]
            text += f", or within 0.1% with saved residuals < 1% of the peak, at `{where}`"
        text += ")"
    combination = cell.get("combination")
    if combination is not None:
        verdict = "holds" if combination["holds"] else "FAILS"
        text += (
            f" (parts rule {verdict}: temp <= {combination['temp_limit_bytes'] / MIB:.1f}, "
            f"total <= {combination['total_limit_bytes'] / MIB:.1f})"
        )
    exact = cell.get("exact")
    if exact is not None:
        text += "; losses equal plain's " + (
            "bitwise" if exact["bitwise"]
            else f"to {exact['max_relative_difference']:.1e} relative"
        )  # fmt: skip
    mine = [v for v in cell["verdicts"] if not v["took_effect"]]
    if mine:
        text += "; NO EFFECT: " + "; ".join(f"{v['technique']}: {v['evidence']}" for v in mine)
    if cell.get("library_warnings"):
        text += "; warned: " + "; ".join(cell["library_warnings"])
    return text


def markdown(result: dict) -> str:
    lines = [
        "# Conformance: every technique on models this project did not write",
        "",
        f"Made by: `{result['command']}` (JAX {result['jax_version']}, XLA:CPU, compile + "
        f"{result['steps']} steps on one batch each). A cell is `ok` when the step compiles, no "
        "step is skipped and the loss falls; memory is XLA:CPU's total (argument + output + temp "
        "- alias) of the step as `lm.make_train_step` builds it (state donated); rows check "
        "the conformance rules against the plain step with the same optimizer: a stored state, "
        "total "
        "<= plain total - 0.9 x argument bytes saved; compressed sparse storage, temp <= temp "
        "of the same plan dense (`plain`, `remat full`) + 0.1 x argument bytes saved; "
        "compressed activations, total < total of the same plan without them, or within 0.1% "
        "of it where `lm.inspect` finds saved residuals under 1% of the step's peak; remat "
        "(its blocks found by the plan, none named) must leave the losses as they are; a "
        "combination (the parts rule) costs no more than its parts: temp and total each at "
        f"most {1 + COMBINATION_TOLERANCE:g}x the largest of its parts' rows. "
        "`refused` is the one-line error a plan the model cannot take gets; NO EFFECT names a "
        "technique whose verdict says it changed nothing; `warned` quotes a warning the library "
        "gave while the cell was built, traced or compiled.",
        "",
    ]
    lines += _smallest_table(result)
    for model, entry in result["models"].items():
        lines += [
            f"## {model}: {entry['source']}",
            "",
            "| row | optimizer | result |",
            "|---|---|---|",
        ]
        for name, cells in entry["rows"].items():
            for optimizer, cell in cells.items():
                lines.append(f"| {name} | {optimizer} | {_cell_text(cell)} |")
        lines.append("")
    return "\n".join(lines)


def _smallest_table(result: dict) -> list[str]:
    rows = [(m, e["smallest"]) for m, e in result["models"].items() if "smallest" in e]
    if not rows:
        return []
    lines = [
        "## The least memory each model trains in (the planner's search on the model)",
        "",
        f"`{COMMAND} --smallest`: `lm.custom_workload` of each model (Adam), the least-memory "
        "plans of every compute class it can take, the 6 with the least predicted bytes compiled "
        "(XLA:CPU total), against its plain step (float32, no technique). Inside the report's "
        "envelope: fp32 master weights, microbatches of at least 8 examples with BatchNorm, at "
        "most 70% sparsity.",
        "",
        "| model | plain MiB | report's envelope | MiB | reduction | any | MiB | reduction |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for model, found in rows:
        plain = found["plain_total_bytes"]
        cells = []
        for envelope in ("report", "any"):
            total = found[envelope]["total_bytes"]
            cells.append(f"`{found[envelope]['plan']}` | {total / MIB:.1f} | {plain / total:.1f}x")
        lines.append(f"| {model} | {plain / MIB:.1f} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out-dir", default=OUT)
    parser.add_argument(
        "--rows",
        default=None,
        help="comma-separated rows to rerun (e.g. 'factorize tucker'); the others are kept from "
        "the existing conformance.json",
    )
    parser.add_argument(
        "--render", action="store_true", help="rewrite conformance.md from conformance.json"
    )
    parser.add_argument(
        "--smallest",
        action="store_true",
        help="(re)compute each model's smallest plan in both envelopes, the cells kept from the "
        "existing conformance.json",
    )
    args = parser.parse_args(argv)
    json_path = os.path.join(args.out_dir, "conformance.json")
    if args.smallest:
        with open(json_path) as f:
            result = run_smallest(json.load(f), args.models.split(","))
        _write(add_rules(result), args.out_dir)
        return 0
    if args.render:
        with open(json_path) as f:
            result = add_rules(json.load(f))
        _write(result, args.out_dir)
        return 0
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed values: {list(MODELS)}")
    only, previous = None, None
    if os.path.exists(json_path):  # other models, and each model's --smallest section, are kept
        with open(json_path) as f:
            previous = json.load(f)
    if args.rows:
        only = args.rows.split(",")
        unknown = sorted(set(only) - set(techniques("Block")))
        if unknown:
            parser.error(f"--rows: unknown {unknown}; allowed values: {list(techniques('Block'))}")
        if previous is None:
            parser.error(f"--rows: no {json_path} to keep the other rows from")
    _write(add_rules(run(models, only, previous)), args.out_dir)
    return 0


def _write(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "conformance.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "conformance.md"), "w") as f:
        f.write(markdown(result) + "\n")


if __name__ == "__main__":
    sys.exit(main())
