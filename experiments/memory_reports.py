"""The full-size memory reports every RQ reads: one per benchmark model, made by ``lowmem report``.

``wrn-28-2`` at batch 128 (CIFAR shapes) and ``dynamicconv-iwslt`` at 100 sentences x 40 tokens
(4,000 tokens, the recipe's batch). :func:`load_or_run_report` reads
``experiments/results/<dir>/report.json`` when it exists (committed) and otherwise runs the
compile-only analysis and writes it, exactly as the ``lowmem report`` command in ``COMMANDS``.
"""

from __future__ import annotations

import json
import os

from lowmem_jax.report.run import run_report, write_report

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# model -> (batch size, sequence length, results folder, device counts of the sharding section:
# those of 2, 4, 8 that divide the batch, as `lowmem report --shard-devices auto`)
MODELS = {
    "wrn-28-2": (128, 40, "memory_report", (2, 4, 8)),
    "dynamicconv-iwslt": (100, 40, "memory_report_dynamicconv", (2, 4)),
}


def command(model: str) -> str:
    batch, seq_len, folder, devices = MODELS[model]
    extra = f" --seq-len {seq_len}" if model.startswith("dynamicconv") else ""
    return (
        f"lowmem report --model {model} --batch-size {batch} "
        f"--out-dir experiments/results/{folder}{extra} "
        f"--shard-devices {','.join(map(str, devices)) or 'none'} --grid full"
    )


def load_or_run_report(model: str, refresh: bool | list[str] = False) -> dict:
    """The memory report of ``model`` (see the module docstring).

    ``refresh``: ``True`` analyses every row again; a list of row names analyses those again and
    keeps the other rows of the committed report (``"sharding"`` names the sharding section).
    Analysing the sharding section needs its device count before JAX starts
    (:func:`lowmem_jax.core.mesh.set_cpu_devices`).
    """
    if model not in MODELS:
        raise ValueError(f"Unknown model={model!r}; allowed values: {list(MODELS)}")
    batch, seq_len, folder, devices = MODELS[model]
    path = os.path.join(RESULTS, folder, "report.json")
    reuse, sharding = None, None
    if os.path.exists(path) and refresh is not True:
        with open(path) as f:
            previous = json.load(f)
        if not refresh:
            return previous
        reuse = {r["name"]: r for r in previous["configs"] if r["name"] not in refresh}
        sharding = None if "sharding" in refresh else previous.get("sharding")
    sections = {"sharding": () if sharding is not None else devices}
    result = run_report(model, batch, seq_len=seq_len, reuse=reuse, sections=sections)
    if sharding is not None:
        result["sharding"] = sharding
    write_report(result, os.path.dirname(path), command=command(model))
    return result
