"""The technique flags of ``lowmem analyze`` / ``lowmem train``: one flag per :class:`Plan` field
declared with a help text, each registered technique's own flags
(:data:`lowmem_jax.techniques.TECHNIQUES`), the plan they give (:func:`plan_from_args`), and
back (:func:`analyze_argv`: the flags of a plan, e.g. for a report row's command)."""

from __future__ import annotations

import argparse
import dataclasses
import re

from lowmem_jax.compose.plan import Plan
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.workloads.registry import MODEL_NAMES

__all__ = [
    "add_workload_flags",
    "add_plan_flags",
    "plan_from_args",
    "analyze_argv",
    "given_technique_flags",
]


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="wrn-28-2", help=f"{MODEL_NAMES}. Default: %(default)s")

    parser.add_argument(
        "--batch-size",
        type=int,
        help="examples (sentences for dynamicconv-*) per batch. Default: 128 for wrn-D-K, 100 "
        "for dynamicconv-*",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=40,
        help="tokens per sentence for dynamicconv-* (100 x 40 = the recipe's 4,000 tokens). "
        "Default: %(default)s",
    )


def add_plan_flags(parser: argparse.ArgumentParser, base: Plan) -> None:
    """A flag per technique field of :class:`Plan` (its help and choices), then each
    technique's own flags (:attr:`Technique.flags`), in the registry's order."""
    group = parser.add_argument_group("techniques (composed into one jitted train step)")
    for field in Plan.flag_fields():
        default = getattr(base, field.name)
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(default),
            choices=field.metadata["choices"],
            help=f"{field.metadata['help']}. Default: {default}",
        )
    for technique in TECHNIQUES:
        if technique.flags is not None:
            technique.flags.add(parser, base)


def plan_from_args(args: argparse.Namespace, base: Plan) -> Plan:
    """``base`` with the technique flags given.

    Raises:
      ValueError: a flag's value out of range, naming the flag."""
    given = {f.name: getattr(args, f.name) for f in Plan.flag_fields()}
    given = {k: v for k, v in given.items() if v is not None}
    for technique in TECHNIQUES:
        if technique.flags is not None:
            given.update(technique.flags.fields(args))
    return dataclasses.replace(base, **given)


def analyze_argv(model: str, batch_size: int, plan: Plan | None, seq_len: int = 40) -> list[str]:
    """The ``lowmem analyze`` arguments that analyse ``plan`` (``None``: ``--plain``).

    Technique flags are given where they differ from the flag's default. The result is checked
    by parsing it back: the plan it gives must equal ``plan``.

    Raises:
      ValueError: a plan with a setting no flag expresses (e.g. a sparsity ``seed``).
    """
    argv = ["--model", model, "--batch-size", str(batch_size)]
    if model.startswith("dynamicconv"):
        argv += ["--seq-len", str(seq_len)]
    if plan is None:
        return [*argv, "--plain"]
    default = Plan()
    for field in Plan.flag_fields():
        if getattr(plan, field.name) != getattr(default, field.name):
            argv += ["--" + field.name.replace("_", "-"), str(getattr(plan, field.name))]
    for technique in TECHNIQUES:
        if technique.flags is not None:
            argv += technique.flags.argv(plan)
    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    add_plan_flags(parser, Plan())
    args = parser.parse_args(argv)
    if plan_from_args(args, Plan()) != plan:
        raise ValueError(f"lowmem analyze has no flags for every setting of {plan}")
    return argv


def plan_or_plain(args: argparse.Namespace) -> Plan | None:
    """The plan the flags give, or ``None`` for ``--plain`` (the step without any technique).

    Raises:
      ValueError: ``--plain`` with a technique flag.
    """
    plan = plan_from_args(args, Plan())
    if not args.plain:
        return plan
    given = given_technique_flags(args)
    if given:
        raise ValueError(
            f"--plain is the step without any technique; it takes no {', '.join(given)}"
        )
    return None


def given_technique_flags(args: argparse.Namespace) -> list[str]:
    """The technique flags given on the command line (those not left at their default)."""
    given = [f"--{f.name.replace('_', '-')}" for f in Plan.flag_fields()
             if getattr(args, f.name) is not None]  # fmt: skip
    for technique in TECHNIQUES:
        if technique.flags is not None:
            given += technique.flags.given(args)
    return given


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"48MiB"``, ``"1.5 GiB"``, ``"500MB"``, ``"1024"`` (bytes) -> bytes.

    Raises:
      ValueError: anything else, naming the units allowed.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"budget {text!r} is not a positive size; give a number and a unit, one of "
            "B, KiB, MiB, GiB, KB, MB, GB (e.g. 48MiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])
