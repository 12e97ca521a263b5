"""A workload's flags (``--model``, ``--batch-size``, ``--seq-len``) and the whole ``lowmem
analyze`` command of a workload under a plan (:func:`analyze_argv`, e.g. for a report row)."""

from __future__ import annotations

import argparse

from lowmem_jax.compose.flags import add_plan_flags, plan_argv, plan_from_args
from lowmem_jax.compose.plan import Plan
from lowmem_jax.workloads.registry import MODEL_NAMES, default_seq_len, takes_seq_len

__all__ = ["add_workload_flags", "analyze_argv"]


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="wrn-28-2", help=f"{MODEL_NAMES}. Default: %(default)s")

    parser.add_argument(
        "--batch-size",
        type=int,
        help="examples (sentences for dynamicconv-*, sequences for llama-*) per batch. Default: "
        "128 for wrn-D-K, 100 for dynamicconv-*, 4 for llama-*",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence of dynamicconv-* and llama-*. Default: 40 for dynamicconv-* "
        "(100 x 40 = the recipe's 4,000 tokens), 1024 for llama-*",
    )


def analyze_argv(
    model: str, batch_size: int, plan: Plan | None, seq_len: int | None = None
) -> list[str]:
    """The ``lowmem analyze`` arguments that analyse ``plan`` (``None``: ``--plain``);
    ``seq_len`` of a sequence model (None: its default), always written for one.

    Technique flags are given where they differ from the flag's default. The result is checked
    by parsing it back: the plan it gives must equal ``plan``.

    Raises:
      ValueError: a plan with a setting no flag expresses (e.g. a sparsity ``seed``).
    """
    argv = ["--model", model, "--batch-size", str(batch_size)]
    if takes_seq_len(model):
        argv += ["--seq-len", str(seq_len or default_seq_len(model))]
    if plan is None:
        return [*argv, "--plain"]
    argv += plan_argv(plan)
    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    add_plan_flags(parser, Plan())
    args = parser.parse_args(argv)
    if plan_from_args(args, Plan()) != plan:
        raise ValueError(f"lowmem analyze has no flags for every setting of {plan}")
    return argv
