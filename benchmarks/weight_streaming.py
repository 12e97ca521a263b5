"""Weight streaming on the backend JAX has: a scanned stack's weights in host memory, one block at
a time on the device.

A stack of ``--blocks`` square dense blocks (``h <- tanh(h @ W_l)``, ``W_l`` ``[width, width]``
float32) trained with Adam, one configuration per fresh process (the runtime peak is a
per-process high-water mark):

* ``device``: parameters, gradients and Adam's moments on the device (what a user runs);
* ``stream``: the stack and Adam's moments live in host memory (``pinned_host``) between steps;
  the scan's body moves its block to the device (``jax.device_put(w, Space.Device)``) inside a
  ``jax.checkpoint``, so the backward pass moves it again instead of keeping it; the block's
  gradient goes back to host memory (the transpose of that move) and the update runs on the host
  (``lowmem_jax.techniques.shard.offload.on_host``), next to the moments;
* ``stream_saved``: the same move outside the checkpoint (the forward's device copy of every
  block may be kept for the backward pass): what the checkpoint buys.

Recorded per configuration: XLA's compiled figures (device and host bytes where the backend
reports them), the runtime peak (``memory_stats()["peak_bytes_in_use"]``, after the steps) and the
bytes in use after initialisation, the median step time, the losses of the steps (equal across
configurations: the same initialisation and arithmetic) and where the step's outputs live. The
CPU backend drops memory kinds (one memory): there the figures do not separate.

Usage::

    python benchmarks/weight_streaming.py --out-dir /tmp/ws          # all three, this backend
    python benchmarks/weight_streaming.py --out-dir /tmp/ws --hlo    # and each compiled program

The runtime figures also record the peak before the first step and after it, and the
allocator's statistics after the steps (whether a peak is held or was transient). Each
configuration is compiled in one process and measured in another that reads the executable
from a compilation cache (``--no-cache``: one process), so that compiling, whose GPU autotuning
runs kernels on the device, sets no peak of its own (it did: 178 MiB before the first step).

Writes ``<out-dir>/weight_streaming_<backend>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIGS = ("device", "stream", "stream_saved")
_MARK = "WEIGHT_STREAMING_RESULT "
MIB = 2**20


def _step(config: str, blocks: int, width: int, batch: int):
    """(jitted step, init state): ``step(params, opt_state, x) -> (params, opt_state, loss)``."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import SingleDeviceSharding

    from lowmem_jax.techniques.shard.offload import on_host

    device = jax.devices()[0]
    stream = config != "device"
    kind = "pinned_host" if stream else "device"
    where = SingleDeviceSharding(device, memory_kind=kind)
    optimizer = optax.adam(1e-3)

    def block(w, h):  # float32 products (not TF32 on a GPU): the losses compare across backends
        return jnp.tanh(jnp.dot(h, w, precision="highest"))

    def to_device(w):
        return jax.device_put(w, jax.memory.Space.Device) if stream else w

    if config == "stream":  # the move inside the checkpoint: the backward pass moves it again
        body = jax.checkpoint(lambda h, w: block(to_device(w), h))
    else:
        body = lambda h, w: jax.checkpoint(block)(to_device(w), h)  # noqa: E731

    def loss_fn(stack, x):
        h, _ = jax.lax.scan(lambda h, w: (body(h, w), None), x, stack)
        return jnp.mean(h**2)

    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if stream:  # where the moments are: on the host
        update = on_host(jax.jit(update))

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        if stream:
            grads = jax.device_put(grads, jax.memory.Space.Host)
        params, opt_state = update(grads, opt_state, params)
        return params, opt_state, loss

    # Made by the host's CPU backend and put where they live: made on the accelerator, the stack
    # and moments would set its peak before the first step (they did: 768 MiB on the H200).
    with jax.default_device(jax.devices("cpu")[0]):
        key = jax.random.PRNGKey(0)
        params = jax.random.normal(key, (blocks, width, width), jnp.float32) / width**0.5
        opt_state = optimizer.init(params)
    params, opt_state = jax.device_put((params, opt_state), where)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width), jnp.float32)
    state_where = jax.tree.map(lambda _: where, (params, opt_state))
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*state_where, None))
    return jitted, params, opt_state, x


def measure(
    config: str, blocks: int, width: int, batch: int, steps: int, hlo: str | None = None
) -> dict:
    """One configuration in this process; with ``hlo``, the compiled program's text written
    there (where the backend placed each copy between memories)."""
    import jax

    jitted, params, opt_state, x = _step(config, blocks, width, batch)
    start = time.perf_counter()
    compiled = jitted.lower(params, opt_state, x).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    xla = {
        name: int(getattr(analysis, name, 0) or 0)
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                     "alias_size_in_bytes", "host_argument_size_in_bytes",
                     "host_output_size_in_bytes", "host_temp_size_in_bytes")
    }  # fmt: skip
    if hlo:
        with open(hlo, "w") as f:
            f.write(compiled.as_text())
    device = jax.devices()[0]
    jax.block_until_ready((params, opt_state, x))
    at_init = device.memory_stats()
    losses, seconds, after_first = [], [], None
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, x)
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
        after_first = after_first or device.memory_stats()
    stats = device.memory_stats()
    kinds = sorted({str(leaf.sharding.memory_kind) for leaf in jax.tree.leaves(params)})
    return {
        "config": config,
        "xla": xla,
        "output_memory_kinds": kinds,  # where the step's new parameters live
        "runtime_peak_bytes": None if stats is None else int(stats["peak_bytes_in_use"]),
        "runtime_in_use_after_init_bytes": at_init and int(at_init["bytes_in_use"]),
        # Whether the peak is held after the steps (buffers kept) or was transient in one step.
        "runtime_peak_after_init_bytes": at_init and int(at_init["peak_bytes_in_use"]),
        "runtime_peak_after_first_step_bytes": after_first
        and int(after_first["peak_bytes_in_use"]),
        "runtime_stats_after_steps": stats and {k: int(v) for k, v in stats.items()},
        "compile_seconds": compile_s,
        "step_seconds_median": sorted(seconds[1:])[len(seconds[1:]) // 2] if steps > 1 else None,
        "losses": losses,
    }  # fmt: skip


def _cell(value: float | None, unit: float, spec: str = ".1f") -> str:
    """``value / unit`` as the table shows it; ``n/a`` where it was not measured."""
    return "n/a" if value is None else format(value / unit, spec)


def _table(result: dict) -> str:
    blocks, width = result["blocks"], result["width"]
    block_mib = width * width * 4 / MIB
    flags = f"XLA_FLAGS={result['xla_flags']} " if result.get("xla_flags") else ""
    lines = [
        f"# Weight streaming on {result['device']} ({result['backend']}, JAX {result['jax']})",
        "",
        f"{blocks} blocks of `tanh(h @ W)`, W float32 [{width}, {width}] ({block_mib:.0f} MiB per "
        f"block, {blocks * block_mib:.0f} MiB of parameters), batch {result['batch']}, Adam. "
        "XLA columns are compiled figures of the device (and host where reported); `runtime "
        "peak` is the device's `peak_bytes_in_use` after the steps (runtime), `before the "
        "steps` the same after compiling and initialising (the process's; compiling for a GPU "
        "runs autotuning kernels on the device).",
        "",
        f"Made by: `{flags}{result['command']}`"
        + (
            f"; each configuration compiled in {result['compiled_in']}"
            if result.get("compiled_in")
            else ""
        ),
        "",
        "| config | XLA device total MiB | XLA host args MiB | runtime after init MiB | "
        "runtime peak before the steps MiB | runtime peak MiB | peak / block | ms / step | "
        "losses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['config']} | error: {row['error'][:160]} | | | | | | | |")
            continue
        x = row["xla"]
        total = (x["argument_size_in_bytes"] + x["output_size_in_bytes"]
                 + x["temp_size_in_bytes"] - x["alias_size_in_bytes"])  # fmt: skip
        peak = row["runtime_peak_bytes"]
        init = row["runtime_in_use_after_init_bytes"]
        before = row["runtime_peak_after_init_bytes"]
        ms = row["step_seconds_median"]
        lines.append(
            f"| {row['config']} | {total / MIB:.1f} | {x['host_argument_size_in_bytes'] / MIB:.1f}"
            f" | {_cell(init, MIB)} | {_cell(before, MIB)} | {_cell(peak, MIB)}"
            f" | {_cell(peak, MIB * block_mib, '.2f')} | {_cell(ms, 1e-3)}"
            f" | {', '.join(f'{v:.6f}' for v in row['losses'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--hlo", action="store_true", help="also write each compiled program's text to the out dir"
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="compile and measure in one process"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = (args.blocks, args.width, args.batch, args.steps)
    if args.worker:
        if args.cache_dir:
            from lowmem_jax.cli.dispatch import _use_compilation_cache

            _use_compilation_cache(args.cache_dir)
        if args.compile_only:
            jitted, *state = _step(args.worker, *shape[:3])
            jitted.lower(*state).compile()
            return 0
        hlo = args.hlo and os.path.join(args.out_dir, f"weight_streaming_{args.worker}.hlo.txt")
        print(_MARK + json.dumps(measure(args.worker, *shape, hlo=hlo or None)), flush=True)
        return 0
    import jax

    os.makedirs(args.out_dir, exist_ok=True)
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
    rows = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            print(f"--configs: unknown {config!r}; one of {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
        worker = [sys.executable, os.path.abspath(__file__), "--out-dir", args.out_dir,
                  "--worker", config, "--blocks", str(args.blocks), "--width", str(args.width),
                  "--batch", str(args.batch), "--steps", str(args.steps)]  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="weight_streaming_cache_") as cache:
            if not args.no_cache:
                worker += ["--cache-dir", cache]
                subprocess.run([*worker, "--compile-only"], env=env, check=False)
            done = subprocess.run(
                [*worker, *(["--hlo"] if args.hlo else [])],
                capture_output=True, text=True, env=env, check=False,
            )  # fmt: skip
        found = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
        if found:
            rows.append(json.loads(found[-1][len(_MARK) :]))
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"config": config, "error": tail})
        print(json.dumps(rows[-1])[:600], flush=True)
    result = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "blocks": args.blocks,
        "width": args.width,
        "batch": args.batch,
        "xla_flags": os.environ.get("XLA_FLAGS"),  # e.g. GPU autotuning off
        "compiled_in": "the measuring process" if args.no_cache else "an earlier process",
        "command": "python benchmarks/weight_streaming.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    stem = os.path.join(args.out_dir, f"weight_streaming_{jax.default_backend()}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
