"""Bytes and time of one WRN train step per technique configuration, against the plain baseline.

For each configuration, in one run on the machine at hand: XLA's compiled memory figures
(argument, output, alias, temp, total = argument + output + temp - alias) and the measured step
time per example (median of ``--repeats`` steps after a warm-up step), each also as a ratio to
the *plain* baseline: a plain Flax/Optax step (``jax.grad`` + ``tx.update``) on the same
WideResNet with XLA's own convolution and its blocks unrolled, i.e. no technique at all.

Usage:
    python benchmarks/train_step.py                      # WRN-28-2, batch 128, all configs
    python benchmarks/train_step.py --configs plain,fp32,k4 --repeats 2

Writes ``<out-dir>/train_step_<model>_b<batch>_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowmem_jax as lm
from lowmem_jax.analysis.memory import xla_memory
from lowmem_jax.workloads import workload

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import result_writer  # noqa: E402

# name -> Plan keyword arguments ("plain" is special: no lowmem transform at all).
CONFIGS: dict[str, dict] = {
    "plain": {},
    "fp32": {},
    "remat_full": {"remat": "full"},
    "remat_dots": {"remat": "dots"},
    "remat_sqrt": {"remat": "sqrt"},
    "k2": {"microbatches": 2},
    "k4": {"microbatches": 4},
    "k8": {"microbatches": 8},
    "k16": {"microbatches": 16},
    "mixed_fp16": {"precision": "mixed_fp16"},
    "mixed_bf16": {"precision": "mixed_bf16"},
    "bf16": {"precision": "bf16"},
    "k4_remat_full": {"microbatches": 4, "remat": "full"},
    "mixed_fp16_k4_remat_full": {"precision": "mixed_fp16", "microbatches": 4, "remat": "full"},
    "bf16_k16_remat_full": {"precision": "bf16", "microbatches": 16, "remat": "full"},
    # Factorized layers, 25% of each factorized layer's parameters.
    "tucker": {"factorize": lm.FactorConfig("tucker")},
    "tucker_remat_full": {"factorize": lm.FactorConfig("tucker"), "remat": "full"},
    "cp_remat_full": {"factorize": lm.FactorConfig("cp"), "remat": "full"},
    "lowrank_remat_full": {"factorize": lm.FactorConfig("lowrank"), "remat": "full"},
}


def plain_grads(model, params, batch_stats, batch):
    """``jax.grad`` of the mean softmax cross-entropy; returns (grads, new batch_stats)."""

    def loss_fn(p):
        logits, updates = model.apply(
            {"params": p, "batch_stats": batch_stats},
            batch["image"],
            train=True,
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updates["batch_stats"]

    return jax.grad(loss_fn, has_aux=True)(params)


def _plain_step(model, tx):
    """The baseline: what a Flax/Optax user writes with no memory technique."""

    def step(state, batch):
        params, opt_state, batch_stats = state
        grads, batch_stats = plain_grads(model, params, batch_stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, batch_stats), {}

    return jax.jit(step, donate_argnums=(0,))


def build(name: str, model_name: str, batch_size: int, plan_fields: dict | None = None):
    """Returns (jitted step, state, batch) for configuration ``name`` (its ``Plan`` fields
    ``plan_fields``, default ``CONFIGS[name]``)."""
    rng = np.random.default_rng(0)
    batch = {
        "image": jnp.asarray(rng.normal(size=(batch_size, 32, 32, 3)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, size=batch_size), jnp.int32),
    }
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    if name == "plain":
        model = workload(model_name, conv_impl="xla", unroll=True).model
        variables = model.init(jax.random.key(0), batch["image"][:2], train=False)
        state = (variables["params"], tx.init(variables["params"]), variables["batch_stats"])
        return _plain_step(model, tx), state, batch
    plan = lm.Plan(**(CONFIGS[name] if plan_fields is None else plan_fields))
    model = plan.configure_model(workload(model_name).model)
    variables = model.init(jax.random.key(0), batch["image"][:2], train=False)
    state = lm.TrainState.create(
        params=variables["params"],
        model_state={"batch_stats": variables["batch_stats"]},
        tx=tx,
        plan=plan,
    )
    return lm.make_train_step(lm.classifier_loss_fn(model), tx, plan), state, batch


def measure(name: str, model_name: str, batch_size: int, repeats: int) -> dict:
    step, state, batch = build(name, model_name, batch_size)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, _ = step(state, batch)  # warm-up
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    xla = xla_memory(compiled)
    step_s = statistics.median(times)
    return {
        "name": name,
        "plan": (
            {k: v.describe() if hasattr(v, "describe") else v for k, v in CONFIGS[name].items()}
            if name != "plain"
            else "plain Flax/Optax step, no technique"
        ),
        "xla": xla,
        "compile_seconds": compile_s,
        "step_seconds": step_s,
        "step_seconds_all": times,
        "seconds_per_example": step_s / batch_size,
    }


def to_markdown(result: dict) -> str:
    rows = result["configs"]
    lines = [
        f"WRN train step, `{result['model']}`, batch {result['batch_size']}, "
        f"backend XLA:{result['backend'].upper()} ({result['machine']}). Bytes are XLA compiled "
        f"memory figures (source: XLA:{result['backend'].upper()}); times are measured step "
        f"times (median of {result['repeats']}), ratios against `plain` in the same run.",
        "",
        "| config | argument MiB | output MiB | alias MiB | temp MiB | total MiB | temp / plain "
        "| total / plain | ms / example | time / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2.0**20
    for r in rows:
        x = r["xla"]
        lines.append(
            f"| {r['name']} | {x['argument_bytes'] / mib:.1f} | {x['output_bytes'] / mib:.1f} | "
            f"{x['alias_bytes'] / mib:.1f} | {x['temp_bytes'] / mib:.1f} | "
            f"{x['total_bytes'] / mib:.1f} | {r['temp_ratio']:.3f} | {r['total_ratio']:.3f} | "
            f"{1e3 * r['seconds_per_example']:.2f} | {r['time_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    ax1.barh(names, [r["xla"]["total_bytes"] / 2**20 for r in rows], color="tab:blue")
    ax1.set_xlabel(f"XLA:{result['backend'].upper()} total bytes (MiB)")
    ax1.invert_yaxis()
    ax2.barh(names, [r["time_ratio"] for r in rows], color="tab:orange")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("step time per example / plain (same run)")
    ax2.invert_yaxis()
    fig.suptitle(f"{result['model']}, batch {result['batch_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated subset of: {', '.join(CONFIGS)}",
    )
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    names = result_writer.selected_configs(parser, args.configs, CONFIGS, baseline="plain")

    rows = []
    for name in names:
        row = measure(name, args.model, args.batch_size, args.repeats)
        rows.append(row)
        print(
            f"{name:28s} temp {row['xla']['temp_bytes'] / 2**20:8.1f} MiB  "
            f"total {row['xla']['total_bytes'] / 2**20:8.1f} MiB  "
            f"step {row['step_seconds']:.3f} s  compile {row['compile_seconds']:.1f} s",
            flush=True,
        )
    plain = rows[0]
    for r in rows:
        r["temp_ratio"] = r["xla"]["temp_bytes"] / plain["xla"]["temp_bytes"]
        r["total_ratio"] = r["xla"]["total_bytes"] / plain["xla"]["total_bytes"]
        r["time_ratio"] = r["seconds_per_example"] / plain["seconds_per_example"]
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        **result_writer.metadata(__file__, argv),
        "configs": rows,
    }
    stem = f"train_step_{args.model}_b{args.batch_size}_{result['backend']}"
    result_writer.write(os.path.join(args.out_dir, stem), result, to_markdown, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
