"""The technique flags of ``lowmem analyze`` / ``lowmem train``: one flag per :class:`Plan` field,
the sparsity and factorization flags, the plan they give (:func:`plan_from_args`), and back
(:func:`analyze_argv`: the flags of a plan, e.g. for a report row's command)."""

from __future__ import annotations

import argparse
import dataclasses

from lowmem_jax.factorization import METHODS, RANK_RULES, FactorConfig
from lowmem_jax.plan import Plan
from lowmem_jax.sparsity import ALGORITHMS, DISTRIBUTIONS, INITS, REGROW_POOLS, SparseConfig
from lowmem_jax.workloads import MODEL_NAMES

__all__ = [
    "add_workload_flags",
    "add_plan_flags",
    "plan_from_args",
    "analyze_argv",
    "given_technique_flags",
]


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="wrn-28-2", help=f"{MODEL_NAMES}. Default: %(default)s")

    parser.add_argument(
        "--batch-size",
        type=int,
        help="examples (sentences for dynamicconv-*) per batch. Default: 128 for wrn-D-K, 100 "
        "for dynamicconv-*",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=40,
        help="tokens per sentence for dynamicconv-* (100 x 40 = the recipe's 4,000 tokens). "
        "Default: %(default)s",
    )


def add_plan_flags(parser: argparse.ArgumentParser, base: Plan) -> None:
    """A flag per technique field of :class:`Plan` (its help and choices), then sparsity."""
    group = parser.add_argument_group("techniques (composed into one jitted train step)")
    for field in Plan.flag_fields():
        default = getattr(base, field.name)
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(default),
            choices=field.metadata["choices"],
            help=f"{field.metadata['help']}. Default: {default}",
        )
    group = parser.add_argument_group("sparsity (lowmem_jax.sparsity)")
    group.add_argument(
        "--sparsity",
        type=float,
        default=0.0,
        help="fraction of zeros in the sparse weights (conv and dense kernels except the "
        "classifier; for translation the Linear kernels except DynamicConv's weight_linear, "
        "embeddings dense), e.g. 0.9; 0 = dense. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-algorithm", default="dsr", choices=ALGORITHMS, help="Default: %(default)s"
    )
    group.add_argument(
        "--sparse-distribution",
        default="uniform",
        choices=DISTRIBUTIONS,
        help="per-layer densities. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-init", default="random", choices=INITS, help="initial mask. Default: %(default)s"
    )
    group.add_argument(
        "--sparse-storage",
        default="compressed",
        choices=["compressed", "masked"],
        help="compressed: non-zero values + int32 indices, dense weights only transient inside "
        "the step; masked: dense weights + a mask (more memory than dense). Default: %(default)s",
    )
    group.add_argument(
        "--sparse-regrow-pool",
        default="auto",
        choices=REGROW_POOLS,
        help="where regrowth may land: not_kept = every position the prune did not keep (RigL's "
        "Algorithm 1), zeros_first = old zeros first (a departure); auto = not_kept, zeros_first "
        "for dsr. Default: %(default)s",
    )
    group.add_argument(
        "--sparse-period",
        type=int,
        default=100,
        help="optimizer steps between mask updates. Default: %(default)s",
    )
    group = parser.add_argument_group("factorized layers (lowmem_jax.factorization)")
    group.add_argument(
        "--factorize",
        default="none",
        choices=("none", *METHODS),
        help="factorize the convolutions (cp: Lebedev et al.; tucker: Tucker-2, Kim et al.; "
        "lowrank: KxK to R channels, then 1x1) and dense layers (always low-rank); the first and "
        "last layers stay dense. Default: %(default)s",
    )
    group.add_argument(
        "--factor-compression",
        type=float,
        default=0.25,
        help="fraction of each factorized layer's parameters its factors keep (sets the ranks "
        "under --factor-ranks compression). Default: %(default)s",
    )
    group.add_argument(
        "--factor-ranks",
        default="compression",
        choices=RANK_RULES,
        help="how ranks are chosen: by --factor-compression, or from the --decompose-from "
        "model's weights (tucker, lowrank): energy (keep --factor-energy of the squared "
        "singular values) or vbmf (Kim et al.'s VBMF). Default: %(default)s",
    )
    group.add_argument(
        "--factor-energy",
        type=float,
        default=0.9,
        help="retained energy for --factor-ranks energy. Default: %(default)s",
    )


def plan_from_args(args: argparse.Namespace, base: Plan) -> Plan:
    """``base`` with the technique flags given, and the sparsity they ask for."""
    given = {f.name: getattr(args, f.name) for f in Plan.flag_fields()}
    given = {k: v for k, v in given.items() if v is not None}
    if not 0.0 <= args.sparsity < 1.0:
        raise ValueError(f"--sparsity must be in [0, 1) (fraction of zeros), got {args.sparsity}")
    sparse = None
    if args.sparsity > 0.0:
        sparse = SparseConfig(
            algorithm=args.sparse_algorithm,
            density=1.0 - args.sparsity,
            distribution=args.sparse_distribution,
            init=args.sparse_init,
            update_period=args.sparse_period,
            compressed=args.sparse_storage == "compressed",
            regrow_pool=args.sparse_regrow_pool,
        )
    factorize = None
    if args.factorize != "none":
        factorize = FactorConfig(
            method=args.factorize,
            compression=args.factor_compression,
            rank_rule=args.factor_ranks,
            energy=args.factor_energy,
        )
    return dataclasses.replace(base, **given, sparsity=sparse, factorize=factorize)


def analyze_argv(model: str, batch_size: int, plan: Plan | None, seq_len: int = 40) -> list[str]:
    """The ``lowmem analyze`` arguments that analyse ``plan`` (``None``: ``--plain``).

    Technique flags are given where they differ from the flag's default. The result is checked
    by parsing it back: the plan it gives must equal ``plan``.

    Raises:
      ValueError: a plan with a setting no flag expresses (e.g. a sparsity ``seed``).
    """
    argv = ["--model", model, "--batch-size", str(batch_size)]
    if model.startswith("dynamicconv"):
        argv += ["--seq-len", str(seq_len)]
    if plan is None:
        return [*argv, "--plain"]
    default = Plan()
    for field in Plan.flag_fields():
        if getattr(plan, field.name) != getattr(default, field.name):
            argv += ["--" + field.name.replace("_", "-"), str(getattr(plan, field.name))]
    sparse = plan.sparsity
    if sparse is not None:
        argv += ["--sparsity", repr(round(1.0 - sparse.density, 12))]
        flags = {
            "--sparse-algorithm": (sparse.algorithm, "dsr"),
            "--sparse-distribution": (sparse.distribution, "uniform"),
            "--sparse-init": (sparse.init, "random"),
            "--sparse-storage": ("compressed" if sparse.compressed else "masked", "compressed"),
            "--sparse-period": (sparse.update_period, 100),
            "--sparse-regrow-pool": (sparse.regrow_pool, "auto"),
        }
        argv += [a for flag, (v, d) in flags.items() if v != d for a in (flag, str(v))]
    factor = plan.factorize
    if factor is not None:
        argv += ["--factorize", factor.method]
        if factor.compression != 0.25:
            argv += ["--factor-compression", repr(factor.compression)]
        if factor.rank_rule != "compression":
            argv += ["--factor-ranks", factor.rank_rule]
        if factor.energy != 0.9:
            argv += ["--factor-energy", repr(factor.energy)]
    parser = argparse.ArgumentParser()
    add_workload_flags(parser)
    add_plan_flags(parser, Plan())
    args = parser.parse_args(argv)
    if plan_from_args(args, Plan()) != plan:
        raise ValueError(f"lowmem analyze has no flags for every setting of {plan}")
    return argv


def given_technique_flags(args: argparse.Namespace) -> list[str]:
    """The technique flags given on the command line (those not left at their default)."""
    given = [f"--{f.name.replace('_', '-')}" for f in Plan.flag_fields()
             if getattr(args, f.name) is not None]  # fmt: skip
    given += ["--sparsity"] if args.sparsity else []
    given += ["--factorize"] if args.factorize != "none" else []
    return given
