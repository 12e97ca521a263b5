"""Incremental decoding vs re-running the decoder over the whole prefix, in the same run.

``greedy_decode`` and ``beam_search`` feed one token per step through the per-layer cache of
:meth:`DynamicConvTransformer.decode_step` (O(T) decoder work for T tokens). The reference here
is the path they replaced: the full ``decode`` over the ``[N, max_len]`` prefix buffer at every
step (O(T^2)), plugged into the same search loops. Both must give the same tokens.

Usage:
    python benchmarks/decode.py                 # small preset, 32 sentences; iwslt, 4 sentences
    python benchmarks/decode.py --presets small --repeats 5

Writes ``<out-dir>/decode_<backend>.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lowmem_jax.models import DynamicConvTransformer, beam_search, greedy_decode

# preset -> (batch, source length, max_len)
PRESETS = {"small": (32, 20, 40), "iwslt": (4, 20, 30)}


def make_model(preset: str) -> DynamicConvTransformer:
    if preset == "small":
        return DynamicConvTransformer.small(1000, 1000, dropout=0.0)
    return DynamicConvTransformer.iwslt_de_en(
        dropout=0.0, attention_dropout=0.0, weight_dropout=0.0
    )


def full_prefix_decoder(model: DynamicConvTransformer, max_len: int):
    """The old path behind the cache interface: the cache is the prefix buffer."""

    class FullPrefix:
        pad_id = model.pad_id

        @staticmethod
        def apply(variables, *args, method):
            return method(variables, *args)

        @staticmethod
        def encode(variables, src):
            return model.apply(variables, src, method=model.encode)

        @staticmethod
        def init_cache(variables, memory, src_mask):
            prefix = jnp.zeros((memory.shape[0], max_len), jnp.int32)
            return {"prefix": prefix, "t": jnp.int32(0), "memory": memory, "src_mask": src_mask}

        @staticmethod
        def decode_step(variables, tokens, cache):
            prefix = jax.lax.dynamic_update_index_in_dim(cache["prefix"], tokens, cache["t"], 1)
            logits = model.apply(
                variables, prefix, cache["memory"], cache["src_mask"], method=model.decode
            )
            step_logits = jax.lax.dynamic_index_in_dim(logits, cache["t"], 1, False)
            return step_logits, {**cache, "prefix": prefix, "t": cache["t"] + 1}

        @staticmethod
        def reorder_cache(cache, indices):
            return {**cache, "prefix": cache["prefix"][indices]}

    return FullPrefix


def measure(preset: str, repeats: int) -> list[dict]:
    model = make_model(preset)
    batch, src_len, max_len = PRESETS[preset]
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(3, model.src_vocab_size, (batch, src_len)), jnp.int32)
    src = src.at[:, -1].set(2)
    params = jax.jit(model.init)(jax.random.key(0), src[:1, :4], src[:1, :4])["params"]
    reference = full_prefix_decoder(model, max_len)

    def best_time(fn):
        out = jax.block_until_ready(fn(params, src))  # compile + first call
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(params, src))
            times.append(time.perf_counter() - start)
        return np.asarray(out), min(times)

    rows = []
    searches = {
        "greedy": lambda m: functools.partial(greedy_decode, m, max_len=max_len),
        "beam 4": lambda m: functools.partial(beam_search, m, max_len=max_len, beam_size=4),
    }
    for name, make in searches.items():
        inc_out, inc_s = best_time(jax.jit(make(model)))
        full_out, full_s = best_time(jax.jit(make(reference)))
        rows.append(
            {
                "preset": preset,
                "search": name,
                "batch": batch,
                "source_len": src_len,
                "max_len": max_len,
                "incremental_seconds": inc_s,
                "full_prefix_seconds": full_s,
                "speedup": full_s / inc_s,
                "outputs_equal": bool((inc_out == full_out).all()),
            }
        )
        print(
            f"{preset} {name}: incremental {inc_s:.3f} s, full prefix {full_s:.3f} s, "
            f"x{full_s / inc_s:.1f}, equal outputs: {rows[-1]['outputs_equal']}",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,iwslt", help="Default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3, help="Default: %(default)s")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    for p in presets:
        if p not in PRESETS:
            parser.error(f"--presets: unknown {p!r}; allowed values: {list(PRESETS)}")
    rows = [row for p in presets for row in measure(p, args.repeats)]
    command = "python benchmarks/decode.py " + " ".join(argv or sys.argv[1:])
    backend = jax.default_backend()
    result = {
        "command": command.strip(),
        "backend": backend,
        "jax_version": jax.__version__,
        "rows": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"decode_{backend}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# Incremental decoding vs the full prefix, same run",
        "",
        f"Command: `{result['command']}`; backend {backend}, JAX {jax.__version__}; best of "
        f"{args.repeats} calls after compilation; random-initialised models (speed only).",
        "",
        "| preset | search | sentences | max_len | incremental s | full prefix s | speed-up "
        "| same tokens |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['search']} | {r['batch']} | {r['max_len']} | "
            f"{r['incremental_seconds']:.3f} | {r['full_prefix_seconds']:.3f} | "
            f"{r['speedup']:.1f}x | {r['outputs_equal']} |"
        )
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
