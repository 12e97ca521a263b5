"""Our techniques vs their peers, side by side in the same run.

Three comparisons, each measured in one run on the machine at hand:

1. **Microbatch gradient accumulation** (WRN-28-2, batch 128, CIFAR shapes, fp32, SGD Nesterov
   recipe with weight decay): ``lowmem_jax.make_train_step`` with ``Plan(microbatches=k)``
   (``lax.scan`` in the step) vs ``optax.microbatching.microbatch`` (in-step accumulation, a
   ``fori_loop`` with a MEAN accumulator) vs ``optax.MultiSteps(tx, every_k_schedule=k)``
   (cross-step accumulation: k calls of a jitted step, one microbatch each, make one update) vs a
   plain full-batch Flax/Optax step, the baseline of every ratio. All four use the same Flax
   model, whose convolution is ``lowmem_jax.ops.Conv`` (XLA's own conv backward inside a loop is
   ~40x slower on XLA:CPU, ``benchmarks/conv_in_loop.py``). Figures: XLA:CPU compile-only memory
   (argument, output, alias, temp; total = argument + output + temp - alias; for MultiSteps the
   per-microbatch step, whose optimizer state holds a params-sized accumulator), the measured
   time per full batch (interleaved rounds, median; MultiSteps: k calls), and whether the three
   accumulation methods make the same update from the same start.
2. **Sparse storage**, compressed (values + int32 indices) vs masked dense (a 1-byte mask per
   weight, as jaxpruner's uint8 masks) vs dense, DSR at 90% sparsity: the stored-bytes ratios
   from ``benchmarks/sparse_storage.py``'s own ``prepare`` (analytic stored bytes, XLA:CPU
   compile-only memory; it also runs one untimed warm-up step).
3. **Loss scaling on fp16 runs that overflow / underflow**: WRN-16-2 on scikit-learn digits at
   8x8 pixels, ``mixed_fp16``, trained a few hundred steps with our step and
   ``loss_scale="dynamic"`` vs ``loss_scale="none"`` (our step still skips a non-finite update) vs
   a plain Flax/Optax mixed-fp16 step without loss scaling (the update is applied whatever it
   is) vs the same plain step with ``optax.apply_if_finite``; (a) a normal run, with the fraction
   of gradient entries that underflow to zero in fp16, and (b) a run with one training batch
   scaled so that the fp16 forward pass overflows.

Usage:
    python benchmarks/peers.py                                  # everything, defaults
    python benchmarks/peers.py --only microbatch --ks 2,4,8 --repeats 5
    python benchmarks/peers.py --only loss_scale --seeds 0,1

Writes ``<out>/peers_<backend>.{json,md,png}``; with ``--only``, the parts not run are kept from
an existing JSON there (each part records its own command and time).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
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
from lowmem_jax import data as data_lib
from lowmem_jax.analysis.memory import xla_memory
from lowmem_jax.techniques.loss_scale import scale as loss_scale_lib
from lowmem_jax.training import tasks
from lowmem_jax.training.loop import TrainConfig
from lowmem_jax.workloads import workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sparse_storage  # noqa: E402
import train_step  # noqa: E402

PARTS = ("microbatch", "sparse", "loss_scale")
MIB = 2.0**20
COMPILE_ONLY = "XLA:{} compile-only"
MEASURED = "measured time, same run"
MEASURED_RUN = "measured, same run"
ANALYTIC = "analytic"

# ---------------------------------------------------------------------------------------------
# 1. Microbatch gradient accumulation
# ---------------------------------------------------------------------------------------------

METHODS = ("ours", "optax_microbatch", "optax_multisteps")
METHOD_LABELS = {
    "plain": "plain full-batch Flax/Optax step",
    "ours": "lowmem make_train_step, Plan(microbatches=k) (lax.scan)",
    "optax_microbatch": "optax.microbatching.microbatch (fori_loop, MEAN)",
    "optax_multisteps": "optax.MultiSteps(every_k_schedule=k), k jitted calls",
}


def random_batch(batch_size: int, image_size: int = 32, channels: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (batch_size, image_size, image_size, channels)
    return {
        "image": jnp.asarray(rng.normal(size=shape), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, size=batch_size), jnp.int32),
    }


def _optax_microbatch_step(model, tx, microbatch_size: int):
    """The plain step with its gradient computed by ``optax.microbatching.microbatch``.

    Each microbatch is normalised with its own BatchNorm statistics (as ours and MultiSteps);
    the new running statistics are the MEAN over microbatches of each one's update from the same
    old statistics (optax has no carry), not k updates in order as ours and MultiSteps.
    """

    def grads_and_stats(params, batch, batch_stats):
        return train_step.plain_grads(model, params, batch_stats, batch)

    micro = optax.microbatching.microbatch(
        grads_and_stats,
        argnums=1,
        microbatch_size=microbatch_size,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )

    def step(state, batch):
        params, opt_state, batch_stats = state
        grads, batch_stats = micro(params, batch, batch_stats)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, batch_stats), {}

    return jax.jit(step, donate_argnums=(0,))


def build_accumulation(method: str, k: int, model, tx, batch) -> dict:
    """One variant: its compiled step, state and the calls that make one full-batch update.

    The entry's ``compiled(state, calls)`` runs one full batch (k compiled calls for MultiSteps),
    so that ``sparse_storage.timed_step`` / ``measure_all`` time it as they time a step.
    """
    microbatch_size = batch["label"].shape[0] // k
    if method == "ours":
        plan = lm.Plan(microbatches=k)

        def init(images):
            v = model.init(jax.random.key(0), images, train=False)
            model_state = {"batch_stats": v["batch_stats"]}
            return lm.TrainState.create(
                params=v["params"], model_state=model_state, tx=tx, plan=plan
            )

        step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    elif method in ("plain", "optax_microbatch", "optax_multisteps"):
        if method == "plain":
            step = train_step._plain_step(model, tx)
        elif method == "optax_microbatch":
            step = _optax_microbatch_step(model, tx, microbatch_size)
        else:
            tx = optax.MultiSteps(tx, every_k_schedule=k)
            step = train_step._plain_step(model, tx)

        def init(images):
            v = model.init(jax.random.key(0), images, train=False)
            return (v["params"], tx.init(v["params"]), v["batch_stats"])

    else:
        raise ValueError(f"Unknown method={method!r}; allowed values: {['plain', *METHODS]}")
    # The same initial parameters (key 0) for every variant, in fresh buffers (steps donate).
    state = jax.jit(init)(np.asarray(batch["image"])[:2])
    if method == "optax_multisteps":
        # Sliced on the host and put on the device once (no compiled slicing).
        calls = [jax.device_put({n: np.asarray(x)[i * microbatch_size : (i + 1) * microbatch_size]
                                 for n, x in batch.items()}) for i in range(k)]  # fmt: skip
    elif method == "optax_microbatch":
        # optax slices the batch column-major (microbatch i = examples i, i + k, ...); present
        # the batch reordered so its microbatch i holds our contiguous slice i (same BatchNorm
        # groups as ours and MultiSteps).
        order = np.arange(batch["label"].shape[0]).reshape(k, microbatch_size).T.ravel()
        calls = [jax.device_put({n: np.asarray(x)[order] for n, x in batch.items()})]
    else:
        calls = [batch]
    start = time.perf_counter()
    compiled = step.lower(state, calls[0]).compile()
    compile_s = time.perf_counter() - start

    def full_batch(state, calls):
        for b in calls:
            state, _ = compiled(state, b)
        return state, {}

    name = "plain" if method == "plain" else f"{method}_k{k}"
    row = {
        "name": name,
        "method": method,
        "label": METHOD_LABELS[method],
        "k": 1 if method == "plain" else k,
        "microbatch_size": batch["label"].shape[0] if method == "plain" else microbatch_size,
        "calls_per_update": len(calls),
        "xla": xla_memory(compiled),
        "compile_seconds": compile_s,
        "step_seconds_all": [],
    }
    return {"row": row, "compiled": full_batch, "state": state, "batch": calls, "sparse": None}


def _params(state):
    return state.params if isinstance(state, lm.TrainState) else state[0]


def _tree_rel_diff(a, b) -> float:
    """||a - b|| / ||b|| over all leaves (float64 on the host)."""
    num = sum(
        float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in zip(a, b, strict=True)
    )
    den = sum(float(np.sum(np.float64(y) ** 2)) for y in b)
    return float(np.sqrt(num / den))


def microbatch_comparison(
    model_name: str = "wrn-28-2",
    batch_size: int = 128,
    ks: tuple[int, ...] = (4,),
    repeats: int = 3,
    image_size: int = 32,
    log=print,
    model=None,
) -> dict:
    """``model``: a Flax classifier with BatchNorm to use instead of ``model_name``'s (tests)."""
    work = workload(model_name, batch_size, image_size=image_size)
    tx = dataclasses.replace(work.recipe, schedule="constant").optimizer_for(1)  # the recipe's
    model = work.model if model is None else model
    batch = random_batch(batch_size, image_size)
    entries = [build_accumulation("plain", 1, model, tx, batch)]
    params0 = [np.asarray(x) for x in jax.tree.leaves(_params(entries[0]["state"]))]
    for k in ks:
        for method in METHODS:
            entries.append(build_accumulation(method, k, model, tx, batch))
    updates = {}
    for e in entries:
        # Warm-up = one full-batch update from the same start: the equality check.
        e["state"], _ = e["compiled"](e["state"], e["batch"])
        jax.block_until_ready(e["state"])
        after = [np.asarray(x) for x in jax.tree.leaves(_params(e["state"]))]
        updates[e["row"]["name"]] = [a - p for a, p in zip(after, params0, strict=True)]
        e["row"]["params_finite"] = _host_finite(after)
        x = e["row"]["xla"]
        if log:
            log(
                f"  {e['row']['name']:22s} temp {x['temp_bytes'] / MIB:7.1f} MiB  "
                f"argument {x['argument_bytes'] / MIB:6.1f} MiB  "
                f"compile {e['row']['compile_seconds']:.1f} s"
            )
    sparse_storage.measure_all(entries, repeats)  # interleaved rounds, one update each
    rows = [e["row"] for e in entries]
    plain = rows[0]
    param_bytes = int(sum(p.nbytes for p in params0))
    for r in rows:
        r["seconds_per_example"] = r["step_seconds"] / batch_size
        r["temp_ratio"] = r["xla"]["temp_bytes"] / plain["xla"]["temp_bytes"]
        r["total_ratio"] = r["xla"]["total_bytes"] / plain["xla"]["total_bytes"]
        r["argument_ratio"] = r["xla"]["argument_bytes"] / plain["xla"]["argument_bytes"]
        r["time_ratio"] = r["step_seconds"] / plain["step_seconds"]
        paired = [
            t / p for t, p in zip(r["step_seconds_all"], plain["step_seconds_all"], strict=True)
        ]
        r["time_ratio_paired"] = statistics.median(paired)
        r["time_ratio_paired_range"] = [min(paired), max(paired)]
        if r["method"] == "optax_multisteps":
            r["accumulator_bytes"] = param_bytes  # MultiSteps' acc_grads, in argument bytes
    agreement = {}
    for k in ks:
        ref = updates[f"ours_k{k}"]
        agreement[f"k{k}"] = {
            "reference": f"ours_k{k}",
            **{
                f"{m}_k{k}": _tree_rel_diff(updates[f"{m}_k{k}"], ref)
                for m in METHODS
                if m != "ours"
            },
            # Not expected to agree: BatchNorm statistics over 128 examples instead of k slices.
            "plain_full_batch": _tree_rel_diff(updates["plain"], ref),
        }
    del entries
    return {
        "model": model_name,
        "batch_size": batch_size,
        "image_size": image_size,
        "ks": list(ks),
        "repeats": repeats,
        "optimizer": "SGD Nesterov 0.9, lr 0.1, weight decay 5e-4 on kernels (the WRN recipe)",
        "conv": "lowmem_jax.ops.Conv (loop-friendly backward on CPU) in all four variants; the "
        "same Flax model (lowmem_jax.workloads.workload, blocks scanned) for all",
        "param_bytes": param_bytes,
        "rows": rows,
        "update_agreement": agreement,
        "update_agreement_note": "||update - update(ours)|| / ||update(ours)|| after one full "
        "update from the same parameters and batch (update = params after - params before)",
    }


# ---------------------------------------------------------------------------------------------
# 2. Sparse storage: compressed vs masked dense vs dense
# ---------------------------------------------------------------------------------------------

SPARSE_CONFIGS = ("dense", "masked_dsr", "compressed_dsr")


def sparse_comparison(
    model_name: str = "wrn-28-2", batch_size: int = 128, sparsity: float = 0.9, log=print
) -> dict:
    rows = []
    for name in SPARSE_CONFIGS:
        entry = sparse_storage.prepare(name, model_name, batch_size, sparsity)
        row = entry["row"]
        rows.append(row)
        del entry
        if log:
            log(
                f"  {name:16s} stored {row['analytic']['stored_bytes'] / MIB:6.2f} MiB  "
                f"argument {row['xla']['argument_bytes'] / MIB:6.2f} MiB"
            )
    dense = rows[0]
    for r in rows:
        r["stored_ratio"] = r["analytic"]["stored_bytes"] / dense["analytic"]["stored_bytes"]
        for key in ("argument", "temp", "total"):
            r[f"{key}_ratio"] = r["xla"][f"{key}_bytes"] / dense["xla"][f"{key}_bytes"]
        r.pop("step_seconds_all", None)
        r.pop("rewire_step_seconds", None)
    by_name = {r["name"]: r for r in rows}
    return {
        "model": model_name,
        "batch_size": batch_size,
        "sparsity": sparsity,
        "algorithm": "dsr (uniform distribution)",
        "rows": rows,
        "compressed_over_masked_stored": by_name["compressed_dsr"]["analytic"]["stored_bytes"]
        / by_name["masked_dsr"]["analytic"]["stored_bytes"],
        "note": "masked storage keeps a bool mask per sparse weight: 1 byte, as a uint8 mask "
        "(jaxpruner) would; it stores more than dense",
    }


# ---------------------------------------------------------------------------------------------
# 3. Loss scaling on fp16 runs that overflow / underflow
# ---------------------------------------------------------------------------------------------

LOSS_SCALE_VARIANTS = ("ours_dynamic", "ours_none", "plain_fp16", "plain_fp16_apply_if_finite")
LOSS_SCALE_LABELS = {
    "ours_dynamic": 'ours: make_train_step, Plan("mixed_fp16", loss_scale="dynamic")',
    "ours_none": 'ours: make_train_step, Plan("mixed_fp16", loss_scale="none") (non-finite '
    "steps still skipped)",
    "plain_fp16": "plain Flax/Optax mixed-fp16 step, no loss scaling, update always applied",
    "plain_fp16_apply_if_finite": "plain mixed-fp16 step, tx = optax.apply_if_finite(tx, 10)",
}


def _plain_fp16_step(model, tx, policy):
    """What a Flax/Optax user writes for mixed fp16 without loss scaling: fp32 master weights,
    fp16 compute, the update (and the BatchNorm statistics) applied whatever they are."""
    loss_fn = lm.cast_loss_fn(lm.classifier_loss_fn(model), policy)

    def step(state, batch):
        def f(p):
            return loss_fn(p, state.model_state, batch, None)

        grads, (model_state, metrics) = jax.grad(f, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
        )
        metrics = {
            **metrics,
            "grads_finite": loss_scale_lib.all_finite(grads),
            "skipped_steps": state.skipped_steps,
        }
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,))


def loss_scale_setup(
    variant: str,
    *,
    model_name: str = "wrn-16-2",
    image_size: int = 8,
    batch_size: int = 64,
    steps: int = 220,
    learning_rate: float = 0.1,
    seed: int = 0,
    model=None,
) -> dict:
    """Data, model, jitted step and a ``make_state()`` for one loss-scale variant.

    ``model``: a Flax classifier (with ``dtype``) instead of ``model_name``'s (tests).
    """
    if variant not in LOSS_SCALE_VARIANTS:
        raise ValueError(f"Unknown variant={variant!r}; allowed values: {LOSS_SCALE_VARIANTS}")
    kind = "dynamic" if variant == "ours_dynamic" else "none"
    plan = lm.Plan(precision="mixed_fp16", loss_scale=kind)
    config = TrainConfig(
        model=model_name,
        plan=plan,
        batch_size=batch_size,
        learning_rate=learning_rate,
        seed=seed,
        image_size=image_size,
        progress=False,
    )
    task = tasks.make_task(config)
    train, test = task.train, task.test
    work = workload(model_name)
    model = plan.configure_model(work.model if model is None else model)
    # The recipe optimizer and schedule of `lowmem train`, over `steps` steps.
    tx = config.recipe(work.recipe).optimizer_for(steps)
    if variant == "plain_fp16_apply_if_finite":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=10)
    rng = np.asarray(jax.random.PRNGKey(seed))

    @jax.jit
    def create(rng, images):
        v = model.init(rng, images, train=False)
        model_state = {"batch_stats": v["batch_stats"]}
        return lm.TrainState.create(
            params=v["params"], model_state=model_state, tx=tx, plan=plan, rng=rng
        )

    def make_state():  # the same initial state in fresh buffers (the step donates its state)
        return create(rng, train["image"][:2])

    if variant.startswith("ours"):
        step = lm.make_train_step(lm.classifier_loss_fn(model), tx, plan)
    else:
        step = _plain_fp16_step(model, tx, plan.policy)

    @jax.jit
    def predict(state, images):
        variables = {"params": plan.policy.cast_to_compute(state.params), **state.model_state}
        images = plan.policy.cast_to_compute(images)
        return model.apply(variables, images, train=False).argmax(-1)

    return {
        "variant": variant,
        "plan": plan,
        "model": model,
        "train": train,
        "test": test,
        "step": step,
        "predict": predict,
        "make_state": make_state,
        "config": {
            "model": model_name,
            "dataset": f"digits {image_size}x{image_size}",
            "batch_size": batch_size,
            "steps": steps,
            "learning_rate": learning_rate,
            "seed": seed,
        },
    }


def _host_finite(tree) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def _evaluate(setup, state) -> float:
    correct = 0
    for batch in data_lib.iterate_batches(setup["test"], 512, drop_remainder=False):
        pred = np.asarray(setup["predict"](state, batch["image"]))
        correct += int((pred == batch["label"]).sum())
    return correct / len(setup["test"]["label"])


def loss_scale_train(setup: dict, *, fault_step: int | None = None, fault_scale: float = 1e5):
    """Trains ``setup['config']['steps']`` steps; at step ``fault_step`` (0-based) the batch's
    images are multiplied by ``fault_scale`` (the fp16 forward pass overflows). Returns a
    summary: final test accuracy, skipped steps, whether params / BatchNorm stats are finite."""
    cfg = setup["config"]
    state = setup["make_state"]()
    steps, batch_size, seed = cfg["steps"], cfg["batch_size"], cfg["seed"]
    fault = None
    start = time.perf_counter()
    t, epoch = 0, 0
    while t < steps:
        epoch += 1
        for batch in data_lib.iterate_batches(setup["train"], batch_size, seed=seed + epoch):
            if t >= steps:
                break
            if t == fault_step:
                batch = {**batch, "image": batch["image"] * fault_scale}
                max_abs = float(np.abs(batch["image"]).max())
            state, metrics = setup["step"](state, batch)
            if t == fault_step:
                fault = {
                    "step": t,
                    "image_scale": fault_scale,
                    "max_abs_image": max_abs,
                    "image_exceeds_fp16_max": max_abs > float(np.finfo(np.float16).max),
                    "loss": float(metrics["loss"]),
                    "loss_finite": bool(np.isfinite(float(metrics["loss"]))),
                    "grads_finite": bool(metrics["grads_finite"]),
                }
            t += 1
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    scale = state.loss_scale.loss_scale
    skipped = int(state.skipped_steps)
    if isinstance(state.opt_state, optax.ApplyIfFiniteState):
        skipped = int(state.opt_state.total_notfinite)  # optax's own count of skipped updates
    return {
        "variant": setup["variant"],
        "seed": seed,
        "steps": t,
        "fault": fault,
        "test_accuracy": _evaluate(setup, state),
        "skipped_steps": skipped,
        "params_finite": _host_finite(state.params),
        "batch_stats_finite": _host_finite(state.model_state),
        "final_loss_scale": float(scale),
        "train_seconds": seconds,
    }, state


def underflow_fractions(setup: dict, params, model_state, batch, scale: float) -> dict:
    """Fractions of the fp32 gradient's non-zero entries that are exactly 0 in the fp16
    gradient, without loss scaling and with ``scale``, on one batch at ``params``."""
    plan = setup["plan"]
    model16 = setup["model"]
    model32 = model16.clone(dtype=jnp.float32)
    loss16 = lm.cast_loss_fn(lm.classifier_loss_fn(model16), plan.policy)
    loss32 = lm.classifier_loss_fn(model32)

    @jax.jit
    def grads(params, model_state, batch):
        def g(loss_fn, s):
            return jax.grad(lambda p: s * loss_fn(p, model_state, batch, None)[0])(params)

        g32 = g(loss32, 1.0)
        g16 = g(loss16, 1.0)
        g16s = jax.tree.map(lambda x: x / scale, g(loss16, scale))
        return g32, g16, g16s

    g32, g16, g16s = (
        np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(t)])
        for t in grads(params, model_state, batch)
    )
    nonzero = g32 != 0
    n = max(int(nonzero.sum()), 1)
    tiny = float(np.finfo(np.float16).smallest_subnormal)
    return {
        "entries": int(g32.size),
        "fp32_nonzero": int(nonzero.sum()),
        "loss_scale": scale,
        "zero_in_fp16_unscaled": float(((g16 == 0) & nonzero).sum() / n),
        "zero_in_fp16_scaled": float(((g16s == 0) & nonzero).sum() / n),
        "scaled_grads_finite": bool(np.isfinite(g16s).all()),
        "fp32_below_fp16_subnormal": float(((np.abs(g32) < tiny) & nonzero).sum() / n),
        "fp32_below_fp16_normal": float(
            ((np.abs(g32) < float(np.finfo(np.float16).tiny)) & nonzero).sum() / n
        ),
    }


def loss_scale_comparison(
    variants: tuple[str, ...] = LOSS_SCALE_VARIANTS,
    seeds: tuple[int, ...] = (0,),
    *,
    scenarios: tuple[str, ...] = ("normal", "overflow"),
    model_name: str = "wrn-16-2",
    image_size: int = 8,
    batch_size: int = 64,
    steps: int = 220,
    fault_step: int = 100,
    fault_scale: float = 1e5,
    log=print,
    model=None,
    measure_underflow: bool = True,
) -> dict:
    runs, underflow = [], []
    for seed in seeds:
        for variant in variants:
            setup = loss_scale_setup(
                variant,
                model_name=model_name,
                image_size=image_size,
                batch_size=batch_size,
                steps=steps,
                seed=seed,
                model=model,
            )
            test_examples = len(setup["test"]["label"])
            for scenario in scenarios:
                fault = fault_step if scenario == "overflow" else None
                summary, state = loss_scale_train(setup, fault_step=fault, fault_scale=fault_scale)
                summary["scenario"] = scenario
                runs.append(summary)
                if log:
                    log(
                        f"  seed {seed} {variant:28s} {scenario:8s} "
                        f"acc {summary['test_accuracy']:.4f}  "
                        f"skipped {summary['skipped_steps']:3d}  "
                        f"params finite {summary['params_finite']}  "
                        f"stats finite {summary['batch_stats_finite']}  "
                        f"{summary['train_seconds']:.1f} s"
                    )
                if measure_underflow and variant == "ours_dynamic" and scenario == "normal":
                    # Underflow on one training batch, at the start and the end of the run.
                    batch = next(data_lib.iterate_batches(setup["train"], batch_size, seed=seed))
                    init = setup["make_state"]()
                    for when, st in (("init", init), ("end", state)):
                        for s in sorted({2.0**15, summary["final_loss_scale"]}):
                            u = underflow_fractions(setup, st.params, st.model_state, batch, s)
                            underflow.append({"seed": seed, "params": when, **u})
                del state
    return {
        "config": {
            "model": model_name,
            "dataset": f"scikit-learn digits, {image_size}x{image_size} pixels",
            "precision": "mixed_fp16 (fp32 master weights, fp16 compute)",
            "batch_size": batch_size,
            "steps": steps,
            "optimizer": "SGD Nesterov 0.9, lr 0.1 cosine, weight decay 5e-4 (lowmem train's)",
            "fault_step": fault_step,
            "fault_image_scale": fault_scale,
            "seeds": list(seeds),
        },
        "labels": {v: LOSS_SCALE_LABELS[v] for v in variants},
        "test_examples": test_examples,
        "runs": runs,
        "underflow": underflow,
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _header(part: dict) -> list[str]:
    return [f"Command: `{part['command']}` ({part['timestamp']}).", ""]


def to_markdown(result: dict) -> str:
    backend = result["backend"].upper()
    src_xla = COMPILE_ONLY.format(backend)
    lines = [
        "# Our techniques vs their peers, same run",
        "",
        f"Backend XLA:{backend}, jax {result['jax_version']}, optax {result['optax_version']}, "
        f"flax {result['flax_version']}; {result['machine']}. The machine is shared with other "
        "jobs: time ratios are noisy (interleaved rounds reduce, not remove, the noise). Every "
        f"figure says its source: *{src_xla}*, *{MEASURED}* or *{ANALYTIC}*.",
        "",
    ]
    mb = result.get("microbatch")
    if mb:
        lines += [
            f"## 1. Microbatch gradient accumulation: `{mb['model']}`, batch {mb['batch_size']}, "
            f"fp32, CIFAR shapes ({mb['image_size']}x{mb['image_size']}x3)",
            "",
            *_header(mb),
            f"All four variants use the same Flax model and optimizer ({mb['optimizer']}); its "
            "convolution is `lowmem_jax.ops.Conv`, whose backward stays fast inside loops on "
            "XLA:CPU (XLA's own conv backward inside a scan / fori_loop is ~40x slower there, "
            "`benchmarks/conv_in_loop.py`), so the peers are measured with our conv, not "
            "their default one. optax.microbatching slices the batch column-major (microbatch "
            "i = examples i, i + k, ...), so it is given the batch reordered such that its "
            "microbatch i is our contiguous slice i (same BatchNorm groups). Bytes: "
            f"{src_xla} (`lower().compile().memory_analysis()`; total = argument + output + "
            "temp - alias); for MultiSteps, its per-microbatch step, whose argument bytes hold "
            f"the params-sized gradient accumulator ({mb['param_bytes'] / MIB:.2f} MiB, "
            f"{ANALYTIC}) in the optimizer state. Time per full batch of {mb['batch_size']} "
            f"examples ({MEASURED}): median of {mb['repeats']} interleaved rounds after a "
            "warm-up update (MultiSteps: k calls); *paired* = median over rounds of the "
            "within-round ratio to `plain`, with its range.",
            "",
            "| variant | what | microbatch | argument MiB | output MiB | alias MiB | temp MiB "
            "| total MiB | temp / plain | total / plain | s per batch | time / plain "
            "| paired time / plain (range) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mb["rows"]:
            x = r["xla"]
            lo, hi = r["time_ratio_paired_range"]
            lines.append(
                f"| {r['name']} | {r['label']} | {r['microbatch_size']} "
                f"| {x['argument_bytes'] / MIB:.2f} | {x['output_bytes'] / MIB:.2f} "
                f"| {x['alias_bytes'] / MIB:.2f} | {x['temp_bytes'] / MIB:.1f} "
                f"| {x['total_bytes'] / MIB:.1f} | {r['temp_ratio']:.3f} | {r['total_ratio']:.3f} "
                f"| {r['step_seconds']:.2f} | {r['time_ratio']:.2f} "
                f"| {r['time_ratio_paired']:.2f} ({lo:.2f}-{hi:.2f}) |"
            )
        lines += [
            "",
            "Do the three accumulation methods make the same update? One full update from the "
            "same parameters and batch; relative L2 difference of the update "
            "(params after - before) to ours "
            f"({MEASURED_RUN}; BatchNorm normalises each microbatch with its own statistics in all "
            "three, so they should agree to float32 rounding; the plain full-batch step "
            "normalises over the whole batch and is listed only for scale):",
            "",
            "| k | "
            + " | ".join(f"{m} vs ours" for m in METHODS if m != "ours")
            + " | plain full batch vs ours |",
            "|---|---:|---:|---:|",
        ]
        for k in mb["ks"]:
            a = mb["update_agreement"][f"k{k}"]
            lines.append(
                f"| {k} | {a[f'optax_microbatch_k{k}']:.2e} | {a[f'optax_multisteps_k{k}']:.2e} "
                f"| {a['plain_full_batch']:.2e} |"
            )
        lines.append("")
    sp = result.get("sparse")
    if sp:
        lines += [
            f"## 2. Sparse storage: compressed vs masked dense vs dense, `{sp['model']}`, "
            f"batch {sp['batch_size']}, {100 * sp['sparsity']:.0f}% sparsity, "
            f"{sp['algorithm']}, fp32, SGD momentum",
            "",
            *_header(sp),
            "Computed by `benchmarks/sparse_storage.py`'s `prepare` in this run. *Stored* = "
            "parameters as stored + optimizer state (momentum, masks or int32 indices), the "
            f"transient gradient excluded ({ANALYTIC}); argument / temp / total: {src_xla} "
            f"(argument includes the batch). Masked = dense weights + a 1-byte mask per sparse "
            "weight, what a uint8 mask (jaxpruner) stores. Compressed stored / masked stored = "
            f"**{sp['compressed_over_masked_stored']:.3f}**.",
            "",
            "| storage | stored MiB | stored / dense | argument MiB | argument / dense "
            "| temp MiB | total MiB | total / dense |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sp["rows"]:
            x = r["xla"]
            lines.append(
                f"| {r['name']} | {r['analytic']['stored_bytes'] / MIB:.2f} "
                f"| {r['stored_ratio']:.3f} | {x['argument_bytes'] / MIB:.2f} "
                f"| {r['argument_ratio']:.3f} | {x['temp_bytes'] / MIB:.1f} "
                f"| {x['total_bytes'] / MIB:.1f} | {r['total_ratio']:.3f} |"
            )
        lines.append("")
    ls = result.get("loss_scale")
    if ls:
        c = ls["config"]
        faults = [r["fault"] for r in ls["runs"] if r["fault"]]
        fault_note = ""
        if faults:
            fault_note = (
                f" (max |pixel| {faults[0]['max_abs_image']:.3g}, above fp16's largest value "
                "65504: the batch's cast to fp16 already gives inf)"
                if faults[0]["image_exceeds_fp16_max"]
                else f" (max |pixel| {faults[0]['max_abs_image']:.3g})"
            )
        lines += [
            f"## 3. Loss scaling on fp16: `{c['model']}` on {c['dataset']}, {c['precision']}",
            "",
            *_header(ls),
            f"{c['steps']} steps of batch {c['batch_size']}, {c['optimizer']}; seeds "
            f"{c['seeds']}. *overflow*: the training batch of step {c['fault_step']} has its "
            f"images multiplied by {c['fault_image_scale']:g}{fault_note}, so the fp16 "
            "forward pass overflows (inf, then NaN through BatchNorm). Final test accuracy on "
            f"the {ls['test_examples']} held-out digits, skipped steps, whether params and "
            f"BatchNorm statistics are finite at the end ({MEASURED_RUN}; skipped steps: our "
            "`skipped_steps`, optax.apply_if_finite's `total_notfinite`).",
            "",
            *[f"- `{v}`: {label}" for v, label in ls["labels"].items()],
            "",
            "| variant | scenario | seed | test accuracy | skipped steps | grads finite at "
            "fault step | params finite | BatchNorm stats finite | final loss scale "
            "| train s |",
            "|---|---|---:|---:|---:|---|---|---|---:|---:|",
        ]
        for r in ls["runs"]:
            fault = "-" if r["fault"] is None else str(r["fault"]["grads_finite"])
            lines.append(
                f"| {r['variant']} | {r['scenario']} | {r['seed']} | {r['test_accuracy']:.4f} "
                f"| {r['skipped_steps']} | {fault} | {r['params_finite']} "
                f"| {r['batch_stats_finite']} | {r['final_loss_scale']:g} "
                f"| {r['train_seconds']:.1f} |"
            )
        lines += [
            "",
            "Gradient underflow on one training batch: of the fp32 gradient's non-zero entries, "
            "the fraction that are exactly 0 in the mixed-fp16 gradient without loss scaling and "
            f"with scale S (grad(S x loss) / S) ({MEASURED_RUN}), and the fraction whose fp32 "
            f"value is below fp16's smallest subnormal 2^-24 / smallest normal 2^-14 ({ANALYTIC}).",
            "",
            "| seed | params | S | entries | zero in fp16, S = 1 | zero in fp16, S | scaled "
            "grads finite | fp32 below 2^-24 | fp32 below 2^-14 |",
            "|---:|---|---:|---:|---:|---:|---|---:|---:|",
        ]
        for u in ls["underflow"]:
            lines.append(
                f"| {u['seed']} | {u['params']} | {u['loss_scale']:g} | {u['fp32_nonzero']} "
                f"| {u['zero_in_fp16_unscaled']:.4f} | {u['zero_in_fp16_scaled']:.4f} "
                f"| {u['scaled_grads_finite']} | {u['fp32_below_fp16_subnormal']:.4f} "
                f"| {u['fp32_below_fp16_normal']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if result.get("microbatch"):
        panels += ["temp", "time"]
    if result.get("sparse"):
        panels.append("sparse")
    if result.get("loss_scale"):
        panels.append("loss_scale")
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.8), squeeze=False)
    backend = result["backend"].upper()
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel in ("temp", "time"):
            mb = result["microbatch"]
            rows = mb["rows"]
            names = [r["name"] for r in rows]
            colors = [
                {
                    "plain": "gray",
                    "ours": "tab:blue",
                    "optax_microbatch": "tab:orange",
                    "optax_multisteps": "tab:green",
                }[r["method"]]
                for r in rows
            ]
            if panel == "temp":
                ax.barh(names, [r["xla"]["temp_bytes"] / MIB for r in rows], color=colors)
                ax.set_xlabel(f"temp MiB (XLA:{backend} compile-only)")
                ax.set_title(f"{mb['model']}, batch {mb['batch_size']}: temp bytes")
            else:
                paired = [r["time_ratio_paired"] for r in rows]
                lo = [
                    p - r["time_ratio_paired_range"][0] for p, r in zip(paired, rows, strict=True)
                ]
                hi = [
                    r["time_ratio_paired_range"][1] - p for p, r in zip(paired, rows, strict=True)
                ]
                ax.barh(names, paired, xerr=[lo, hi], color=colors, capsize=3)
                ax.axvline(1.0, color="k", lw=0.8)
                ax.set_xlabel("time per batch / plain (measured, same run; paired)")
                ax.set_title("time per full batch (noisy: shared CPU)")
            ax.invert_yaxis()
        elif panel == "sparse":
            sp = result["sparse"]
            names = [r["name"] for r in sp["rows"]]
            ax.barh(names, [r["stored_ratio"] for r in sp["rows"]], color="tab:purple")
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_xlabel("stored bytes / dense (analytic)")
            ax.set_title(f"{sp['model']}, {100 * sp['sparsity']:.0f}% sparse, DSR")
            ax.invert_yaxis()
        else:
            ls = result["loss_scale"]
            variants = list(ls["labels"])
            width = 0.38
            ypos = np.arange(len(variants))
            for j, scenario in enumerate(("normal", "overflow")):
                accs = []
                for v in variants:
                    a = [
                        r["test_accuracy"]
                        for r in ls["runs"]
                        if r["variant"] == v and r["scenario"] == scenario
                    ]
                    accs.append(statistics.mean(a) if a else 0.0)
                ax.barh(ypos + (j - 0.5) * width, accs, height=width, label=scenario)
            ax.set_yticks(ypos, variants)
            ax.set_xlim(0, 1)
            ax.set_xlabel("final test accuracy (measured)")
            ax.set_title(f"fp16 {ls['config']['model']}, digits: loss scaling")
            ax.legend(loc="lower right")
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"subset of: {', '.join(PARTS)}")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--model", default="wrn-28-2", help="microbatch and sparse parts")
    parser.add_argument("--batch-size", type=int, default=128, help="microbatch and sparse parts")
    parser.add_argument("--ks", default="4", help="microbatch counts, e.g. 2,4,8")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (microbatch part)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--ls-model", default="wrn-16-2")
    parser.add_argument("--ls-steps", type=int, default=220)
    parser.add_argument("--ls-batch-size", type=int, default=64)
    parser.add_argument("--fault-step", type=int, default=100)
    parser.add_argument("--fault-scale", type=float, default=1e5)
    parser.add_argument("--seeds", default="0", help="loss-scale seeds, e.g. 0,1,2")
    parser.add_argument(
        "--variants",
        default=",".join(LOSS_SCALE_VARIANTS),
        help=f"loss-scale variants, subset of: {', '.join(LOSS_SCALE_VARIANTS)}",
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown --only {unknown}; allowed values: {list(PARTS)}")
    variants = tuple(v for v in args.variants.split(",") if v)
    if any(v not in LOSS_SCALE_VARIANTS for v in variants):
        parser.error(f"unknown --variants {variants}; allowed values: {LOSS_SCALE_VARIANTS}")

    import flax

    backend = jax.default_backend()
    command = "python " + " ".join(
        [os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])
    )
    stem = os.path.join(args.out, f"peers_{backend}")
    result: dict = {}
    if os.path.exists(stem + ".json") and set(parts) != set(PARTS):
        with open(stem + ".json") as f:
            result = json.load(f)  # keep the parts not re-run
    result.update(
        backend=backend,
        jax_version=jax.__version__,
        optax_version=optax.__version__,
        flax_version=flax.__version__,
        machine=f"{platform.machine()}, {os.cpu_count()} cores (shared)",
    )

    def stamp(part: dict, seconds: float) -> dict:
        part["command"] = command
        part["timestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        )
        part["seconds"] = seconds
        return part

    if "microbatch" in parts:
        print("1. microbatch accumulation", flush=True)
        start = time.perf_counter()
        ks = tuple(int(k) for k in args.ks.split(","))
        part = microbatch_comparison(args.model, args.batch_size, ks, args.repeats)
        result["microbatch"] = stamp(part, time.perf_counter() - start)
    if "sparse" in parts:
        print("2. sparse storage", flush=True)
        start = time.perf_counter()
        part = sparse_comparison(args.model, args.batch_size, args.sparsity)
        result["sparse"] = stamp(part, time.perf_counter() - start)
    if "loss_scale" in parts:
        print("3. loss scaling", flush=True)
        start = time.perf_counter()
        part = loss_scale_comparison(
            variants,
            tuple(int(s) for s in args.seeds.split(",")),
            model_name=args.ls_model,
            batch_size=args.ls_batch_size,
            steps=args.ls_steps,
            fault_step=args.fault_step,
            fault_scale=args.fault_scale,
        )
        result["loss_scale"] = stamp(part, time.perf_counter() - start)

    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    markdown = to_markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    plot(result, stem + ".png")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
