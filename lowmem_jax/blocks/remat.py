"""Rematerialization (gradient checkpointing): named policies applied per block of a network.

A policy decides which values computed inside a block are *saved* for the backward pass; the
rest are recomputed from the block's input when the backward pass reaches the block. The result
is numerically identical to no remat; it trades extra forward FLOPs for activation memory.

Policy names (:func:`parse_policy`):

==================  ============================================================================
``none``            no remat: every residual the backward pass needs is kept (the baseline)
``full``            save only each block's input; recompute the block (``nothing_saveable``)
``dots``            save matmul and convolution outputs (``dots_saveable`` plus the ``conv_out``
                    and ``dot_out`` names the models tag), recompute the cheap elementwise ops
``save:A,B``        save only the activations tagged ``checkpoint_name(x, "A")`` / ``"B"``
``offload:A,B``     move the activations tagged ``A`` / ``B`` to host memory (``pinned_host``)
                    between forward and backward instead of recomputing them (JAX's
                    ``save_and_offload_only_these_names``); the rest is recomputed. XLA:CPU has
                    one memory space, so only a GPU / TPU shows the device bytes it saves
``every:K``         Chen et al. segments: save only the input of every K-th block; the backward
                    pass recomputes a segment of K blocks, saving their inputs, then each block
                    (``n/K + K`` block inputs live instead of ``n``; ``every:1`` == ``full``)
``sqrt``            ``every:K`` with ``K = ceil(sqrt(n))`` for a stack of ``n`` blocks
``blocks:P*K,...``  a schedule: one of ``none`` / ``dots`` / ``full`` per block, in the order the
                    model runs its blocks (``P*K``: ``K`` blocks in a row), e.g.
                    ``blocks:full*4,dots*8`` for a model of 12 blocks; what the planner's
                    dynamic program chooses (:mod:`lowmem_jax.techniques.remat.schedule`)
==================  ============================================================================

Blocks with identical shapes are stacked by :class:`~lowmem_jax.ScannedBlocks`, which stores their
parameters with a leading ``[n]`` axis and runs them with ``lax.scan``. Segmenting reshapes the
stack to ``[n // K, K]`` and nests two scans, checkpointing the outer body, so the parameter
layout does not depend on the policy: the same parameters work under every policy.

On XLA:CPU, the ``cse_barrier_expander`` pass removes the optimization barriers that keep a
recomputation separate from the forward pass, and CSE then merges the two: remat of a block
outside a loop saves nothing (measured: 8 unscanned blocks, temp 6.8 MB with and without remat).
Inside ``lax.scan`` the loop boundary keeps them apart and remat holds without help.
:func:`compiler_options` returns the per-computation option that disables that pass
(``jax.jit(f, compiler_options=...)``; the same 8 blocks: 2.9 MB); it changes no result, only
what XLA may merge, and ``make_train_step`` applies it whenever the plan uses remat on CPU.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import flax.linen as nn
import jax
from flax import nnx

from lowmem_jax.blocks import discovery as blocks_lib
from lowmem_jax.core import linen_wrap
from lowmem_jax.core.jaxprs import traced_equations

__all__ = [
    "RematSpec",
    "parse_policy",
    "POLICY_NAMES",
    "compiler_options",
    "remat_module",
    "checkpointed_call",
    "INSIDE_BLOCK",
    "tagged_names",
    "check_saved_names",
    "SCHEDULE_POLICIES",
    "schedule_name",
    "stack_policies",
]

ModuleT = TypeVar("ModuleT", nn.Module, nnx.Module)

POLICY_NAMES = (
    "none",
    "full",
    "dots",
    "save:NAME[,NAME...]",
    "offload:NAME[,NAME...]",
    "every:K",
    "sqrt",
    "blocks:P[*K][,P[*K]...]",
)

#: The policies a ``blocks:`` schedule may give a block.
SCHEDULE_POLICIES = ("none", "dots", "full")

# Names the bundled models tag with `jax.ad_checkpoint.checkpoint_name`.
CONV_OUT = "conv_out"
DOT_OUT = "dot_out"


@dataclasses.dataclass(frozen=True)
class RematSpec:
    """A parsed remat policy.

    Attributes:
      name: the policy string it was parsed from.
      policy: the ``jax.checkpoint`` policy applied per block, or ``None`` for no remat.
      segment: blocks per checkpointed segment (``0``: per block; ``-1``: ``ceil(sqrt(n))``).
      schedule: a ``blocks:`` schedule's policy name per block, expanded (``()`` otherwise; then
        ``policy`` is ``None``: each block's comes from its entry).
    """

    name: str
    policy: Callable[..., bool] | None
    segment: int = 0
    schedule: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.policy is not None or any(p != "none" for p in self.schedule)

    @property
    def saved_names(self) -> tuple[str, ...]:
        """The ``checkpoint_name`` tags a ``save:A,B`` policy saves or an ``offload:A,B``
        policy offloads (``()`` for the others)."""
        prefix = self.name.split(":", 1)[0]
        if prefix not in ("save", "offload"):
            return ()
        return tuple(n for n in self.name.split(":", 1)[1].split(",") if n)

    def segment_length(self, num_blocks: int) -> int:
        """Blocks per segment for a stack of ``num_blocks`` (1 unless segmenting)."""
        if self.segment == -1:
            return max(1, math.ceil(math.sqrt(num_blocks)))
        return max(1, min(self.segment, num_blocks))


def parse_policy(name: str | RematSpec) -> RematSpec:
    """Parses a remat policy name (see the module docstring).

    Raises:
      ValueError: naming ``remat`` and the allowed values, for an unknown or malformed name.
    """
    if isinstance(name, RematSpec):
        return name
    cp = jax.checkpoint_policies
    if name == "none":
        return RematSpec(name, None)
    if name == "full":
        return RematSpec(name, cp.nothing_saveable)
    if name == "dots":
        named = cp.save_only_these_names(CONV_OUT, DOT_OUT)
        return RematSpec(name, cp.save_from_both_policies(cp.dots_saveable, named))
    if name == "sqrt":
        return RematSpec(name, cp.nothing_saveable, segment=-1)
    if isinstance(name, str) and name.startswith("save:"):
        names = [n for n in name[len("save:") :].split(",") if n]
        if names:
            return RematSpec(name, cp.save_only_these_names(*names))
    if isinstance(name, str) and name.startswith("offload:"):
        names = [n for n in name[len("offload:") :].split(",") if n]
        if names:
            policy = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=names,
                offload_src="device",
                offload_dst="pinned_host",
            )
            return RematSpec(name, policy)
    if isinstance(name, str) and name.startswith("blocks:"):
        schedule = _parse_schedule(name[len("blocks:") :])
        if schedule:
            return RematSpec(name, None, schedule=schedule)
    if isinstance(name, str) and name.startswith("every:"):
        k = name[len("every:") :]
        if k.isdigit() and int(k) >= 1:
            return RematSpec(name, cp.nothing_saveable, segment=int(k))
    raise ValueError(f"Unknown remat={name!r}; allowed values: {list(POLICY_NAMES)}")


def _parse_schedule(text: str) -> tuple[str, ...]:
    """``"full*2,none"`` -> ``("full", "full", "none")``; ``()`` when malformed."""
    out: list[str] = []
    for entry in text.split(","):
        policy, _, count = entry.partition("*")
        if policy not in SCHEDULE_POLICIES or (count and not count.isdigit()):
            return ()
        if count and int(count) < 1:
            return ()
        out += [policy] * (int(count) if count else 1)
    return tuple(out)


def schedule_name(policies: Sequence[str]) -> str:
    """The ``blocks:`` name of a per-block list of policies, runs written ``P*K``;
    ``("full", "full", "none")`` -> ``"blocks:full*2,none"``."""
    runs = [(p, len(list(g))) for p, g in itertools.groupby(policies)]
    return "blocks:" + ",".join(p if k == 1 else f"{p}*{k}" for p, k in runs)


def stack_policies(
    remat: str | RematSpec, lengths: Sequence[int], model: str
) -> list[str | tuple[str, ...]]:
    """The ``remat`` each of a model's :class:`~lowmem_jax.ScannedBlocks` stacks gets, given
    the stacks' ``lengths`` in the order the model runs them: the policy itself, or for a
    ``blocks:`` schedule, each stack's slice of it.

    Raises:
      ValueError: a schedule whose length is not the model's number of blocks.
    """
    spec = parse_policy(remat)
    if not spec.schedule:
        return [remat] * len(lengths)
    if len(spec.schedule) != sum(lengths):
        raise ValueError(
            f"remat={spec.name!r} schedules {len(spec.schedule)} blocks; {model} runs "
            f"{sum(lengths)} (stacks of {list(lengths)}): give one policy per block"
        )
    starts = list(itertools.accumulate(lengths, initial=0))
    return [spec.schedule[a:b] for a, b in zip(starts, starts[1:], strict=False)]


# Set while a block's call runs under its checkpoint, so that a block inside a block is not
# wrapped again.
INSIDE_BLOCK = contextvars.ContextVar("lowmem_remat_inside_block", default=False)


def checkpointed_call(lifted_remat, module, cls: type, args: tuple, kwargs: dict, policy) -> Any:
    """``cls.__call__(module, *args, **kwargs)`` under Flax's lifted remat (``nn.remat`` or
    ``nnx.remat``: parameters and collections keep their structure); keyword arguments are
    closed over (static flags such as ``train``), positional ones traced."""

    def body(mdl, *positional):
        token = INSIDE_BLOCK.set(True)
        try:
            return cls.__call__(mdl, *positional, **kwargs)
        finally:
            INSIDE_BLOCK.reset(token)

    return lifted_remat(body, policy=policy)(module, *args)


def remat_module(module: ModuleT, remat: str | RematSpec, blocks: Sequence[str] = ()) -> ModuleT:
    """Any Linen or NNX module (one without a ``remat`` attribute) with the policy ``remat``.

    ``blocks=()``: the module's whole ``__call__`` under one ``jax.checkpoint``. With a single
    checkpointed region the backward pass recomputes the forward and then holds every residual
    it needs at once, so this alone costs compute without lowering peak memory; it is the
    building block, not the saving. ``blocks=("Block", ...)``: every call of a submodule whose
    class is named in ``blocks`` runs under its own checkpoint (Flax's lifted ``nn.remat`` via
    ``nn.intercept_methods`` for Linen, ``nnx.remat`` for NNX): only the blocks' inputs (and
    what the policy saves) stay between forward and backward, as with the bundled models'
    per-block remat. A block called inside another named block is not checkpointed again.
    Keyword arguments of a checkpointed call are closed over (static flags such as ``train``),
    positional ones traced. ``blocks="auto"`` (:data:`lowmem_jax.blocks.discovery.AUTO_BLOCKS`, what
    ``Plan`` uses when ``remat_blocks`` is empty): the model's repeated blocks, found by
    :func:`lowmem_jax.blocks.discovery.repeated_blocks`
    (Linen: from the calls of a traced forward, each time the model is traced; NNX: from its
    graph, here); where it has none, the whole forward with a warning that it lowers nothing.

    Parameters, BatchNorm statistics and dropout keys keep their structure and values. Linen:
    the result is an instance of a subclass of ``type(module)`` with the same fields. NNX: a
    copy (``nnx.clone``) whose named submodules (or the module itself) are instances of such
    subclasses; ``module`` is left as it was.

    Raises:
      ValueError: for a segmenting policy (``every:K``, ``sqrt``) or a ``blocks:`` schedule,
        which need stacks of blocks (:class:`~lowmem_jax.ScannedBlocks`); for a name in
        ``blocks`` that is not the class of a submodule the model has (NNX: here) or calls
        (Linen: when it is called).
    """
    spec = parse_policy(remat)
    if not spec.enabled:
        return module
    if spec.segment or spec.schedule:
        raise ValueError(
            f"remat={spec.name!r} needs the scanned block stacks of a model with a `remat` "
            f"attribute; {type(module).__name__} has none (use full, dots or save:NAME)"
        )
    auto = isinstance(blocks, str) and blocks == blocks_lib.AUTO_BLOCKS
    if isinstance(module, nnx.Module):
        names = blocks_lib.nnx_blocks(module) if auto else tuple(blocks)
        if auto and not names:
            warnings.warn(
                blocks_lib.no_blocks_warning(type(module).__name__, spec.name), stacklevel=3
            )
        return _remat_nnx_module(module, spec.policy, names)
    cls, names = type(module), () if auto else tuple(blocks)

    if auto:

        def call(self, *args, **kwargs):
            fields = linen_wrap.fields(self)
            found = blocks_lib.linen_blocks(cls, fields, tuple(self.scope.rngs), args, kwargs)
            if not found:
                warnings.warn(blocks_lib.no_blocks_warning(cls.__name__, spec.name), stacklevel=2)
                return checkpointed_call(nn.remat, self, cls, args, kwargs, spec.policy)
            return _call_with_blocks(self, cls, found, spec.policy, args, kwargs)

    elif names:

        def call(self, *args, **kwargs):
            return _call_with_blocks(self, cls, names, spec.policy, args, kwargs)

    else:

        def call(self, *args, **kwargs):
            return checkpointed_call(nn.remat, self, cls, args, kwargs, spec.policy)

    # a policy name parses to the same policy; a RematSpec given is keyed by its policy object
    key = remat if isinstance(remat, str) else spec
    return linen_wrap.with_call(module, call, ("remat", key, names, auto))


def _call_with_blocks(module, cls: type, names: tuple[str, ...], policy, args, kwargs):
    """``cls.__call__(module, ...)`` with every call of a submodule whose class is in ``names``
    under its own checkpoint (Flax's lifted ``nn.remat``, via ``nn.intercept_methods``)."""
    called: set[str] = set()

    def interceptor(next_fun, a, k, context):
        target = context.module
        called.add(type(target).__name__)
        if (
            context.method_name != "__call__"
            or type(target).__name__ not in names
            or INSIDE_BLOCK.get()
        ):
            return next_fun(*a, **k)
        return checkpointed_call(nn.remat, target, type(target), a, k, policy)

    with nn.intercept_methods(interceptor):
        out = cls.__call__(module, *args, **kwargs)
    _check_block_names(names, cls.__name__, called - {cls.__name__}, "calls")
    return out


def _check_block_names(names: tuple[str, ...], model: str, classes: set[str], verb: str) -> None:
    missing = [n for n in names if n not in classes]
    if missing:  # else the policy would silently checkpoint nothing
        raise ValueError(
            f"remat_blocks names {missing}, which {model} never {verb}; its submodule "
            f"classes: {sorted(classes)}"
        )


def _remat_nnx_module(module: nnx.Module, policy, names: tuple[str, ...]) -> nnx.Module:
    """An ``nnx.clone`` of ``module`` whose submodules of the classes in ``names`` (or, for
    ``names=()``, the module itself) run ``__call__`` under ``nnx.remat``.

    The instances' classes are swapped for subclasses
    (:func:`lowmem_jax.core.linen_wrap.swap_calls`)."""
    module = nnx.clone(module)
    submodules = [s for path, s in nnx.iter_graph(module) if path and isinstance(s, nnx.Module)]
    _check_block_names(names, type(module).__name__, {type(s).__name__ for s in submodules}, "has")
    targets = [s for s in submodules if type(s).__name__ in names] if names else [module]

    def make_call(cls):
        def call(self, *args, **kwargs):
            if INSIDE_BLOCK.get():
                return cls.__call__(self, *args, **kwargs)
            return checkpointed_call(nnx.remat, self, cls, args, kwargs, policy)

        return call

    linen_wrap.swap_calls(targets, make_call)
    return module


def tagged_names(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The names ``fn(*args)`` tags with ``checkpoint_name`` (traced)."""
    return {e.params["name"] for e in traced_equations(fn, *args) if e.primitive.name == "name"}


def check_saved_names(remat: str | RematSpec, tagged: set[str]) -> None:
    """Raises ValueError when a ``save:`` policy names a tag that ``tagged`` (the model's, see
    :func:`tagged_names`) lacks: such a policy would silently save nothing, i.e. act as
    ``full``."""
    spec = parse_policy(remat)
    missing = [n for n in spec.saved_names if n not in tagged]
    if missing:
        raise ValueError(
            f"remat={spec.name!r} keeps {missing}, which the model never tags "
            f"with checkpoint_name; the model tags: {sorted(tagged) or 'nothing'}"
        )


def compiler_options(remat: str | RematSpec = "full", backend: str | None = None) -> dict[str, str]:
    """XLA options under which ``remat`` takes effect on ``backend`` (default: JAX's default).

    On CPU with remat enabled: ``{"xla_disable_hlo_passes": "cse_barrier_expander"}``; otherwise
    ``{}``. Pass it to ``jax.jit(..., compiler_options=...)`` or ``.compile(compiler_options)``.
    """
    spec = parse_policy(remat)
    backend = backend or jax.default_backend()
    if spec.enabled and backend == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return {}
