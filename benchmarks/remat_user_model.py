"""Remat on a model this library did not write: compiled bytes and FLOPs of one train step.

A user's CNN (a conv stem, ``--depth`` residual blocks of conv + BatchNorm + ReLU + dropout,
global pooling, a dense head; no ``remat`` attribute), written once in Linen and once in NNX,
trained by ``lm.make_train_step`` under ``mixed_bf16`` with 2 microbatches and SGD with momentum
(``--batch-size`` images of 32x32x3). Remat comes from the plan (:meth:`lowmem_jax.Plan
.configure_model`): ``none``; ``full`` over the whole forward
(``lowmem_jax.techniques.remat.remat_module`` with ``blocks=()``); ``full`` and ``dots`` per block
(``remat_blocks=("Block",)``); ``full`` per block found by the plan itself (``remat_blocks=()``: the
repeated block classes).

For each row, compile-only (nothing runs): XLA's figures (``total = argument + output + temp -
alias``, source XLA:<backend>), the analytic activation bytes (residuals one microbatch saves
for the backward pass, source: analytic) and the step's FLOPs counted from the jaxpr, each also
as a ratio to ``none`` of the same API in the same run.

Usage:
    python benchmarks/remat_user_model.py            # width 32, 6 blocks, batch 32

Writes ``<out-dir>/remat_user_model_<backend>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lowmem_jax as lm

# name -> (remat policy, remat_blocks; None: the whole forward under one checkpoint)
ROWS = {
    "none": ("none", ()),
    "full, whole forward": ("full", None),
    "full, per block": ("full", ("Block",)),
    "dots, per block": ("dots", ("Block",)),
    "full, blocks found": ("full", ()),
}


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.BatchNorm(use_running_average=not train)(nn.Conv(self.width, (3, 3))(x))
        return x + nn.Dropout(0.1, deterministic=not train)(nn.relu(y))


class LinenCNN(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3))(x)
        for _ in range(self.depth):
            x = Block(self.width)(x, train=train)
        return nn.Dense(10)(x.mean((1, 2)))


class NNXBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.conv = nnx.Conv(width, width, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(width, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(nnx.relu(self.norm(self.conv(x))))


class NNXCNN(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, width, (3, 3), rngs=rngs)
        self.blocks = nnx.List([NNXBlock(width, rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


def nnx_loss(model: NNXCNN, batch):
    logits = model(batch["image"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def measure(api: str, row: str, width: int, depth: int, batch_size: int) -> dict:
    remat, blocks = ROWS[row]
    if api == "nnx" and blocks:
        blocks = tuple("NNXBlock" for _ in blocks)
    plan = lm.Plan(precision="mixed_bf16", microbatches=2, remat=remat, remat_blocks=blocks or ())

    def configure(model):
        if blocks is not None:
            return plan.configure_model(model)
        whole = dataclasses.replace(plan, remat="none").configure_model(model)
        return lm.techniques.remat.remat_module(whole, remat, ())

    batch = {
        "image": jax.ShapeDtypeStruct((batch_size, 32, 32, 3), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }
    if api == "linen":
        model = configure(LinenCNN(width, depth))
        variables = model.init(jax.random.PRNGKey(0), jnp.zeros((2, 32, 32, 3)), train=False)
        params, model_state = variables.pop("params"), dict(variables)
        loss_fn = lm.classifier_loss_fn(model)
    else:
        split = lm.split_nnx(configure(NNXCNN(width, depth, nnx.Rngs(0))), nnx_loss)
        params, model_state, loss_fn = split.params, split.model_state, split.loss_fn
    tx = plan.wrap_optimizer(optax.sgd(0.1, momentum=0.9))
    state = jax.eval_shape(
        lambda: lm.TrainState.create(params=params, tx=tx, plan=plan, model_state=model_state)
    )
    step = lm.make_train_step(loss_fn, tx, plan)
    report = lm.analyze(step, state, batch, loss_fn=loss_fn, plan=plan, tx=tx)
    return {
        "api": api,
        "row": row,
        "plan": plan.to_dict(),
        "xla": report.xla,
        "activation_bytes": report.analytic["activation_bytes"],
        "flops": report.flops,
    }


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base = next(b for b in rows if b["api"] == r["api"] and b["row"] == "none")
        r["total_vs_none"] = r["xla"]["total_bytes"] / base["xla"]["total_bytes"]
        r["temp_vs_none"] = r["xla"]["temp_bytes"] / base["xla"]["temp_bytes"]
        r["flops_vs_none"] = r["flops"] / base["flops"]


def markdown(result: dict) -> str:
    mib = 2.0**20
    lines = [
        f"# Remat on a user's model ({result['backend_source']})",
        "",
        f"`{result['command']}`; {result['model']}. Compile-only; bytes in MiB; ratios to "
        "`none` of the same API in the same run.",
        "",
        "| API | remat | XLA total | XLA temp | total / none | analytic activations | "
        "FLOPs / none |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['api']} | {r['row']} | {r['xla']['total_bytes'] / mib:.1f} | "
            f"{r['xla']['temp_bytes'] / mib:.1f} | {r['total_vs_none']:.2f}x | "
            f"{r['activation_bytes'] / mib:.1f} | {r['flops_vs_none']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['api']}: {r['row']}" for r in rows]
    totals = [r["xla"]["total_bytes"] / 2**20 for r in rows]
    bars = ax.barh(labels, totals, color=["C0" if r["api"] == "linen" else "C1" for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        ax.text(
            bar.get_width(), bar.get_y() + bar.get_height() / 2,
            f" {r['flops_vs_none']:.2f}x FLOPs", va="center", fontsize=8,
        )  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel(f"compiled step total, MiB ({result['backend_source']})")
    ax.set_xlim(0, max(totals) * 1.3)
    ax.set_title(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    rows = []
    for api in ("linen", "nnx"):
        for row in ROWS:
            rows.append(measure(api, row, args.width, args.depth, args.batch_size))
            print(f"{api:5s} {row:20s} total {rows[-1]['xla']['total_bytes'] / 2**20:.1f} MiB")
    add_ratios(rows)
    backend = jax.default_backend()
    result = {
        "command": " ".join(["python benchmarks/remat_user_model.py", *sys.argv[1:]]),
        "model": (
            f"user CNN, width {args.width}, {args.depth} conv+BatchNorm+dropout residual blocks, "
            f"batch {args.batch_size} of 32x32x3, mixed_bf16, 2 microbatches, SGD momentum"
        ),
        "backend_source": rows[0]["xla"]["source"],
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"remat_user_model_{backend}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, stem + ".png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
