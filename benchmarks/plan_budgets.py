"""`lowmem plan` at several budgets, each as a user runs it: one fresh process per budget.

    python benchmarks/plan_budgets.py --model wrn-28-2 --batch-size 128 \\
        --budgets 320MiB 128MiB 32MiB --out-dir benchmarks/results
    python benchmarks/plan_budgets.py --budgets 128MiB --objective time   # stems get _time
    python benchmarks/plan_budgets.py --budgets 24MiB --devices 4   # per device; stems get _d4

Writes ``plan_<model>_b<B>_<budget>_<backend>.{json,png}`` (the command's ``--json`` output and
``--plot``) and ``plan_<model>_b<B>_<backend>.md``: per budget the answer's flags, its compiled
total, the analytic count, the FLOPs overhead, the plans compiled and the wall time of the
command (no compilation cache: ``--cache-dir ''``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax

from lowmem_jax.core.provenance import source_commit

MIB = 2.0**20


def run_budget(
    model: str,
    batch: int,
    budget: str,
    envelope: str,
    objective: str,
    out: str,
    devices: int = 1,
    seq_len: int | None = None,
) -> dict:
    """One `lowmem plan` process; its JSON with the wall time added."""
    cmd = [sys.executable, "-m", "lowmem_jax.cli", "plan", "--model", model,
           "--batch-size", str(batch), "--budget", budget, "--envelope", envelope,
           "--objective", objective, "--cache-dir", "", "--json",
           "--plot", f"{out}.png"]  # fmt: skip
    if devices > 1:
        cmd += ["--devices", str(devices)]
    if seq_len is not None:
        cmd += ["--seq-len", str(seq_len)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    refusals = ("no plan in the", "is below what the step's arguments alone take")
    if done.returncode == 2 and any(r in done.stderr for r in refusals):  # kept: the floor
        result = {"no_plan_fits": done.stderr.strip().splitlines()[-1].split("error: ", 1)[-1]}
    else:
        done.check_returncode()
        result = json.loads(done.stdout)
    result["wall_seconds"] = wall
    result["command"] = "lowmem " + " ".join(cmd[3:])
    with open(f"{out}.json", "w") as f:
        json.dump(result, f, indent=1)
    return result


def table(
    model: str,
    batch: int,
    results: dict[str, dict],
    backend: str,
    objective: str,
    at: str,
    devices: int = 1,
    seq_len: int | None = None,
    envelope: str = "report",
) -> str:
    source = f"XLA:{backend.upper()}"
    timed = objective == "time"
    over = f" --devices {devices}" if devices > 1 else ""
    over += f" --seq-len {seq_len}" if seq_len is not None else ""
    over += f" --envelope {envelope}" if envelope != "report" else ""
    each = f", budgets and bytes per device over {devices} host devices" if devices > 1 else ""
    lines = [
        f"# `lowmem plan --objective {objective}{over}` on {model}, batch {batch} ({source}{each})",
        "",
        f"Command: `python benchmarks/plan_budgets.py --model {model} --batch-size {batch} "
        f"--budgets {' '.join(results)}{' --objective time' if timed else ''}{over}` "
        "(one `lowmem plan --json` process per budget, no "
        f"compilation cache; at commit {at}; wall time of the process on this machine, "
        f"{os.cpu_count()} CPU cores). The JSON "
        "next to this file lists every plan considered with its verdict; the PNG plots those "
        "compiled.",
        "",
        f"| budget | answer (`lowmem analyze` flags) | {source} MiB | analytic MiB | "
        f"FLOPs / fp32 step | compiles | wall s |{' step ms (others timed) |' if timed else ''}",
        f"|---|---|---:|---:|---:|---:|---:|{'---|' if timed else ''}",
    ]
    for budget, r in results.items():
        if "no_plan_fits" in r:
            lines.append(f"| {budget} | {r['no_plan_fits']} | - | - | - | - | "
                         f"{r['wall_seconds']:.0f} |" + (" - |" if timed else ""))  # fmt: skip
            continue
        flags = " ".join(r["argv"][4:]) or "(no technique)"
        compiles = sum(c["xla_total_bytes"] is not None for c in r["considered"])
        lines.append(
            f"| {budget} | `{flags}` | {r['xla']['total_bytes'] / MIB:.1f} | "
            f"{r['analytic_total_bytes'] / MIB:.1f} | {r['flops_overhead']:.3f} | {compiles} | "
            f"{r['wall_seconds']:.0f} |" + (f" {_timings(r)} |" if timed else "")
        )
    return "\n".join(lines) + "\n"


def _timings(result: dict) -> str:
    """The answer's median step time, then the other timed plans' (ms)."""
    others = [c["step_seconds"] for c in result["considered"]
              if "step_seconds" in c and c["verdict"] != "chosen"]  # fmt: skip
    rest = ", ".join(f"{1e3 * t:.0f}" for t in others)
    return f"{1e3 * result['step_seconds']:.0f}" + (f" ({rest})" if rest else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wrn-28-2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--budgets", nargs="+", default=["320MiB", "128MiB", "32MiB"])
    parser.add_argument("--envelope", default="report")
    parser.add_argument("--objective", default="flops", choices=("flops", "time"))
    parser.add_argument("--devices", type=int, default=1, help="plan over N devices")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (sequence models)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    backend = jax.default_backend()
    suffix = "_time" if args.objective == "time" else ""
    suffix += f"_d{args.devices}" if args.devices > 1 else ""
    suffix += f"_s{args.seq_len}" if args.seq_len is not None else ""
    suffix += f"_{args.envelope}" if args.envelope != "report" else ""
    stem = os.path.join(args.out_dir, f"plan_{args.model}_b{args.batch_size}{suffix}")
    at = source_commit()  # before this run rewrites committed results
    results = {}
    for budget in args.budgets:
        results[budget] = run_budget(args.model, args.batch_size, budget, args.envelope,
                                     args.objective, f"{stem}_{budget}_{backend}",
                                     args.devices, args.seq_len)  # fmt: skip
        answer = results[budget].get("no_plan_fits") or " ".join(results[budget]["argv"][4:])
        print(f"{budget}: {answer} ({results[budget]['wall_seconds']:.0f} s)", flush=True)
    with open(f"{stem}_{backend}.md", "w") as f:
        f.write(table(args.model, args.batch_size, results, backend, args.objective, at,
                      args.devices, args.seq_len, args.envelope))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
