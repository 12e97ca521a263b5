"""``lowmem inspect``: the buffers live at the peak of one configuration's compiled step
(:mod:`lowmem_jax.analysis.inspector`), and with ``--compare`` what a second plan removed or
added."""

from __future__ import annotations

import argparse
import json
import shlex

from lowmem_jax.compose.flags import add_plan_flags, plan_from_args, plan_or_plain
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core.units import MIB

SUMMARY = (
    "the buffers live at the peak of a compiled step, their source lines, and what a plan removed",
    "Compile one train step with XLA's dumps (nothing runs, no data) and list every buffer live "
    "at the peak: bytes, shape, category (parameter, optimizer state, batch, saved residual, "
    "gradient, workspace, output), the source line that made it; with --compare, the change a "
    "second plan makes to the peak, by category and by source line.",
)


def add_inspect_flags(parser: argparse.ArgumentParser) -> None:
    """The flags beyond ``lowmem analyze``'s (workload, plan, ``--plain``)."""
    parser.add_argument(
        "--compare",
        metavar="FLAGS",
        help="a second configuration, as the plan flags of lowmem analyze in one string (e.g. "
        "'--remat full'), or 'plain' for the plain Flax/Optax step: what it removes from or "
        "adds to the first one's peak",
    )
    parser.add_argument(
        "--top", type=int, default=15, help="buffers listed in the table. Default: %(default)s"
    )
    parser.add_argument("--png", metavar="PATH", help="write the timeline of live bytes (PNG)")
    parser.add_argument(
        "--json", action="store_true", help="print exactly one JSON object (every buffer)"
    )


def _setup(args: argparse.Namespace, plan: Plan | None):
    from lowmem_jax.workloads.builder import build, build_plain
    from lowmem_jax.workloads.registry import workload

    work = workload(args.model, args.batch_size, seq_len=args.seq_len)
    return build_plain(work) if plan is None else build(work, plan)


def _second_plan(text: str) -> Plan | None:
    """The plan ``--compare`` names (``None``: the plain step)."""
    if text.strip() == "plain":
        return None
    parser = argparse.ArgumentParser(prog="lowmem inspect --compare", add_help=False)
    add_plan_flags(parser, Plan())
    try:
        args, rest = parser.parse_known_args(shlex.split(text))
    except SystemExit:  # argparse printed its complaint
        raise ValueError(f"--compare: cannot parse {text!r} as plan flags") from None
    if rest:
        raise ValueError(f"--compare takes plan flags or 'plain'; not {rest}")
    try:
        return plan_from_args(args, Plan())
    except ValueError as err:
        raise ValueError(f"--compare: {err}") from None


def cmd_inspect(args: argparse.Namespace) -> int:
    from lowmem_jax.analysis import inspector

    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}")
    plan = plan_or_plain(args)
    second = _second_plan(args.compare) if args.compare is not None else None
    setups = [_setup(args, plan)]
    if args.compare is not None:
        setups.append(_setup(args, second))
    found = []
    for s in setups:
        try:
            found.append(inspector.inspect(s.step, s.abstract_state(), s.abstract_batch()))
        except RuntimeError as err:  # XLA's compile errors (XlaRuntimeError) among them
            raise ValueError(f"the step of {s.config} does not compile: {err}") from None
    labels = ["plain" if plan is None else str(setups[0].config)]
    if args.compare is not None:
        labels.append("plain" if second is None else str(setups[1].config))
    if args.png:
        found[0].plot(args.png, f"{args.model}, batch {setups[0].workload.batch_size}: live bytes")
    result = {"model": args.model, "inspections": [
        {"config": s.config, **f.to_dict()} for s, f in zip(setups, found, strict=True)
    ]}  # fmt: skip
    if len(found) == 2:
        result["compare"] = inspector.compare(*found)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    for label, f in zip(labels, found, strict=True):
        print(f"{args.model}, batch {setups[0].workload.batch_size}; {label}")
        print(f.table(args.top))
    if len(found) == 2:
        change = result["compare"]
        peaks = change["peak_bytes"]
        print(
            f"peak {peaks['before'] / MIB:.2f} -> {peaks['after'] / MIB:.2f} MiB; the second "
            "configuration " + "; ".join(change["sentences"])
        )
        for row in change["sources"]:
            print(f"  {row['bytes'] / MIB:+9.2f} MiB {row['buffers']:+5d} buffers  {row['key']}")
    return 0
