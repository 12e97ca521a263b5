"""Conv gradient step time and XLA temp memory, outside vs inside ``lax.scan``.

Compares ``conv2d(impl="xla")`` (JAX autodiff of ``lax.conv_general_dilated``)
with ``impl="loop_friendly"`` (custom VJP built from forward convs) on:

* ``stack``: 4 x (3x3 stride-1 conv, 32 -> 32 channels, relu) on 128 x 32 x 32 x 32,
  (a) full batch, (b) ``lax.scan`` over 4 microbatches of 32 accumulating grads,
  (c) the 4 layers as a ``lax.scan`` over stacked kernels (full batch).
* ``down``: 3x3 stride-2 conv (32 -> 64) + relu, plus a 1x1 stride-2 shortcut,
  grads w.r.t. kernels and input, full batch and as 4 scanned microbatches.

Timings: compile, one warm-up call, then the median of ``--repeats`` calls
(round-robin over cases, ``block_until_ready``). Temp memory is XLA's
``memory_analysis().temp_size_in_bytes``. Ratios are to the full-batch "xla"
time of the same model in the same run.

Usage: python benchmarks/conv_in_loop.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.ops import conv2d

IMPLS = ("xla", "loop_friendly")
BATCH, MICRO, HW, CH, LAYERS = 128, 4, 32, 32, 4


def stack_loss(impl: str):
    def loss(kernels, x):
        h = x
        for k in kernels:
            h = jax.nn.relu(conv2d(h, k, impl=impl))
        return jnp.mean(h**2)

    return loss


def scanned_stack_loss(impl: str):
    def loss(stacked, x):
        def layer(h, k):
            return jax.nn.relu(conv2d(h, k, impl=impl)), None

        h, _ = jax.lax.scan(layer, x, stacked)
        return jnp.mean(h**2)

    return loss


def down_loss(impl: str):
    def loss(params, x):
        w3, w1 = params
        y = jax.nn.relu(conv2d(x, w3, (2, 2), "SAME", impl)) + conv2d(x, w1, (2, 2), "VALID", impl)
        return jnp.mean(y**2)

    return loss


def full_batch(loss, wrt_input: bool = False) -> Callable:
    """Grads w.r.t. params (and the input, to exercise the input-gradient conv)."""
    return jax.grad(loss, argnums=(0, 1) if wrt_input else 0)


def microbatched(loss, wrt_input: bool = False) -> Callable:
    """Grads of the mean loss as a lax.scan over MICRO microbatches, accumulating param grads."""

    def step(params, x):
        xs = x.reshape(MICRO, -1, *x.shape[1:])

        def body(acc, xb):
            if wrt_input:
                g, dx = jax.grad(loss, argnums=(0, 1))(params, xb)
            else:
                g, dx = jax.grad(loss)(params, xb), None
            return jax.tree.map(jnp.add, acc, g), dx

        zeros = jax.tree.map(jnp.zeros_like, params)
        acc, dxs = jax.lax.scan(body, zeros, xs)
        g = jax.tree.map(lambda a: a / MICRO, acc)
        return (g, dxs.reshape(x.shape) / MICRO) if wrt_input else g

    return step


def measure(
    cases: list[tuple[Callable, tuple]], repeats: int, budget_s: float
) -> list[tuple[float, int]]:
    """(median seconds, temp bytes) per (fn, args): compiled and run once first.

    Repeats go round-robin over the cases so that machine-load drift hits all of
    them alike; a case stops repeating once it has used ``budget_s`` (the
    pathological in-loop cases take tens of seconds per call).
    """
    compiled, temps, times, spent = [], [], [], []
    for fn, args in cases:
        c = jax.jit(fn).lower(*args).compile()
        temps.append(c.memory_analysis().temp_size_in_bytes)
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))  # warm-up
        compiled.append(c)
        spent.append(time.perf_counter() - t0)
        times.append([])
    for _ in range(repeats):
        for i, (c, (_, args)) in enumerate(zip(compiled, cases, strict=True)):
            if times[i] and spent[i] > budget_s:
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[i].append(time.perf_counter() - t0)
            spent[i] += times[i][-1]
    return [(statistics.median(t), temp) for t, temp in zip(times, temps, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=str, default=None, help="write results here")
    ap.add_argument(
        "--budget-s", type=float, default=60.0, help="stop repeating a case after this many seconds"
    )
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, HW, HW, CH)), jnp.float32)
    he = np.sqrt(2.0 / (9 * CH))
    kernels = [
        jnp.asarray(rng.standard_normal((3, 3, CH, CH)) * he, jnp.float32) for _ in range(LAYERS)
    ]
    down = (
        jnp.asarray(rng.standard_normal((3, 3, CH, 2 * CH)) * he, jnp.float32),
        jnp.asarray(rng.standard_normal((1, 1, CH, 2 * CH)) * np.sqrt(2.0 / CH), jnp.float32),
    )

    cases = []  # (model, variant, impl, fn, params)
    for impl in IMPLS:
        cases += [
            ("stack", "full batch", impl, full_batch(stack_loss(impl)), kernels),
            ("stack", f"scan {MICRO} microbatches", impl, microbatched(stack_loss(impl)), kernels),
            (
                "stack",
                f"scan over {LAYERS} layers",
                impl,
                full_batch(scanned_stack_loss(impl)),
                jnp.stack(kernels),
            ),
            ("down", "full batch", impl, full_batch(down_loss(impl), True), down),
            ("down", f"scan {MICRO} microbatches", impl, microbatched(down_loss(impl), True), down),
        ]

    measured = measure([(fn, (params, x)) for *_, fn, params in cases], args.repeats, args.budget_s)
    results = [
        {"model": model, "variant": variant, "impl": impl, "time_s": t, "temp_bytes": temp}
        for (model, variant, impl, _, _), (t, temp) in zip(cases, measured, strict=True)
    ]

    base = {
        r["model"]: r["time_s"]
        for r in results
        if r["variant"] == "full batch" and r["impl"] == "xla"
    }
    for r in results:
        r["ratio_to_full_batch_xla"] = r["time_s"] / base[r["model"]]

    print(f"\njax {jax.__version__}, backend {jax.default_backend()}, repeats {args.repeats}")
    head = ("model", "variant", "impl", "time [s]", "ratio", "temp [MiB]")
    print("{:6s} {:24s} {:13s} {:>9s} {:>7s} {:>10s}".format(*head))
    for r in sorted(results, key=lambda r: (r["model"], r["variant"], r["impl"])):
        print(
            f"{r['model']:6s} {r['variant']:24s} {r['impl']:13s} {r['time_s']:9.4f} "
            f"{r['ratio_to_full_batch_xla']:7.2f} {r['temp_bytes'] / 2**20:10.1f}"
        )
    if args.json:
        meta = {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "repeats": args.repeats,
            "budget_s": args.budget_s,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
