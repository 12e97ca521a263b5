"""Remat policies (gradient checkpointing): what a block saves for the backward pass, by name.

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

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = [
    "RematSpec",
    "parse_policy",
    "POLICY_NAMES",
    "SCHEDULE_POLICIES",
    "CONV_OUT",
    "DOT_OUT",
    "compiler_options",
    "schedule_name",
    "stack_policies",
]

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


class RematSpec(str):
    """A remat policy, parsed once: its text (a ``str``: ``spec == "full"``, ``str(spec)``, JSON,
    a flag's value) and what it means. ``RematSpec(text)`` parses ``text`` (module docstring);
    :class:`lowmem_jax.Plan` holds its ``remat`` as one.

    Attributes:
      name: the policy text it was parsed from.
      policy: the ``jax.checkpoint`` policy applied per block, or ``None`` for no remat.
      segment: blocks per checkpointed segment (``0``: per block; ``-1``: ``ceil(sqrt(n))``).
      schedule: a ``blocks:`` schedule's policy name per block, expanded (``()`` otherwise; then
        ``policy`` is ``None``: each block's comes from its entry).

    Raises:
      ValueError: naming ``remat`` and the allowed values, for an unknown or malformed name.
    """

    policy: Callable[..., bool] | None
    segment: int
    schedule: tuple[str, ...]

    def __new__(cls, name: str) -> RematSpec:
        if isinstance(name, RematSpec):
            return name
        policy, segment, schedule = _parse(name)
        spec = super().__new__(cls, name)
        spec.policy, spec.segment, spec.schedule = policy, segment, schedule
        return spec

    def __reduce__(self):  # parsed again: the checkpoint policies are closures
        return (RematSpec, (str(self),))

    @property
    def name(self) -> str:
        return str(self)

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
    """The :class:`RematSpec` of a remat policy name (module docstring); a spec itself.

    Raises:
      ValueError: naming ``remat`` and the allowed values, for an unknown or malformed name.
    """
    return RematSpec(name)


def _parse(name: Any) -> tuple[Callable[..., bool] | None, int, tuple[str, ...]]:
    """``(policy, segment, schedule)`` of a policy name."""
    cp = jax.checkpoint_policies
    if name == "none":
        return None, 0, ()
    if name == "full":
        return cp.nothing_saveable, 0, ()
    if name == "dots":
        named = cp.save_only_these_names(CONV_OUT, DOT_OUT)
        return cp.save_from_both_policies(cp.dots_saveable, named), 0, ()
    if name == "sqrt":
        return cp.nothing_saveable, -1, ()
    if isinstance(name, str) and name.startswith("save:"):
        names = [n for n in name[len("save:") :].split(",") if n]
        if names:
            return cp.save_only_these_names(*names), 0, ()
    if isinstance(name, str) and name.startswith("offload:"):
        names = [n for n in name[len("offload:") :].split(",") if n]
        if names:
            policy = cp.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=names,
                offload_src="device",
                offload_dst="pinned_host",
            )
            return policy, 0, ()
    if isinstance(name, str) and name.startswith("blocks:"):
        schedule = _parse_schedule(name[len("blocks:") :])
        if schedule:
            return None, 0, schedule
    if isinstance(name, str) and name.startswith("every:"):
        k = name[len("every:") :]
        if k.isdigit() and int(k) >= 1:
            return cp.nothing_saveable, int(k), ()
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
