"""``lowmem analyze``: one configuration's compiled memory figures next to the analytic
breakdown, its FLOPs, and whether each technique of its plan took effect."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from lowmem_jax.compose.flags import plan_or_plain
from lowmem_jax.core.units import MIB


def cmd_analyze(args: argparse.Namespace) -> int:
    from lowmem_jax.workloads.builder import analyze_model, build
    from lowmem_jax.workloads.registry import workload

    plan = plan_or_plain(args)
    found = []
    if plan is None:
        report = analyze_model(args.model, args.batch_size, None, seq_len=args.seq_len)
    else:
        setup = build(workload(args.model, args.batch_size, seq_len=args.seq_len), plan)
        report, found = setup.analyze(), setup.verdicts()
    result = {"model": args.model, "batch_size": report.config["batch_size"], **report.to_dict()}
    result["verdicts"] = [dataclasses.asdict(v) for v in found]
    one = None if plan is None else plan.on_one_device()
    if one is not None and one != plan:  # the one-device step, for comparison
        single = analyze_model(args.model, args.batch_size, one, seq_len=args.seq_len).xla
        result["single_device"] = {"xla": single}
        result["xla_vs_single_device"] = {
            k: result["xla"][k] / single[k] for k in ("argument_bytes", "total_bytes")
        }
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    x, a = result["xla"], result["analytic"]
    print(
        f"{args.model}, batch {result['batch_size']}, {result['param_count']:,} parameters, "
        f"backend {result['backend']}; plan {result['config']}"
    )
    print(
        f"  {x['source']:>9}: argument {x['argument_bytes'] / MIB:9.2f} MiB  "
        f"output {x['output_bytes'] / MIB:9.2f}  alias {x['alias_bytes'] / MIB:9.2f}  "
        f"temp {x['temp_bytes'] / MIB:9.2f}  total {x['total_bytes'] / MIB:9.2f}"
    )
    if "single_device" in result:
        one, ratio = result["single_device"]["xla"], result["xla_vs_single_device"]
        print(
            f"  per device of {result['config']['mesh_devices']}; one "
            f"device: argument {one['argument_bytes'] / MIB:.2f} MiB, total "
            f"{one['total_bytes'] / MIB:.2f} MiB (x{ratio['argument_bytes']:.3f}, "
            f"x{ratio['total_bytes']:.3f})"
        )
    if "collectives" in x:
        sent = x["collectives"]
        kinds = ", ".join(
            f"{kind} x{row['count']} ({row['bytes'] / MIB:.2f} MiB)"
            for kind, row in sent["by_kind"].items()
        )
        print(
            f"  collectives: {kinds}; each device sends {sent['sent_bytes'] / MIB:.2f} MiB per "
            "step (ring schedule; counted in the compiled program)"
        )
    print(
        f"   analytic: model {a['model_bytes'] / MIB:9.2f} MiB  optimizer "
        f"{a['optimizer_bytes'] / MIB:9.2f}  activations {a['activation_bytes'] / MIB:9.2f}  "
        f"dense weights {a['dense_weight_bytes'] / MIB:7.2f}  inputs {a['input_bytes'] / MIB:7.2f}"
        f"  total {a['total_bytes'] / MIB:9.2f}"
    )
    if x["host_bytes"] or a["host_resident_bytes"]:
        host = x["host_bytes"] or {}
        print(
            f"       host: {a['host_resident_bytes'] / MIB:.2f} MiB of the state kept in host "
            f"memory (analytic); {x['source']} host argument "
            f"{host.get('argument', 0) / MIB:.2f} MiB, temp {host.get('temp', 0) / MIB:.2f}"
            + ("" if host else " (one memory space: counted in the device figures above)")
        )
    print(
        f"      FLOPs: {result['flops']:.4g} per step (jaxpr; XLA cost analysis: "
        f"{result['flops_xla'] or 0:.4g}, loop bodies counted once)"
    )
    for v in found:
        said = "took effect" if v.took_effect else "NO EFFECT"
        print(f"  {v.technique:>15}: {said}: {v.evidence}")
        if not v.took_effect:
            warning = f"{v.technique} took no effect: {v.evidence}"
            print(f"lowmem analyze: warning: {warning}", file=sys.stderr)
    return 0
