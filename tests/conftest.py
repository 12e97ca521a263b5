"""Shared test helpers: tiny Flax nets, batches, tree comparisons and cheap-compile options.

pytest puts ``tests/`` on ``sys.path`` (no package), so test modules import these with
``from conftest import ...``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import settings

from lowmem_jax.codecs.quantization import Quantized
from lowmem_jax.ops import Conv
from lowmem_jax.training.metrics_writer import read_jsonl, read_scalars

# XLA:CPU's code generation dominates the suite's time (half of it went to compiling, a quarter
# to tracing and lowering); these options make it cheaper. Set for every compile of the suite,
# CLI subprocesses included (XLA reads XLA_FLAGS when the backend starts, after these imports).
# - LLVM at optimisation level 0 without its expensive passes changes no HLO-level semantics or
#   buffer assignment; compile-bound tests take 25-45% less time, training-bound ones up to 1.8x
#   more (unoptimised loops; those tests ask for OPTIMIZED).
# - XLA:CPU's older loop emitters instead of its MLIR fusion emitters (a WRN-16-1 train step's
#   compile here: 4.0 -> 1.9 s, same bytes): the whole suite, 2 workers, cold, 35m41s -> 20m14s on
#   this 2-core machine (2026-11-28, benchmarks/results/suite_durations_cold.md). This one does
#   change code generation: fusion choices, so temp bytes (`lowmem report`'s quick grid, this
#   machine: 8 of 13 rows to the byte, the other 5 with 0.0002-15% more temp, most on the smallest
#   rows) and float32 roundoff. Tests assert relations and float32 tolerances, and the suite passed
#   under both (the fusion emitters at d9f0575); committed figures come from commands under XLA's
#   own defaults. Before changing how the library lowers memory, run the suite once with
#   LOWMEM_TEST_FUSION_EMITTERS=1, which keeps the fusion emitters (the old time, 35 minutes).
# - One LLVM module per program instead of several compiled on parallel threads: the two workers
#   already keep both cores busy, so splitting only adds work (one compile's CPU here: WRN-16-2
#   3.3-3.6 -> 2.5-3.0 s, dynamicconv-small 16.7 -> 15.0 s, same buffers: the split comes after
#   buffer assignment; four test files, 2 workers, cold: 249 -> 236 s, one pair, where pairs of
#   runs differ by up to 4%). Under XLA's defaults (`lowmem report`'s DSR row) it does not help.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_parallel_codegen_split_count": 1,
}
if os.environ.get("LOWMEM_TEST_FUSION_EMITTERS") != "1":
    FAST_COMPILE["xla_cpu_use_fusion_emitters"] = False
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items())]
).strip()

# Host devices for this process, set before JAX starts its backends: one, as a user has, unless
# LOWMEM_TEST_DEVICES says more (tests/test_sharding.py runs tests/sharding_cases.py with 8 in a
# process of its own; 8 devices here would slow every other test by ~6%).
jax.config.update("jax_num_cpu_devices", int(os.environ.get("LOWMEM_TEST_DEVICES", "1")))

# One persistent compilation cache for the whole suite, in-process and for the CLI subprocesses
# (LOWMEM_CACHE_DIR): the same small models are compiled by many tests, and the classification
# task's op-by-op parameter initialisation alone compiles ~190 tiny programs (~20 s) per run.
# Executables read back are the ones compiled, so results are unchanged; nothing goes to ~/.cache.
os.environ.setdefault(
    "LOWMEM_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"lowmem-test-xla-cache-{os.getuid()}")
)
jax.config.update("jax_compilation_cache_dir", os.environ["LOWMEM_CACHE_DIR"] or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# Python's cyclic garbage collector less often, and never over what the imports built: tracing
# leaves large heaps of jaxprs, tracers and cached closures, and each full collection walks them
# all. Measured on this 2-core machine, cold caches, 2026-11-28: tests/test_planner.py +
# test_technique.py in one process 151.2 -> 128.7 s with the same peak RSS (1.09 / 1.10 GB);
# four trace-heavy files, 2 workers, two pairs: 171/168 -> 134/155 s; three compile- and
# training-bound files: 170/164 -> 150/166 s.
gc.freeze()
gc.set_threshold(50_000, 50, 1_000)

# Property tests draw the same examples on every run (derived from each test's source): a CI
# result is then reproducible, and an example that aborts XLA's compiler (seen once in CI in
# test_ops_conv.py::test_random_shapes, a crash of the worker, not a failed assertion) cannot
# appear on one run and not the next.
settings.register_profile("lowmem", derandomize=True)
settings.load_profile("lowmem")


# For a test whose time goes into running many steps rather than compiling them: LLVM at level 1
# (test_user_models' digits training here, one epoch of 44 steps: level 0 compiles in 1.6 s and
# runs in 11.4 s, level 1 4.6 s and 2.2 s, XLA's default level 3 35.6 s and 1.9 s). For the suite
# as a whole level 0 wins: four of its files took 293 s at level 0 and 430 s at level 1.
OPTIMIZED = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass (a Flax module) looks its module up there
    spec.loader.exec_module(module)
    return module


def fast_jit(fn, plan=None, **kwargs):
    """``jax.jit(fn)`` with the plan's compiler options (remat) plus :data:`FAST_COMPILE`."""
    options = {**(plan.compiler_options() if plan is not None else {}), **FAST_COMPILE}
    return jax.jit(fn, compiler_options=options, **kwargs)


def batched_lapack_calls(lowered_text: str) -> list[tuple[str, str]]:
    """``(kernel, operand shape)`` of each LAPACK custom call in a lowered program whose operand
    is a batch of matrices (rank > 2): jaxlib splits such a batch over XLA:CPU's intra-op
    threads and waits for them, and two at once deadlock a two-thread pool."""
    call = r"custom_call @(lapack_\w+)\(.*?: \(tensor<([0-9x]+)x[a-z]\w*>"
    calls = re.findall(call, lowered_text)
    return [(name, dims) for name, dims in calls if dims.count("x") >= 2]


# --- tiny models -------------------------------------------------------------------------


class MLP(nn.Module):
    """Two Dense layers with tanh: 5 -> 16 -> 3."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.tanh(nn.Dense(16)(x))
        return nn.Dense(3)(x)


class BNNet(nn.Module):
    """Dense -> BatchNorm -> ReLU -> Dense (3 classes), with a compute ``dtype``."""

    dtype: Any = None
    momentum: float = 0.99

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8, dtype=self.dtype)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum, dtype=self.dtype)(x)
        return nn.Dense(3, dtype=self.dtype)(nn.relu(x))


class TinyMLP(nn.Module):
    """Named layers for sparse training: ``hidden`` and ``hidden2`` are sparse by default,
    ``classifier`` stays dense."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(16, name="hidden")(x))
        x = nn.relu(nn.Dense(12, name="hidden2")(x))
        return nn.Dense(3, name="classifier")(x)


class TinyConvNet(nn.Module):
    """Conv (ours, loop-friendly) + BatchNorm + ReLU + pooling + Dense."""

    num_classes: int = 10
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool):
        x = Conv(8, (3, 3), dtype=self.dtype)(x)
        x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
        x = nn.relu(x).mean((1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)


#: A 1 + 1 layer, 32-channel DynamicConv Transformer (``model_overrides`` of the small preset).
TINY_TRANSLATION = {
    "embed_dim": 32,
    "ffn_dim": 64,
    "encoder_kernel_sizes": (3,),
    "decoder_kernel_sizes": (3,),
}


# --- data --------------------------------------------------------------------------------


def classification_batch(n=8, features=5, classes=3, seed=0):
    """``{"image": [n, features] float32 ~ N(0, 1), "label": [n] int32 in [0, classes)}``."""
    rng = np.random.default_rng(seed)
    return {
        "image": jnp.asarray(rng.normal(size=(n, features)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, classes, size=n), jnp.int32),
    }


def tiny_params(seed=0):
    """A parameter tree with conv, stacked, dense and classifier kernels and biases."""
    rng = np.random.default_rng(seed)

    def f(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    return {
        "conv": {"kernel": f(3, 3, 2, 4), "bias": f(4)},
        "stack": {"dense": {"kernel": f(2, 6, 5)}},
        "dense": {"kernel": f(10, 7)},
        "classifier": {"kernel": f(7, 3), "bias": f(3)},
    }


#: Inner optimizers of sparse training, each with slots that mirror the parameters.
OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "inject_sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
}


# --- assertions --------------------------------------------------------------------------


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    """Every leaf of ``a`` close to ``b``'s; a quantized leaf (``Quantized``: codes and scales)
    within one quantization step of ``b``'s: its scales close, each code the same or a neighbour
    in the sorted code book. A different reduction order (a sharded sum, another machine's
    kernels) may round a value that lies on a tie between two codes either way; that is all the
    quantizer promises."""

    def close(x, y):
        if isinstance(x, Quantized):
            assert x.meta == y.meta, (x.meta, y.meta)
            jax.tree.map(
                lambda s, t: np.testing.assert_allclose(s, t, rtol=rtol, atol=atol),
                x.scales,
                y.scales,
            )
            steps = np.abs(_codes(x).astype(np.int16) - _codes(y).astype(np.int16))
            assert steps.max(initial=0) <= 1, f"codes {int(steps.max())} steps apart"
            return
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)

    jax.tree.map(close, a, b, is_leaf=lambda x: isinstance(x, Quantized))


def assert_trees_close_to_scale(a, b, rtol=1e-4):
    """Every leaf of ``a`` within ``rtol * max|b|`` of ``b``'s, element by element: how two
    programs that compute the same float32 function (remat and not, blockwise and dense) agree.
    Their sums may round in another order, so a small element that gathers terms of the leaf's
    own size is off by roundoff of that size, not of its own; a wrong gradient is off by ~1."""

    def close(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y), initial=0.0))
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)

    jax.tree.map(close, a, b)


def _codes(q: Quantized) -> np.ndarray:
    """Code-book indices of ``q``, 4-bit codes unpacked (two per byte, low nibble first)."""
    codes = np.asarray(q.codes)
    if q.meta.bits == 4:
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(-1)
    return codes


def to_numpy(tree):
    """A host copy of ``tree`` (survives donation of the device buffers)."""
    return jax.tree.map(lambda x: np.array(x), tree)


def expected_scalars(records):
    """What TensorBoard should hold for JSON records: every number but ``step``, as float32."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, []).append((r["step"], float(np.float32(v))))
    return out


def assert_tensorboard_matches_jsonl(directory):
    """The event files in ``directory`` hold exactly the numbers of its ``metrics.jsonl``."""
    records = read_jsonl(os.path.join(directory, "metrics.jsonl"))
    assert records, "no records"
    assert read_scalars(str(directory)) == expected_scalars(records)


def unnamed_stacks(figures, tx, monkeypatch):
    """``(figures(sliced), figures(dense))`` for a compressed sparse optimizer ``tx`` not told
    which leaves are stacked: the step hands the model's loop the leaves' ``sliceable`` forms
    (no warning), or, without those, dense weights built before the model runs (a warning)."""
    from lowmem_jax.techniques.sparsity import storage

    unnamed = dataclasses.replace(tx, stacked=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sliced = figures(unnamed)
    monkeypatch.setattr(storage.CompressedLeaf, "sliceable", lambda self: None)
    with pytest.warns(UserWarning, match="densified before it runs"):
        dense = figures(unnamed)
    return sliced, dense
