"""What computing the LM head's logits a chunk at a time (``Plan.loss_chunk``) saves, per plan.

For each case (a decoder, its token batch and a plan the LLM scaling table or the planner
quotes), the step is compiled from abstract shapes (nothing allocated; XLA's compiled total =
argument + output + temp - alias) with the plan as quoted and with ``loss_chunk`` added: the
logits ``[B T, V]`` never exist whole, each chunk's recomputed in the backward pass. The chunk
is a quarter of a microbatch's tokens.

    python benchmarks/loss_chunk.py [--cases 1b-baseline,7b-s2048-planner] [--out-dir DIR]

Writes ``<out>/loss_chunk_<backend>.{json,md,png}`` (about 3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax

import lowmem_jax as lm
from lowmem_jax.compose.flags import plan_from_argv
from lowmem_jax.core.units import GIB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from result_writer import metadata, selected_configs, write  # noqa: E402

#: name -> (model, batch size, sequence length, the plan's flags, where the plan is quoted).
CASES = {
    "1b-baseline": ("llama-1b", 4, 1024, [], "the library's step, no technique"),
    "1b-report": ("llama-1b", 4, 1024, ["--remat", "full", "--optimizer-state", "int8",
                  "--sparsity", "0.7"], "llm_scaling: best in the report's envelope"),
    "1b-any": ("llama-1b", 4, 1024, ["--factorize", "tucker", "--precision", "fp16",
               "--microbatches", "4", "--remat", "sqrt", "--optimizer-state", "int4",
               "--sparsity", "0.9"], "llm_scaling: best in any"),
    "7b-s2048-planner": ("llama-7b", 1, 2048, ["--precision", "fp16", "--remat",
                         "blocks:full*8,dots*24", "--optimizer-state", "int8", "--factorize",
                         "tucker", "--sparsity", "0.9"],
                         "lowmem plan --budget 24GiB --envelope any, seq 2048 x 1"),
}  # fmt: skip


def compiled(model: str, batch: int, seq: int, plan: lm.Plan) -> dict:
    """XLA's compiled figures of ``plan``'s step, the verdict of ``loss_chunk`` and the time."""
    start = time.perf_counter()
    setup = lm.build(lm.workload(model, batch, seq_len=seq), plan)
    report = setup.analyze()
    verdict = [v for v in setup.verdicts() if v.technique == "loss_chunk"]
    return {
        "xla": report.xla,
        "seconds": time.perf_counter() - start,
        **({"verdict": dataclasses.asdict(verdict[0])} if verdict else {}),
    }


def run(names: list[str]) -> dict:
    rows = []
    for name in names:
        model, batch, seq, flags, quoted = CASES[name]
        plan = plan_from_argv(flags)
        chunk = batch * seq // plan.microbatches // 4
        row = {"case": name, "model": model, "batch_size": batch, "seq_len": seq,
               "argv": flags, "quoted": quoted, "loss_chunk": chunk}  # fmt: skip
        row["as_quoted"] = compiled(model, batch, seq, plan)
        row["chunked"] = compiled(model, batch, seq, dataclasses.replace(plan, loss_chunk=chunk))
        print(f"{name}: {row['as_quoted']['xla']['total_bytes'] / GIB:.3f} -> "
              f"{row['chunked']['xla']['total_bytes'] / GIB:.3f} GiB")  # fmt: skip
        rows.append(row)
    return {**metadata(__file__, None), "rows": rows}


def to_markdown(result: dict) -> str:
    lines = [
        f"# The LM head's logits in chunks ({result['backend']}, compile-only, commit "
        f"{result['commit']})",
        "",
        "XLA's compiled total of each plan's step as quoted and with `--loss-chunk C` (a quarter "
        "of a microbatch's tokens): GiB, and the change in MiB.",
        "",
        "| case | model, tokens | plan (flags) | C | as quoted GiB | chunked GiB | change MiB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        a, b = (row[k]["xla"]["total_bytes"] for k in ("as_quoted", "chunked"))
        flags = " ".join(row["argv"]) or "(none)"
        lines.append(
            f"| {row['case']} | {row['model']}, {row['batch_size']} x {row['seq_len']} | "
            f"`{flags}` | {row['loss_chunk']} | {a / GIB:.3f} | {b / GIB:.3f} | "
            f"{(b - a) / 2**20:+.1f} |"
        )
    lines += ["", f"`{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    for offset, key, label in ((-0.2, "as_quoted", "as quoted"), (0.2, "chunked", "loss chunk")):
        ax.bar([x + offset for x in xs], [r[key]["xla"]["total_bytes"] / GIB for r in rows],
               width=0.4, label=label)  # fmt: skip
    ax.set_xticks(list(xs), [r["case"] for r in rows])
    ax.set_ylabel("XLA compiled total (GiB)")
    ax.set_yscale("log")
    ax.set_title(f"LM head logits in chunks ({result['backend']}, compile-only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {list(CASES)}")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    names = selected_configs(parser, args.cases, CASES, "1b-baseline")
    result = run(names)
    write(os.path.join(args.out_dir, f"loss_chunk_{jax.default_backend()}"), result,
          to_markdown, plot)  # fmt: skip


if __name__ == "__main__":
    main()
