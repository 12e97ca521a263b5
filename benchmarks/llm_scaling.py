"""How a language model's training memory, compile time and search time grow with its size.

For each model (default: the LLaMA-style decoders ``llama-130m`` .. ``llama-7b`` of
``lowmem_jax.models.llama.PRESETS`` and BERT-large's masked LM) at one token batch (default 4096
tokens: 4 sequences x 1024 for the decoders, 8 x 512 for BERT), from abstract shapes
(``jax.ShapeDtypeStruct``: nothing allocated, nothing initialised, no step runs), compile-only
on the default backend:

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
    python benchmarks/llm_scaling.py                       # every model (about 45 min, 2 cores)
    python benchmarks/llm_scaling.py --models llama-130m,bert-large --compiles 3

Writes ``<out>/llm_scaling_<backend>.{json,md,png}``; the models not run are kept from an
existing JSON there (each entry records its commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
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
from lowmem_jax.core.provenance import source_commit
from lowmem_jax.models.bert import BERT_PRESETS, BertBlock
from lowmem_jax.models.llama import PRESETS, LlamaBlock, RMSNorm
from lowmem_jax.planning.smallest import smallest_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import result_writer  # noqa: E402

MODELS = ("llama-130m", "llama-350m", "llama-1b", "llama-7b", "bert-large")
#: Tokens per step of each family: sequences x tokens.
TOKEN_BATCH = {"llama": (4, 1024), "bert": (8, 512)}
GIB = 2.0**30
PEER_MICROBATCHES = 4


# --- the peer: Flax and Optax alone -------------------------------------------------------------


class _ScanBody(nn.Module):
    """One layer as ``nn.scan``'s body: ``(x, None) -> (block(x), None)``."""

    make_block: Any

    @nn.compact
    def __call__(self, x, _):
        return self.make_block(name="block")(x, train=True), None


def _scanned(make_block, layers: int, x):
    """``layers`` blocks under ``nn.scan(nn.remat(...))``, nothing saved but the carries."""
    body = nn.scan(
        nn.remat(_ScanBody, prevent_cse=False),
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        length=layers,
    )
    return body(make_block, name="layers")(x, None)[0]


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
        block = functools.partial(LlamaBlock, s.heads, s.kv_heads, s.ffn, dtype=self.dtype)
        x = RMSNorm(dtype=self.dtype)(_scanned(block, s.layers, x))
        return nn.Dense(s.vocab, use_bias=False, dtype=self.dtype, kernel_init=init)(x)


class PeerBert(nn.Module):
    """BERT's masked LM with Flax's own transforms (``nn.scan`` over ``nn.remat`` of the
    library's :class:`~lowmem_jax.models.BertBlock`), dropout 0.1 as BERT's."""

    size: str
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        s = BERT_PRESETS[self.size]
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(s.vocab, s.width, dtype=self.dtype, embedding_init=init)
        position = self.param("position", init, (s.max_positions, s.width))
        token_type = self.param("token_type", init, (2, s.width))
        x = embed(tokens)
        x = x + (position[: tokens.shape[1]] + token_type[0]).astype(x.dtype)
        x = nn.Dropout(0.1, deterministic=False)(nn.LayerNorm(1e-12, dtype=self.dtype)(x))
        block = functools.partial(BertBlock, s.heads, s.ffn, dtype=self.dtype)
        x = _scanned(block, s.layers, x)
        x = nn.gelu(nn.Dense(s.width, dtype=self.dtype, kernel_init=init)(x), approximate=False)
        x = nn.LayerNorm(1e-12, dtype=self.dtype)(x)
        return embed.attend(x) + self.param("bias", nn.initializers.zeros, (s.vocab,))


def peer_row(model_name: str, batch: int, seq_len: int, name: str) -> dict[str, Any]:
    """One peer configuration's compiled step (module docstring): ``remat`` (float32, the
    recipe's AdamW), ``remat+bf16`` (bf16 parameters, adamw), ``remat+bf16+adafactor``,
    ``remat+bf16+adafactor+multisteps``. The loss: next-token cross-entropy (decoders), the
    mean over the weighted positions (BERT)."""
    family, size = model_name.split("-", 1)
    model = PeerLlama(size) if family == "llama" else PeerBert(size)
    bf16 = "bf16" in name
    micro = PEER_MICROBATCHES if "multisteps" in name else 1
    tokens = jax.ShapeDtypeStruct((batch // micro, seq_len), jnp.int32)
    weights = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    params = jax.eval_shape(model.init, rngs, tokens)["params"]
    if bf16:  # the parameters stored in bf16: the model computes in bf16 (dtype None)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    recipe = lm.workloads.workload(model_name).recipe
    lr = optax.cosine_decay_schedule(recipe.learning_rate, 1000)
    if "adafactor" in name:
        tx = optax.adafactor(lr)
    else:
        tx = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-8, weight_decay=recipe.weight_decay)
    if micro > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=micro)
    opt_state = jax.eval_shape(tx.init, params)

    def loss(p, inputs, targets, w):
        logits = model.apply({"params": p}, inputs, rngs={"dropout": jax.random.PRNGKey(2)})
        nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return nll.mean() if family == "llama" else (nll * w).sum() / jnp.maximum(w.sum(), 1.0)

    def step(p, state, inputs, targets, w):
        value, grads = jax.value_and_grad(loss)(p, inputs, targets, w)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    start = time.perf_counter()
    options = {**analysis_compiler_options(), **compiler_options("full")}
    step = jax.jit(step, donate_argnums=(0, 1))
    lowered = step.lower(params, opt_state, tokens, tokens, weights)
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
    vocab = work.model.vocab_size
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


def measure_model(model: str, batch: int, seq_len: int, compiles: int) -> dict[str, Any]:
    """Every row of one model (module docstring)."""
    work = lm.workloads.workload(model, batch, seq_len=seq_len)
    family, size = model.split("-", 1)
    shape = PRESETS[size] if family == "llama" else BERT_PRESETS[size]
    count = sum(x.size for x in jax.tree.leaves(work.variable_shapes(work.model)["params"]))
    rows = [
        library_row("plain Flax/Optax step", lm.workloads.build_plain(work)),
        library_row("library baseline (no technique)", lm.build(work, lm.Plan())),
    ]
    rows += [peer_row(model, batch, seq_len, name) for name in PEERS]
    searches = {}
    for envelope in ("report", "any"):
        start = time.perf_counter()
        plan, found = smallest_plan(work, envelope, compiles=compiles)
        searches[envelope] = {**found, "seconds": time.perf_counter() - start}
        label = f"best in the {envelope!r} envelope"
        rows.append(library_row(label, lm.build(work, plan), found["plan"]))
        jax.clear_caches()  # the search's executables: a 7B step's are large
    print(f"{model}: " + ", ".join(f"{r['label']} {r['total_bytes'] / GIB:.2f} GiB"
                                   for r in rows), flush=True)  # fmt: skip
    return {"model": model, "parameters": count, "shape": dataclasses.asdict(shape),
            "batch_size": batch, "seq_len": seq_len, "rows": rows, "searches": searches,
            "commit": source_commit()}  # fmt: skip


def _peer_best(entry: dict) -> dict:
    return min((r for r in entry["rows"] if r["label"].startswith("peer")),
               key=lambda r: r["total_bytes"])  # fmt: skip


def _row(entry: dict, prefix: str) -> dict:
    return next(r for r in entry["rows"] if r["label"].startswith(prefix))


def to_markdown(result: dict) -> str:
    m = result["meta"]
    commits = ", ".join(sorted({e["commit"] for e in result["sizes"]}))
    lines = [
        "# LLaMA-style decoders: training memory by size",
        "",
        f"{m['source']} compile-only (nothing allocated or run); commits {commits}, JAX "
        f"{m['jax_version']}, {m['machine']}. `{m['command']}` (each model's entry in the JSON "
        "records its own commit).",
        "",
        "GiB (bytes per parameter of the dense model). plain: the Flax/Optax float32 AdamW "
        "step; peer: the least of Flax/Optax alone (scan + remat, bf16 parameters, adamw / "
        "adafactor, MultiSteps); best: the least the library's planner found compiling each "
        "compute class's least-memory plan (a factorized plan trains a model of fewer "
        "parameters: the layers' ranks cut, `tucker 25%` to 25% of their parameters).",
        "",
        "| model | parameters | sequences x tokens | plain | library baseline | "
        "peer (Flax/Optax) | best, report's envelope | best, any | plain / best any | "
        "peer / best any |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in result["sizes"]:
        cells = [_row(e, "plain"), _row(e, "library"), _peer_best(e),
                 _row(e, "best in the 'report'"), _row(e, "best in the 'any'")]  # fmt: skip
        # per parameter of the dense model (a factorized plan's own count is smaller)
        text = [f"{r['total_bytes'] / GIB:.2f} ({r['total_bytes'] / e['parameters']:.1f})"
                for r in cells]  # fmt: skip
        best = cells[-1]["total_bytes"]
        lines.append(
            f"| {e['model']} | {e['parameters'] / 1e6:,.0f}M | "
            + f"{e['batch_size']} x {e['seq_len']} | " + " | ".join(text)
            + f" | {cells[0]['total_bytes'] / best:.1f}x | {cells[2]['total_bytes'] / best:.1f}x |"
        )  # fmt: skip
    lines += ["", "## The plans and the times", "",
              "| model | best, report's envelope | best, any | least peer | plain analysis s | "
              "search s (report / any) |", "|---|---|---|---|---:|---:|"]  # fmt: skip
    for e in result["sizes"]:
        s = e["searches"]
        lines.append(
            f"| {e['model']} | {s['report']['plan']} | {s['any']['plan']} | "
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
                f"| {e['model']} | {r['label']} | {b['parameters'] / GIB:.2f} | "
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
    parser.add_argument("--models", default=",".join(MODELS), help="Default: %(default)s")
    parser.add_argument(
        "--seq-len", type=int, help="tokens per sequence, and --batch-size sequences per step. "
        "Default: 1024 x 4 for llama-*, 512 x 8 for bert-*",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int)
    parser.add_argument(
        "--compiles", type=int, default=6, help="plans each search compiles. Default: %(default)s"
    )
    parser.add_argument("--out", default="benchmarks/results", help="Default: %(default)s")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    allowed = [f"llama-{s}" for s in PRESETS] + [f"bert-{s}" for s in BERT_PRESETS]
    unknown = [m for m in models if m not in allowed]
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed values: {allowed}")
    if args.batch_size is not None and args.batch_size % PEER_MICROBATCHES:
        parser.error(f"--batch-size must be a multiple of {PEER_MICROBATCHES}")
    stem = os.path.join(args.out, f"llm_scaling_{jax.default_backend()}")
    meta = result_writer.metadata(__file__, argv)
    meta["source"] = f"XLA:{jax.default_backend().upper()}"
    kept = []
    if os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            kept = [e for e in json.load(f)["sizes"] if e["model"] not in models]
    measured = []
    for model in models:
        batch, seq_len = TOKEN_BATCH[model.split("-")[0]]
        batch, seq_len = args.batch_size or batch, args.seq_len or seq_len
        measured.append(measure_model(model, batch, seq_len, args.compiles))
    order = {m: i for i, m in enumerate(allowed)}
    result = {"meta": meta, "sizes": sorted(kept + measured, key=lambda e: order[e["model"]])}
    result_writer.write(stem, result, to_markdown, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
