"""The ``lowmem`` command line: flags -> a config or a plan -> one library call.

``lowmem analyze``: compile-only memory analysis of one configuration (``--json`` for machines).
``lowmem report``: the standard grid of configurations, as a table, JSON, markdown and plots.
``lowmem plan``: the plan with the fewest FLOPs (or the fastest step) whose compiled step fits
a byte budget.
``lowmem inspect``: the buffers live at the peak of one configuration's step, their source lines,
and with ``--compare`` what a second plan removed or added.
``lowmem train``: train a registered model on a dataset (nothing is downloaded) with any
combination of the techniques.

Defaults live in the library (:class:`lowmem_jax.Plan`,
:class:`lowmem_jax.training.loop.TrainConfig`, the model's recipe); a flag left out keeps them.

Errors a user can fix (a bad flag or value, missing data, a bad directory, no checkpoint to
resume) print one line, ``lowmem <command>: error: ...``, and exit with status 2; a run stopped
for making no progress (:class:`~lowmem_jax.training.skip_guard.NoProgressError`) prints one line
and exits with status 1. ``--debug`` shows the traceback instead (and the absl warnings of TFDS and
Orbax, hidden otherwise). Warnings from lowmem_jax print as ``lowmem <command>: warning: ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import warnings

from lowmem_jax.cli import analyze as cli_analyze
from lowmem_jax.cli import inspect as cli_inspect
from lowmem_jax.cli.train import add_train_flags, cmd_train
from lowmem_jax.compose.flags import add_plan_flags
from lowmem_jax.compose.plan import Plan
from lowmem_jax.core import paths
from lowmem_jax.core.units import MIB
from lowmem_jax.report.grid import GRIDS
from lowmem_jax.techniques import TECHNIQUES, report_sections
from lowmem_jax.workloads.flags import add_workload_flags


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line: ``prog: error: message`` (the usage of ``train`` alone is ~30
    lines; ``--help`` prints it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _default_cache_dir() -> str:
    if "LOWMEM_CACHE_DIR" in os.environ:
        return os.environ["LOWMEM_CACHE_DIR"]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache_home, "lowmem_jax", "xla")


def _use_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir`` (``""``: none): a step compiled
    once is read back by later runs (compile-only analysis gives the same figures from it).

    Raises:
      NotADirectoryError, PermissionError: ``cache_dir`` cannot hold the cache (checked like
        ``--checkpoint-dir``, before anything is built).
    """
    if not cache_dir:
        return
    paths.ensure_directory(cache_dir, "--cache-dir")  # else JAX warns and runs without a cache
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Every compile, however short: op-by-op parameter initialisation compiles ~200 tiny programs.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _use_host_devices(args: argparse.Namespace) -> None:
    """The host devices the flags ask for (the techniques': e.g. ``--devices N`` with
    ``--shard``, ``lowmem report --shard-devices``; the planner's: ``--devices N`` with
    ``lowmem plan`` or ``--memory-budget``), asked of XLA:CPU before JAX starts."""
    for technique in TECHNIQUES:
        if technique.layout.host_devices is not None:
            technique.layout.host_devices(args)
    planned = args.command == "plan" or getattr(args, "memory_budget", None) is not None
    if planned and (getattr(args, "devices", None) or 1) > 1:
        from lowmem_jax.core.mesh import set_cpu_devices

        set_cpu_devices(args.devices, require=False)  # the planner checks what JAX then sees


def _cmd_report(args: argparse.Namespace) -> int:
    from lowmem_jax.report.grid import model_grid
    from lowmem_jax.report.run import run_report, to_markdown, write_report
    from lowmem_jax.workloads.registry import default_seq_len, takes_seq_len, workload

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    batch_size = workload(args.model, args.batch_size, seq_len=args.seq_len).batch_size
    paths.ensure_directory(args.out_dir, "--out-dir")
    print(f"lowmem report: {args.model}, batch {batch_size} (compile-only, no step runs)")
    sections = {key: s.setting(args, batch_size) for key, s in report_sections().items()}
    grid = model_grid(args.model, batch_size, args.grid)
    result = run_report(
        args.model,
        batch_size,
        grid,
        seq_len=args.seq_len,
        sections=sections,
        jobs=args.jobs,
    )
    command = "lowmem report " + " ".join(
        [f"--model {args.model}", f"--batch-size {batch_size}", f"--out-dir {args.out_dir}"]
        + (
            [f"--seq-len {args.seq_len or default_seq_len(args.model)}"]
            if takes_seq_len(args.model)
            else []
        )
        + [" ".join(s.argv(sections[key])) for key, s in report_sections().items()]
        + [f"--grid {args.grid}"]
    )
    written = write_report(result, args.out_dir, command=command)
    print(to_markdown(result))
    print("wrote " + ", ".join(written))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from lowmem_jax.core.units import parse_bytes
    from lowmem_jax.planning.planner import plan_for_model

    budget = parse_bytes(args.budget)
    if args.plot:
        paths.check_writable_file(args.plot, "--plot")
    # With --json the search's log goes to stderr (stdout holds exactly one JSON object)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    over = f" per device over {args.devices} devices" if args.devices > 1 else ""
    log(f"lowmem plan: {args.model}, budget {budget / MIB:.1f} MiB{over}, envelope {args.envelope}")
    result = plan_for_model(args.model, args.batch_size, budget, envelope=args.envelope,
                            seq_len=args.seq_len, objective=args.objective, devices=args.devices,
                            log=log)  # fmt: skip
    if args.plot:
        from lowmem_jax.planning.plot import plot_considered

        plot_considered(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
        return 0
    x = result.xla
    print(
        f"plan: lowmem analyze {shlex.join(result.argv)}\n"
        f"  {x['source']} total {x['total_bytes'] / MIB:.1f} MiB{over and ' per device'} "
        f"(budget {budget / MIB:.1f}), "
        f"analytic {result.analytic_total_bytes / MIB:.1f} MiB, FLOPs {result.flops:.4g} "
        f"({result.flops_overhead:.3f} of the fp32 step), {result.seconds:.0f} s"
    )
    if result.step_seconds is not None:
        print(f"  step {result.step_seconds * 1e3:.0f} ms here (the fastest of those timed)")
    return 0


_COMMANDS = {
    "analyze": (
        "compile-only memory analysis of one configuration",
        "Lower and compile one train step for abstract inputs (nothing runs, no data) and report "
        "XLA's memory figures next to the analytic model / optimizer / activation breakdown.",
    ),
    "report": (
        "the standard grid: baseline, each technique, combinations (tables and plots)",
        "Memory analysis of the baseline, each technique alone at several settings and "
        "combinations; prints a table and writes report.json, report.md, breakdown.png and "
        "tradeoff.png.",
    ),
    "plan": (
        "the plan with the fewest FLOPs whose compiled step fits a memory budget",
        "Search the technique combinations inside an accuracy envelope for the one whose "
        "compiled train step fits --budget with the fewest FLOPs (recomputation counted), or "
        "with --objective time the fastest measured step; candidates are predicted analytically "
        "and verified by compiling (with flops nothing runs). Prints "
        "the answer, its lowmem analyze flags and what else was considered.",
    ),
    "inspect": cli_inspect.SUMMARY,
    "train": (
        "train a model with a combination of low-memory techniques",
        "Train a registered model: a WideResNet on the scikit-learn digits (1,797 8x8 images "
        "upsampled to 32x32; ships with scikit-learn, nothing is downloaded) or on CIFAR-10, or "
        "the DynamicConv Transformer on a synthetic task, IWSLT'14 or TED, the last three "
        "prepared once with tensorflow-datasets (see docs/datasets.md). WRN recipe on CIFAR-10: "
        "--dataset cifar10 --model wrn-28-2 --epochs 200 --lr-schedule step --precision fp32 "
        "--microbatches 1 --remat none.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lowmem", description="How much memory does training take, and how to make it fit."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    for name, (summary, description) in _COMMANDS.items():
        commands[name] = sub.add_parser(name, help=summary, description=description)
        commands[name].set_defaults(parser=commands[name])
        commands[name].add_argument(
            "--debug", action="store_true", help="show the traceback of an error"
        )
        commands[name].add_argument(
            "--cache-dir",
            default=_default_cache_dir(),
            metavar="DIR",
            help="JAX's persistent compilation cache: a later run reads what an earlier one "
            "compiled instead of compiling again; '' for none. Default: $LOWMEM_CACHE_DIR, else "
            "%(default)s",
        )

    analyze = commands["analyze"]
    add_workload_flags(analyze)
    add_plan_flags(analyze, Plan())
    analyze.add_argument(
        "--plain",
        action="store_true",
        help="the baseline a Flax/Optax user writes: jax.grad + the optax update, float32, the "
        "model unrolled with XLA's convolution, no technique (no technique flags)",
    )
    analyze.add_argument("--json", action="store_true", help="print exactly one JSON object")
    analyze.set_defaults(func=cli_analyze.cmd_analyze)

    report = commands["report"]
    add_workload_flags(report)
    report.add_argument("--out-dir", default="lowmem_report", help="Default: %(default)s")
    report.add_argument(
        "--grid",
        choices=GRIDS,
        default="quick",
        help="quick: the plain step, the baseline, each technique alone and the combined rows "
        "the headline comes from (about a quarter of the compiles); full: every row of the "
        "study (the committed reports). Default: %(default)s",
    )
    report.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="XLA compiles at once, in threads, while one more configuration is traced (on 2 "
        "cores two compiles at once took 269 s where one took 254 s: XLA:CPU's compiler already "
        "uses both; more may pay on a larger machine). Default: %(default)s",
    )
    for section in report_sections().values():
        section.add_flag(report)
    report.set_defaults(func=_cmd_report)

    plan = commands["plan"]
    add_workload_flags(plan)
    plan.add_argument(
        "--budget",
        required=True,
        help="bytes the compiled step may take (XLA's total: arguments + outputs + temps - "
        "aliased), e.g. 48MiB, 1.5GiB",
    )
    plan.add_argument(
        "--envelope",
        default="report",
        choices=("report", "any"),
        help="report: the settings the technical report found safe for accuracy "
        "(lowmem_jax.planning.envelope); any: every setting. Default: %(default)s",
    )
    plan.add_argument(
        "--objective",
        default="flops",
        choices=("flops", "time"),
        help="flops: the fewest FLOPs (counted from the jaxpr, recomputation included; nothing "
        "runs); time: the fastest measured step of the first plan that fits in each of the 3 "
        "cheapest classes, each over 0.5%% costlier in FLOPs than the last (runs each a few "
        "times here). Default: %(default)s",
    )
    plan.add_argument(
        "--devices",
        type=int,
        default=1,
        help="plan for N devices, the budget per device: ZeRO's stages and a pipeline's "
        "stages (the rest data-parallel) are searched too, each plan compiled over all N (on "
        "CPU, N host devices). Default: %(default)s",
    )
    plan.add_argument(
        "--json", action="store_true", help="print exactly one JSON object (the log on stderr)"
    )
    plan.add_argument(
        "--plot", metavar="PATH", help="write a PNG of the plans compiled: bytes vs FLOPs"
    )
    plan.set_defaults(func=_cmd_plan)

    inspect = commands["inspect"]
    add_workload_flags(inspect)
    add_plan_flags(inspect, Plan())
    inspect.add_argument("--plain", action="store_true", help="the plain Flax/Optax step")
    cli_inspect.add_inspect_flags(inspect)
    inspect.set_defaults(func=cli_inspect.cmd_inspect)

    add_train_flags(commands["train"])
    commands["train"].set_defaults(func=cmd_train)
    return parser


def _where_to_resume(args: argparse.Namespace) -> str:
    """After Ctrl-C: the newest complete checkpoint and how to continue from it (checkpoints
    are written whole or not at all, so the newest listed is good)."""
    from lowmem_jax.training.checkpointing import checkpoint_steps

    directory = getattr(args, "checkpoint_dir", None)
    if not directory:
        return ""
    steps = checkpoint_steps(directory)
    if not steps:
        return f"; no checkpoint was saved in {directory}"
    again = "" if getattr(args, "resume", False) else " with --resume"
    return (
        f"; the newest checkpoint is step {steps[-1]} in {directory}: run the same command"
        f"{again} to continue"
    )


def _values_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with a value that starts with ``-`` joined to its option (``--budget -5MiB`` ->
    ``--budget=-5MiB``), so that the option's own check names what is wrong with it, where
    argparse would take the value for an option and say "expected one argument"."""
    takes_value, options = set(), set()
    todo = [parser]
    while todo:
        current = todo.pop()
        for action in current._actions:
            options.update(action.option_strings)
            if action.option_strings and action.nargs is None:
                takes_value.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    out = list(argv)
    i = 0
    while i < len(out) - 1:
        value = out[i + 1]
        if out[i] in takes_value and value.startswith("-") and value.split("=")[0] not in options:
            out[i : i + 2] = [f"{out[i]}={value}"]
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs one command; user errors exit 2, a stalled run 1 and Ctrl-C 130, each with one
    line."""
    from lowmem_jax.training.checkpointing import CheckpointError
    from lowmem_jax.training.skip_guard import NoProgressError

    parser = build_parser()
    args = parser.parse_args(_values_joined(parser, sys.argv[1:] if argv is None else argv))
    prog = args.parser.prog
    default_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "lowmem_jax" not in str(filename):  # other libraries' warnings keep their format
            return default_showwarning(message, category, filename, lineno, file, line)
        print(f"{prog}: warning: {_one_line(message)}", file=file or sys.stderr)

    warnings.showwarning = showwarning
    if not args.debug:  # TFDS' and Orbax's absl warnings restate what our one line says
        logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        _use_compilation_cache(args.cache_dir)
        _use_host_devices(args)
        return args.func(args)
    except NoProgressError as err:
        if args.debug:
            raise
        args.parser.exit(1, f"{prog}: error: {_one_line(err)}\n")
    except (ValueError, OSError, CheckpointError) as err:
        if args.debug:
            raise
        args.parser.error(_one_line(err))
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{prog}: interrupted{_where_to_resume(args)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # The loop has closed its checkpoints and records; an interpreter shutdown would let
        # Orbax's interrupted background futures print tracebacks after the one line.
        os._exit(130)
    finally:
        warnings.showwarning = default_showwarning
