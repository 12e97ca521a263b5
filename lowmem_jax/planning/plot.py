"""The Pareto plot of a `lowmem plan` search: compiled bytes against FLOPs overhead."""

from __future__ import annotations

from lowmem_jax.planning.planner import MIB, BudgetPlan

__all__ = ["plot_considered"]


def plot_considered(result: BudgetPlan, path: str) -> None:
    """Compiled bytes against FLOPs overhead for every plan the search compiled: the budget as
    a line, the chosen plan marked (a PNG at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for c in result.considered:
        if c["xla_total_bytes"] is None:
            continue
        x, y = c["flops"] / result.reference_flops, c["xla_total_bytes"] / MIB
        chosen = c["verdict"] == "chosen"
        ax.scatter(
            x,
            y,
            marker="*" if chosen else "o",
            s=160 if chosen else 30,
            color="C3" if chosen else ("C2" if y * MIB <= result.budget_bytes else "C0"),
        )
        ax.annotate(c["name"], (x, y), fontsize=6, xytext=(4, -2), textcoords="offset points")
    ax.axhline(result.budget_bytes / MIB, color="k", lw=0.8, ls="--", label="budget")
    ax.set_xlabel("FLOPs per step / fp32 step (jaxpr, the class's count)")
    ax.set_ylabel(f"{result.xla['source']} total MiB")
    ax.set_title(f"lowmem plan: the plans compiled (chosen: star), envelope {result.envelope}",
                 fontsize=10)  # fmt: skip
    ax.margins(x=0.35)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
