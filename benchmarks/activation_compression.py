"""Compressed activations on a WRN train step: residual bytes, memory, gradient error, time.

For each stored format of the activation residuals (``Plan(activations=...)``), in one run on
the machine at hand (fp32, SGD Nesterov momentum 0.9, one microbatch, the lowmem step with the
state donated), against the plain Flax/Optax step (``benchmarks/train_step.py``'s ``plain``):

* the residual bytes the backward pass reads, analytic
  (:func:`lowmem_jax.techniques.activations.residuals.residual_report` on the model's loss: as JAX
  keeps them, and as the format stores them);
* XLA's compiled memory figures (``memory_analysis``; total = argument + output + temp - alias)
  and the bytes the inspector (:func:`lowmem_jax.inspect`) classes as saved residuals at the
  step's peak;
* the gradient's relative error against float32 residuals at the initial parameters (global
  norm of the difference over the global norm);
* the step time: every configuration compiled and warmed up, then ``--repeats`` interleaved
  rounds (one step of each per round; the median), as a ratio to the plain step in this run.

Usage:
    python benchmarks/activation_compression.py            # WRN-28-2, batch 128
    python benchmarks/activation_compression.py --model wrn-16-2 --batch-size 32 --repeats 3

Writes ``<out-dir>/activation_compression_<model>_b<batch>_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import optax

import lowmem_jax as lm
from lowmem_jax.analysis.memory import xla_memory
from lowmem_jax.techniques.activations import residuals as ac

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import result_writer, train_step  # noqa: E402

MIB = 2.0**20

# name -> Plan keyword arguments ("plain": the Flax/Optax step of benchmarks/train_step.py).
CONFIGS: dict[str, dict] = {
    "plain": {},
    "fp32": {},
    "bf16": {"activations": "bf16"},
    "int8": {"activations": "int8"},
    "int8:nearest": {"activations": "int8:nearest"},
    "int4": {"activations": "int4"},
    "int2": {"activations": "int2"},
    "remat full": {"remat": "full"},
    "remat full + int8": {"remat": "full", "activations": "int8"},
}


def prepare(name: str, model_name: str, batch_size: int) -> dict:
    """Builds, analyses, compiles and warms up configuration ``name``."""
    step, state, batch = train_step.build(name, model_name, batch_size, CONFIGS[name])
    compiled = step.lower(state, batch).compile()
    row = {"name": name, "plan": CONFIGS[name], "xla": xla_memory(compiled)}
    if name != "plain":
        found = lm.inspect(step, state, batch)
        row["saved_residual_at_peak_bytes"] = found.by_category().get("saved residual", 0)
    state, _ = compiled(state, batch)  # warm-up
    jax.block_until_ready(state)
    return {"row": row, "compiled": compiled, "state": state, "batch": batch}


def residuals_and_error(name: str, model_name: str, batch_size: int) -> dict:
    """The analytic residual bytes of the format and its gradient's error against float32."""
    plan = lm.Plan(**CONFIGS[name])
    _, state, batch = train_step.build("fp32", model_name, batch_size, {})
    model = plan.configure_model(lm.workload(model_name).model)
    loss_fn = lm.classifier_loss_fn(model)
    args = (state.params, state.model_state, batch, None)
    report = ac.residual_report(loss_fn, plan.activations, *args, data_argnums=(2,))

    def grads(loss):
        fn = jax.jit(jax.grad(loss, has_aux=True), compiler_options=plan.compiler_options() or None)
        return fn(*args)[0]

    reference = grads(loss_fn)
    error = optax.tree.norm(
        jax.tree.map(lambda a, b: a - b, grads(plan.model_loss(loss_fn)), reference)
    )
    return {
        "residual_plain_bytes": report.plain_bytes,
        "residual_stored_bytes": report.stored_bytes,
        "residual_ratio": report.ratio,
        "gradient_relative_error": float(error / optax.tree.norm(reference)),
    }


def to_markdown(result: dict) -> str:
    lines = [
        f"# Compressed activations: {result['model']}, batch {result['batch_size']}, "
        f"{result['backend']}",
        "",
        f"Made by: `{result['command']}` (JAX {result['jax_version']}, {result['machine']}). "
        "Residual bytes: analytic (the backward pass's residuals as JAX keeps them / as stored). "
        "Memory: XLA:CPU compiled figures of the step; saved residual: the inspector's bytes of "
        "that class at the peak. Gradient error: relative to float32 residuals, same parameters "
        f"and batch. Time: median of {result['repeats']} interleaved rounds, ratio to the plain "
        "Flax/Optax step in the same run.",
        "",
        "| config | residuals MiB (analytic) | stored / kept | total MiB (XLA:CPU) | total / plain "
        "| temp MiB | saved residual at peak MiB | gradient error | time / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["configs"]:
        stored = r.get("residual_stored_bytes")
        lines.append(
            f"| {r['name']} | "
            + (f"{stored / MIB:.1f}" if stored is not None else "-")
            + " | "
            + (f"{r['residual_ratio']:.3f}" if stored is not None else "-")
            + f" | {r['xla']['total_bytes'] / MIB:.1f} | {r['total_ratio']:.3f} | "
            f"{r['xla']['temp_bytes'] / MIB:.1f} | "
            + (
                f"{r['saved_residual_at_peak_bytes'] / MIB:.1f}"
                if "saved_residual_at_peak_bytes" in r
                else "-"
            )
            + " | "
            + (f"{r['gradient_relative_error']:.2e}" if "gradient_relative_error" in r else "-")
            + f" | {r['time_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["configs"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["time_ratio"], r["xla"]["total_bytes"] / MIB)
        ax.annotate(r["name"], (r["time_ratio"], r["xla"]["total_bytes"] / MIB), fontsize=8)
    ax.set_xlabel("step time / plain step (same run)")
    ax.set_ylabel("XLA:CPU total MiB")
    ax.set_title(f"Compressed activations, {result['model']} batch {result['batch_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of: {list(CONFIGS)}")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    names = result_writer.selected_configs(parser, args.configs, CONFIGS, baseline="plain")

    entries = {}
    for name in names:
        entries[name] = prepare(name, args.model, args.batch_size)
        if name == "fp32" or "activations" in CONFIGS[name]:
            entries[name]["row"].update(residuals_and_error(name, args.model, args.batch_size))
        print(name, f"{entries[name]['row']['xla']['total_bytes'] / MIB:.1f} MiB", flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name, entry in entries.items():
            start = time.perf_counter()
            entry["state"], _ = entry["compiled"](entry["state"], entry["batch"])
            jax.block_until_ready(entry["state"])
            times[name].append(time.perf_counter() - start)
    rows = [entries[name]["row"] for name in names]
    plain = entries["plain"]["row"]
    for name, r in zip(names, rows, strict=True):
        r["step_seconds_all"] = times[name]
        r["step_seconds"] = statistics.median(times[name])
    for r in rows:
        r["total_ratio"] = r["xla"]["total_bytes"] / plain["xla"]["total_bytes"]
        r["time_ratio"] = r["step_seconds"] / plain["step_seconds"]
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        **result_writer.metadata(__file__, argv),
        "configs": rows,
    }
    stem = f"activation_compression_{args.model}_b{args.batch_size}_{result['backend']}"
    result_writer.write(os.path.join(args.out_dir, stem), result, to_markdown, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
