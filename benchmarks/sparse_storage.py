"""Dense vs masked vs compressed sparse storage: bytes and time of one WRN train step.

For each configuration, in one run on the machine at hand (fp32, SGD Nesterov momentum 0.9, no
microbatching, no remat, the lowmem step with the state donated):

* XLA's compiled memory figures (argument, output, alias, temp, total = argument + output + temp
  - alias), from ``step.lower(state, batch).compile().memory_analysis()``; the argument bytes
  include the batch (the same in every row);
* the analytic *stored* bytes: parameters as stored + every optimizer-state leaf (momentum,
  masks or int32 indices, counters), the transient gradient excluded
  (:func:`lowmem_jax.analysis.memory.analytic_breakdown`, source: analytic);
* the measured step time: every configuration is compiled and warmed up first, then timed in
  ``--repeats`` interleaved rounds (one step of each configuration per round, so a shared
  machine's load falls on all alike; the median is reported) on steps that do not rewire the
  masks, then one step that does (``rewire_step_seconds``: the sparse state's step counter is
  set so that the next step is a mask update; same executable);

each as a ratio to dense in the same run. The sparse rows run DSR (uniform distribution,
capacity 1.25x in compressed storage) and RigL (ERK, capacity 1x) at ``--sparsity``.

Masked storage keeps a bool mask per sparse weight, 1 byte, as a uint8 mask would: a "uint8
mask" row would have the same bytes, so there is none.

Usage:
    python benchmarks/sparse_storage.py                    # WRN-28-2, batch 128, 90% sparsity
    python benchmarks/sparse_storage.py --configs dense,compressed_rigl --repeats 2

Writes ``<out-dir>/sparse_storage_<model>_b<batch>_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowmem_jax as lm
from lowmem_jax.analysis import memory
from lowmem_jax.analysis.memory import xla_memory
from lowmem_jax.techniques import sparsity
from lowmem_jax.workloads import workload

# name -> (storage, algorithm, distribution); "dense" has no sparsity.
CONFIGS: dict[str, tuple[str, str, str] | None] = {
    "dense": None,
    "masked_dsr": ("masked", "dsr", "uniform"),
    "masked_rigl": ("masked", "rigl", "erk"),
    "compressed_dsr": ("compressed", "dsr", "uniform"),
    "compressed_rigl": ("compressed", "rigl", "erk"),
}
UPDATE_PERIOD = 100


def build(name: str, model_name: str, batch_size: int, sparsity_level: float):
    """Returns (step, state, batch, tx) for ``name``; ``tx.sparse`` is None when dense."""
    rng = np.random.default_rng(0)
    batch = {
        "image": jnp.asarray(rng.normal(size=(batch_size, 32, 32, 3)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, size=batch_size), jnp.int32),
    }
    dense_plan = lm.Plan()  # fp32, 1 microbatch, no remat
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    plan = dense_plan
    if CONFIGS[name] is not None:
        storage, algorithm, distribution = CONFIGS[name]
        cfg = sparsity.SparseConfig(
            algorithm=algorithm,
            density=round(1.0 - sparsity_level, 6),
            distribution=distribution,
            update_period=UPDATE_PERIOD,
            compressed=storage == "compressed",
        )
        plan = dataclasses.replace(dense_plan, sparsity=cfg)
    # The plan configures the model (compressed storage: each layer densified inside its own
    # checkpoint); the parameters are the same for every config.
    model = plan.configure_model(workload(model_name).model)
    variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(batch["image"][:2])
    model_state = {"batch_stats": variables["batch_stats"]}
    loss_fn = lm.classifier_loss_fn(model)
    tx = plan.wrap_optimizer(tx, variables["params"])
    state = lm.TrainState.create(
        params=variables["params"], model_state=model_state, tx=tx, plan=plan
    )
    step = lm.make_train_step(loss_fn, tx, plan)
    return step, state, batch, tx


def _set_count(opt_state, count: int):
    """The same optimizer state with the sparse wrapper's step counter set to ``count``."""

    def fix(node):
        if isinstance(node, sparsity.SparseState):
            return node._replace(count=jnp.asarray(count, node.count.dtype))
        return node

    return jax.tree.map(fix, opt_state, is_leaf=lambda n: isinstance(n, sparsity.SparseState))


def prepare(name: str, model_name: str, batch_size: int, sparsity_level: float) -> dict:
    """Builds, analyses and compiles configuration ``name``, and runs its warm-up step."""
    step, state, batch, tx = build(name, model_name, batch_size, sparsity_level)
    sparse = tx if CONFIGS[name] is not None else None
    analytic = memory.analytic_breakdown(state=state, batch=batch, tx=tx)
    slots = {k: v for k, v in analytic["optimizer_breakdown"].items() if k.startswith("slot:")}
    stored = {
        "model_bytes": analytic["model_bytes"],
        "optimizer_state_bytes": sum(slots.values()),
        "optimizer_state": slots,
        "stored_bytes": analytic["model_bytes"] + sum(slots.values()),
        "transient_gradient_bytes": analytic["optimizer_breakdown"]["gradients"],
    }
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, _ = compiled(state, batch)  # warm-up
    jax.block_until_ready(state)
    xla = xla_memory(compiled)
    row = {
        "name": name,
        "storage": "dense" if CONFIGS[name] is None else CONFIGS[name][0],
        "algorithm": None if CONFIGS[name] is None else CONFIGS[name][1],
        "distribution": None if CONFIGS[name] is None else CONFIGS[name][2],
        "sparsity": 0.0 if CONFIGS[name] is None else sparsity_level,
        "xla": xla,
        "batch_bytes": int(sum(x.nbytes for x in jax.tree.leaves(batch))),
        "analytic": stored,
        "compile_seconds": compile_s,
        "step_seconds_all": [],
        "rewire_step_seconds": None,
    }
    if sparse is not None:
        row["capacity_factor"] = sparse.config.capacity
    return {"row": row, "compiled": compiled, "state": state, "batch": batch, "sparse": sparse}


def timed_step(entry: dict) -> float:
    """Runs one step of a prepared configuration; returns its wall time in seconds."""
    start = time.perf_counter()
    entry["state"], _ = entry["compiled"](entry["state"], entry["batch"])
    jax.block_until_ready(entry["state"])
    return time.perf_counter() - start


def measure_all(entries: list[dict], repeats: int) -> None:
    """Interleaved timing: ``repeats`` rounds, each one step of every configuration in turn, so
    a shared machine's load falls on all of them alike; then one rewiring step per sparse one."""
    for _ in range(repeats):
        for e in entries:
            e["row"]["step_seconds_all"].append(timed_step(e))
    for e in entries:
        e["row"]["step_seconds"] = statistics.median(e["row"]["step_seconds_all"])
        if e["sparse"] is not None:
            # The next step is a mask update (count % UPDATE_PERIOD == 0), same executable.
            state = e["state"]
            e["state"] = state.replace(opt_state=_set_count(state.opt_state, UPDATE_PERIOD - 1))
            jax.block_until_ready(e["state"])
            e["row"]["rewire_step_seconds"] = timed_step(e)
            report = sparsity.density_report(e["sparse"], e["state"].opt_state)
            e["row"]["density_after"] = report["density"]


def to_markdown(result: dict) -> str:
    rows = result["configs"]
    mib = 2.0**20
    lines = [
        f"Sparse storage, `{result['model']}`, batch {result['batch_size']}, "
        f"{100 * result['sparsity']:.0f}% sparsity, fp32, SGD Nesterov momentum, backend "
        f"XLA:{result['backend'].upper()} ({result['machine']}). Command: "
        f"`{result['command']}`.",
        "",
        "XLA figures are compiled memory (source: XLA:CPU; argument bytes include the "
        f"{rows[0]['batch_bytes'] / mib:.2f} MiB batch). *Stored* is analytic: parameters as "
        "stored + optimizer state (momentum, bool masks or int32 indices), the transient "
        "gradient excluded. Times: median of "
        f"{result['repeats']} interleaved rounds (one step of every config per round, after "
        "a warm-up step each) of steps that do not rewire, and one step that does (one "
        "sample, noisy); *paired* is the median over rounds of the ratio within a round, "
        "with its range; every ratio is against `dense` in the same run. A uint8 mask would cost "
        "the same 1 byte per weight as the bool mask used here, so there is no separate row.",
        "",
        "| config | argument MiB | output MiB | alias MiB | temp MiB | total MiB | stored MiB "
        "| argument / dense | temp / dense | total / dense | stored / dense | step s "
        "| time / dense | paired time / dense (range) | rewire step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = r["xla"]
        rewire = "-" if r["rewire_step_seconds"] is None else f"{r['rewire_step_seconds']:.2f}"
        lines.append(
            f"| {r['name']} | {x['argument_bytes'] / mib:.2f} | {x['output_bytes'] / mib:.2f} "
            f"| {x['alias_bytes'] / mib:.2f} | {x['temp_bytes'] / mib:.1f} "
            f"| {x['total_bytes'] / mib:.1f} | {r['analytic']['stored_bytes'] / mib:.2f} "
            f"| {r['argument_ratio']:.3f} | {r['temp_ratio']:.3f} | {r['total_ratio']:.3f} "
            f"| {r['stored_ratio']:.3f} | {r['step_seconds']:.2f} | {r['time_ratio']:.2f} "
            f"| {r['time_ratio_paired']:.2f} ({r['time_ratio_paired_range'][0]:.2f}-"
            f"{r['time_ratio_paired_range'][1]:.2f}) | {rewire} |"
        )
    lines += ["", "Stored bytes by part (MiB):", ""]
    lines += ["| config | parameters | optimizer state (by leaf) |", "|---|---:|---|"]
    for r in rows:
        a = r["analytic"]
        parts = ", ".join(f"{k[5:]} {v / mib:.2f}" for k, v in a["optimizer_state"].items())
        lines.append(f"| {r['name']} | {a['model_bytes'] / mib:.2f} | {parts} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax1.barh(names, [r["analytic"]["stored_bytes"] / 2**20 for r in rows], color="tab:green")
    ax1.set_xlabel("stored bytes: params + optimizer state (MiB, analytic)")
    ax2.barh(names, [r["xla"]["total_bytes"] / 2**20 for r in rows], color="tab:blue")
    ax2.set_xlabel(f"XLA:{result['backend'].upper()} total bytes (MiB)")
    paired = [r["time_ratio_paired"] for r in rows]
    lo = [p - r["time_ratio_paired_range"][0] for p, r in zip(paired, rows, strict=True)]
    hi = [r["time_ratio_paired_range"][1] - p for p, r in zip(paired, rows, strict=True)]
    ax3.barh(names, paired, xerr=[lo, hi], color="tab:orange", capsize=3)
    ax3.axvline(1.0, color="k", lw=0.8)
    ax3.set_xlabel("step time / dense, paired by round (median, range)")
    for ax in (ax1, ax2, ax3):
        ax.invert_yaxis()
    fig.suptitle(
        f"{result['model']}, batch {result['batch_size']}, "
        f"{100 * result['sparsity']:.0f}% sparsity, fp32"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_ratios(rows: list[dict]) -> None:
    """Every ratio against the first row (dense), measured in the same run."""
    dense = rows[0]
    for r in rows:
        for key in ("argument", "temp", "total"):
            r[f"{key}_ratio"] = r["xla"][f"{key}_bytes"] / dense["xla"][f"{key}_bytes"]
        r["stored_ratio"] = r["analytic"]["stored_bytes"] / dense["analytic"]["stored_bytes"]
        r["time_ratio"] = r["step_seconds"] / dense["step_seconds"]
        # Paired: the ratio within each round (same load), then the median over rounds.
        paired = [
            t / d for t, d in zip(r["step_seconds_all"], dense["step_seconds_all"], strict=True)
        ]
        r["time_ratio_paired"] = statistics.median(paired)
        r["time_ratio_paired_range"] = [min(paired), max(paired)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"subset of: {', '.join(CONFIGS)}"
    )
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument(
        "--rerender",
        metavar="JSON",
        help="recompute the ratios and rewrite the .md / .png of an earlier run's JSON; no run",
    )
    args = parser.parse_args(argv)
    if args.rerender:
        with open(args.rerender) as f:
            result = json.load(f)
        add_ratios(result["configs"])
        write(result, args.rerender.removesuffix(".json"))
        return 0
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {unknown}; allowed values: {list(CONFIGS)}")
    if "dense" not in names:
        names.insert(0, "dense")  # every ratio is taken against it

    entries = []
    for name in names:
        entries.append(prepare(name, args.model, args.batch_size, args.sparsity))
        row = entries[-1]["row"]
        print(
            f"{name:16s} arg {row['xla']['argument_bytes'] / 2**20:7.2f} MiB  "
            f"temp {row['xla']['temp_bytes'] / 2**20:8.1f} MiB  "
            f"stored {row['analytic']['stored_bytes'] / 2**20:6.2f} MiB  "
            f"compile {row['compile_seconds']:.1f} s",
            flush=True,
        )
    measure_all(entries, args.repeats)
    rows = [e["row"] for e in entries]
    add_ratios(rows)
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "sparsity": args.sparsity,
        "repeats": args.repeats,
        "update_period": UPDATE_PERIOD,
        "backend": jax.default_backend(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jax_version": jax.__version__,
        "command": "python "
        + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "configs": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(
        args.out_dir, f"sparse_storage_{args.model}_b{args.batch_size}_{result['backend']}"
    )
    write(result, stem)
    return 0


def write(result: dict, stem: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(to_markdown(result))
    plot(result, stem + ".png")
    print(to_markdown(result))


if __name__ == "__main__":
    sys.exit(main())
