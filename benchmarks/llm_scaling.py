"""How a LLaMA-style decoder's training memory, compile time and search time grow with its size.

For each size of ``lowmem_jax.models.llama.PRESETS`` (``llama-130m`` .. ``llama-7b``) at one
token batch (default 4 sequences x 1024 tokens), from abstract shapes (``jax.ShapeDtypeStruct``:
nothing allocated, nothing initialised, no step runs), compile-only on the default backend:

* **plain**: what a user would otherwise run, the Flax/Optax step (``jax.grad`` + the recipe's
  AdamW, float32, :func:`lowmem_jax.workloads.build_plain`);
* **baseline**: the library's own step with no technique (``Plan()``);
* **peer**: the least a JAX user reaches with Flax and Optax alone: the blocks under
  ``nn.scan(nn.remat(block))``, then each of bf16 parameters with ``optax.adamw`` (its state in
  the parameters' bf16), ``optax.adafactor``, and ``optax.MultiSteps`` accumulation over 4
  microbatches (the figure of one microbatch's call, whose state holds the accumulator); every
  peer row is listed, the least is the column;
* **best in the report's envelope** and **best in any**: :func:`lowmem_jax.planning.smallest.
  smallest_plan`, the planner's least-memory corners of every compute class compiled, the least
  kept, and the wall time that search took.

Each row: XLA's compiled total (argument + output + temp - alias), bytes per parameter, the
wall time of its analysis (trace + compile), and the analytic breakdown (parameters as stored,
gradients, optimizer state, saved activations, and the logits ``B x T x V`` in the compute
dtype, part of the activations). The peers' compiles use the library analysis' XLA options
(XLA:CPU: LLVM at -O0 and, since the blocks are remat'd, the CSE-barrier pass off without which
XLA:CPU undoes remat), so every row is compiled alike.

Usage:
    python benchmarks/llm_scaling.py                       # all sizes (about 30 min on 2 cores)
    python benchmarks/llm_scaling.py --sizes 130m,1b --compiles 3

Writes ``<out>/llm_scaling_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import lowmem_jax as lm
from lowmem_jax.analysis.memory import analysis_compiler_options, xla_memory
from lowmem_jax.blocks.policy import compiler_options
from lowmem_jax.models.llama import PRESETS, LlamaBlock, RMSNorm
from lowmem_jax.planning.smallest import smallest_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import result_writer  # noqa: E402

SIZES = ("130m", "350m", "1b", "7b")
GIB = 2.0**30
PEER_MICROBATCHES = 4


# --- the peer: Flax and Optax alone -------------------------------------------------------------


class _ScanBody(nn.Module):
    """One decoder layer as ``nn.scan``'s body: ``(x, None) -> (layer(x), None)``."""

    heads: int
    kv_heads: int
    ffn: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, _):
        return LlamaBlock(self.heads, self.kv_heads, self.ffn, dtype=self.dtype, name="block")(
            x, train=True
        ), None


class PeerLlama(nn.Module):
    """The same decoder written with Flax's own transforms: ``nn.scan`` over ``nn.remat`` of
    the layer (``jax.checkpoint``, nothing saved), the model's layers and head as the library's
    (``lowmem_jax.models.Llama``'s parameters, stacked by ``nn.scan`` on a leading axis)."""

    size: str
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        s = PRESETS[self.size]
        init = nn.initializers.normal(0.02)
        x = nn.Embed(s.vocab, s.width, dtype=self.dtype, embedding_init=init)(tokens)
        body = nn.scan(
            nn.remat(_ScanBody, prevent_cse=False),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=s.layers,
        )
        x, _ = body(s.heads, s.kv_heads, s.ffn, self.dtype, name="layers")(x, None)
        x = RMSNorm(dtype=self.dtype)(x)
        return nn.Dense(s.vocab, use_bias=False, dtype=self.dtype, kernel_init=init)(x)


def peer_row(size: str, batch: int, seq_len: int, name: str) -> dict[str, Any]:
    """One peer configuration's compiled step (module docstring): ``remat`` (float32, the
    recipe's AdamW), ``remat+bf16`` (bf16 parameters, adamw), ``remat+bf16+adafactor``,
    ``remat+bf16+adafactor+multisteps``."""
    model = PeerLlama(size)
    bf16 = "bf16" in name
    micro = PEER_MICROBATCHES if "multisteps" in name else 1
    tokens = jax.ShapeDtypeStruct((batch // micro, seq_len), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]
    if bf16:  # the parameters stored in bf16: the model computes in bf16 (dtype None)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    recipe = lm.workloads.registry.LLAMA_RECIPE
    lr = optax.cosine_decay_schedule(recipe.learning_rate, 1000)
    if "adafactor" in name:
        tx = optax.adafactor(lr)
    else:
        tx = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-8, weight_decay=recipe.weight_decay)
    if micro > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=micro)
    opt_state = jax.eval_shape(tx.init, params)

    def loss(p, inputs, targets):
        logits = model.apply({"params": p}, inputs).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(p, state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(p, inputs, targets)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    start = time.perf_counter()
    options = {**analysis_compiler_options(), **compiler_options("full")}
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens, tokens)
    xla = xla_memory(lowered.compile(options))
    seconds = time.perf_counter() - start
    count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "label": f"peer: {name}",
        "total_bytes": xla["total_bytes"],
        "bytes_per_param": xla["total_bytes"] / count,
        "xla": xla,
        "seconds": seconds,
        "breakdown": {
            "parameters": _bytes(params),
            "optimizer_state": _bytes(opt_state),
        },
    }


PEERS = ("remat", "remat+bf16", "remat+bf16+adafactor", "remat+bf16+adafactor+multisteps")


# --- the library's rows ---------------------------------------------------------------------------


def _bytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def library_row(label: str, setup, plan_name: str | None = None) -> dict[str, Any]:
    """``setup``'s compile-only analysis as a row, with the analytic breakdown."""
    start = time.perf_counter()
    report = setup.analyze()
    seconds = time.perf_counter() - start
    analytic = report.analytic
    optimizer = analytic["optimizer_breakdown"]
    gradients = optimizer.get("gradients", 0) + optimizer.get("gradient_accumulator", 0)
    work = setup.workload
    compute = setup.plan.policy.compute_dtype
    b, t = work.batch["inputs"].shape
    vocab = PRESETS[work.name.split("-", 1)[1]].vocab
    return {
        "label": label,
        "plan": plan_name,
        "total_bytes": report.xla["total_bytes"],
        "bytes_per_param": report.xla["total_bytes"] / report.param_count,
        "xla": report.xla,
        "seconds": seconds,
        "flops": report.flops,
        "breakdown": {
            "parameters": analytic["model_bytes"],
            "gradients": gradients,
            "optimizer_state": analytic["optimizer_bytes"] - gradients,
            "activations": analytic["activation_bytes"],
            "logits": b * t * vocab * jnp.dtype(compute).itemsize,
        },
    }


def measure_size(size: str, batch: int, seq_len: int, compiles: int) -> dict[str, Any]:
    """Every row of one size (module docstring)."""
    work = lm.workloads.workload(f"llama-{size}", batch, seq_len=seq_len)
    count = lm.models.llama.parameter_count(PRESETS[size])
    rows = [
        library_row("plain Flax/Optax step", lm.workloads.build_plain(work)),
        library_row("library baseline (no technique)", lm.build(work, lm.Plan())),
    ]
    rows += [peer_row(size, batch, seq_len, name) for name in PEERS]
    searches = {}
    for envelope in ("report", "any"):
        start = time.perf_counter()
        plan, found = smallest_plan(work, envelope, compiles=compiles)
        searches[envelope] = {**found, "seconds": time.perf_counter() - start}
        label = f"best in the {envelope!r} envelope"
        rows.append(library_row(label, lm.build(work, plan), found["plan"]))
        jax.clear_caches()  # the search's executables: a 7B step's are large
    print(f"llama-{size}: " + ", ".join(f"{r['label']} {r['total_bytes'] / GIB:.2f} GiB"
                                        for r in rows), flush=True)  # fmt: skip
    return {"size": size, "parameters": count, "shape": PRESETS[size].__dict__, "rows": rows,
            "searches": searches}  # fmt: skip


def _peer_best(entry: dict) -> dict:
    return min((r for r in entry["rows"] if r["label"].startswith("peer")),
               key=lambda r: r["total_bytes"])  # fmt: skip


def _row(entry: dict, prefix: str) -> dict:
    return next(r for r in entry["rows"] if r["label"].startswith(prefix))


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        "# LLaMA-style decoders: training memory by size",
        "",
        f"{m['source']} compile-only (nothing allocated or run), {m['batch_size']} sequences x "
        f"{m['seq_len']} tokens per step; commit {m['commit']}, JAX {m['jax_version']}, "
        f"{m['machine']}. `{m['command']}`",
        "",
        "GiB (bytes per parameter). plain: the Flax/Optax float32 AdamW step; peer: the least "
        "of Flax/Optax alone (scan + remat, bf16 parameters, adamw / adafactor, MultiSteps); "
        "best: the least the library's planner found compiling each compute class's "
        "least-memory plan.",
        "",
        "| model | parameters | plain | library baseline | peer (Flax/Optax) | best, report's "
        "envelope | best, any | plain / best any | peer / best any |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in result["sizes"]:
        cells = [_row(e, "plain"), _row(e, "library"), _peer_best(e),
                 _row(e, "best in the 'report'"), _row(e, "best in the 'any'")]  # fmt: skip
        text = [f"{r['total_bytes'] / GIB:.2f} ({r['bytes_per_param']:.1f})" for r in cells]
        best = cells[-1]["total_bytes"]
        lines.append(
            f"| llama-{e['size']} | {e['parameters'] / 1e6:,.0f}M | " + " | ".join(text)
            + f" | {cells[0]['total_bytes'] / best:.1f}x | {cells[2]['total_bytes'] / best:.1f}x |"
        )  # fmt: skip
    lines += ["", "## The plans and the times", "",
              "| model | best, report's envelope | best, any | least peer | plain analysis s | "
              "search s (report / any) |", "|---|---|---|---|---:|---:|"]  # fmt: skip
    for e in result["sizes"]:
        s = e["searches"]
        lines.append(
            f"| llama-{e['size']} | {s['report']['plan']} | {s['any']['plan']} | "
            f"{_peer_best(e)['label'][len('peer: ') :]} | {_row(e, 'plain')['seconds']:.1f} | "
            f"{s['report']['seconds']:.0f} / {s['any']['seconds']:.0f} |"
        )
    lines += ["", "## Analytic breakdown (GiB)", "",
              "| model | row | parameters | gradients | optimizer state | activations | "
              "of which logits |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for e in result["sizes"]:
        for r in e["rows"]:
            if r["label"].startswith("peer"):
                continue
            b = r["breakdown"]
            act = "" if b["activations"] is None else f"{b['activations'] / GIB:.2f}"
            lines.append(
                f"| llama-{e['size']} | {r['label']} | {b['parameters'] / GIB:.2f} | "
                f"{b['gradients'] / GIB:.2f} | {b['optimizer_state'] / GIB:.2f} | {act} | "
                f"{b['logits'] / GIB:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    params = [e["parameters"] for e in result["sizes"]]
    series = {
        "plain Flax/Optax": lambda e: _row(e, "plain"),
        "library baseline": lambda e: _row(e, "library"),
        "peer (Flax/Optax alone)": _peer_best,
        "best, report's envelope": lambda e: _row(e, "best in the 'report'"),
        "best, any": lambda e: _row(e, "best in the 'any'"),
    }
    for label, pick in series.items():
        left.plot(params, [pick(e)["total_bytes"] / GIB for e in result["sizes"]], "o-",
                  label=label)  # fmt: skip
    left.set(xscale="log", yscale="log", xlabel="parameters", ylabel="compiled total (GiB)",
             title=f"{result['meta']['source']} compile-only")  # fmt: skip
    left.legend(fontsize=8)
    right.plot(params, [_row(e, "plain")["seconds"] for e in result["sizes"]], "o-",
               label="plain step: trace + compile")  # fmt: skip
    for env in ("report", "any"):
        right.plot(params, [e["searches"][env]["seconds"] for e in result["sizes"]], "s--",
                   label=f"least-memory search, {env}")  # fmt: skip
    right.set(xscale="log", yscale="log", xlabel="parameters", ylabel="wall seconds",
              title=result["meta"]["machine"])  # fmt: skip
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="Default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=4, help="Default: %(default)s")
    parser.add_argument("--seq-len", type=int, default=1024, help="Default: %(default)s")
    parser.add_argument(
        "--compiles", type=int, default=6, help="plans each search compiles. Default: %(default)s"
    )
    parser.add_argument("--out", default="benchmarks/results", help="Default: %(default)s")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in PRESETS]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; allowed values: {list(PRESETS)}")
    if args.batch_size % PEER_MICROBATCHES:
        parser.error(f"--batch-size must be a multiple of {PEER_MICROBATCHES}")
    meta = result_writer.metadata(__file__, argv)
    meta.update(source=f"XLA:{jax.default_backend().upper()}", batch_size=args.batch_size,
                seq_len=args.seq_len)  # fmt: skip
    result = {"meta": meta, "sizes": []}
    for size in sizes:
        result["sizes"].append(measure_size(size, args.batch_size, args.seq_len, args.compiles))
    stem = os.path.join(args.out, f"llm_scaling_{jax.default_backend()}")
    result_writer.write(stem, result, to_markdown, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
