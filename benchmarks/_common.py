"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/<script>.py``)."""

from __future__ import annotations


def xla_memory(compiled) -> dict[str, int]:
    """XLA's compiled memory figures of ``jax.jit(f).lower(...).compile()``, in bytes.

    ``total_bytes = argument + output + temp - alias`` (donated inputs reused as outputs are
    counted once).
    """
    mem = compiled.memory_analysis()
    xla = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
    }
    xla["total_bytes"] = (
        xla["argument_bytes"] + xla["output_bytes"] + xla["temp_bytes"] - xla["alias_bytes"]
    )
    return xla
