"""The technique flags of ``lowmem analyze`` / ``lowmem train``: one flag per :class:`Plan` field
declared with a help text, each registered technique's own flags
(:data:`lowmem_jax.techniques.TECHNIQUES`), the plan they give (:func:`plan_from_args`), and
back (:func:`plan_argv`; a whole command: :func:`lowmem_jax.workloads.flags.analyze_argv`)."""

from __future__ import annotations

import argparse
import dataclasses

from lowmem_jax.compose.plan import Plan
from lowmem_jax.techniques import TECHNIQUES

__all__ = [
    "add_plan_flags",
    "plan_from_args",
    "plan_argv",
    "plan_from_argv",
    "plan_or_plain",
    "given_technique_flags",
]


def add_plan_flags(parser: argparse.ArgumentParser, base: Plan) -> None:
    """A flag per technique field of :class:`Plan` (its help and choices), then each
    technique's own flags (:attr:`Technique.flags`), in the registry's order."""
    group = parser.add_argument_group("techniques (composed into one jitted train step)")
    for field in Plan.flag_fields():
        default = getattr(base, field.name)
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=str if isinstance(default, str) else type(default),  # a policy's text
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


def plan_argv(plan: Plan) -> list[str]:
    """The technique flags that give ``plan`` from the defaults: each where it differs from the
    flag's default, then each technique's own (:attr:`Technique.flags`)."""
    argv: list[str] = []
    default = Plan()
    for field in Plan.flag_fields():
        if getattr(plan, field.name) != getattr(default, field.name):
            argv += ["--" + field.name.replace("_", "-"), str(getattr(plan, field.name))]
    for technique in TECHNIQUES:
        if technique.flags is not None:
            argv += technique.flags.argv(plan)
    return argv


def plan_from_argv(argv: list[str]) -> Plan:
    """The plan the technique flags in ``argv`` give from the defaults (other arguments, such
    as ``--model``, ignored): :func:`plan_argv`'s inverse.

    Raises:
      ValueError: a flag's value out of range, naming the flag."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_plan_flags(parser, Plan())
    args, _ = parser.parse_known_args(argv)
    return plan_from_args(args, Plan())


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
