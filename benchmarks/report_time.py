"""`lowmem report`'s wall time, whole process and row by row, into ``results/report_time.json``.

Run the main job and keep its output, cold (an empty ``--cache-dir``) and warm (the same again),
then add each run's log and print a table of runs::

    /usr/bin/time -f "%e s wall %U s user" lowmem report --cache-dir EMPTY --out-dir OUT > LOG 2>&1
    python benchmarks/report_time.py add LABEL --commit SHA --cache empty --log LOG
    python benchmarks/report_time.py table LABEL [LABEL ...] [--png PATH]

A commit other than the checkout's runs from a worktree (``git worktree add WT SHA; cd WT;
python -m lowmem_jax.cli report ...``). Each row's seconds are read from its progress line;
the whole process's wall and user CPU seconds from ``/usr/bin/time``'s last line.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "report_time.json"
_ROW = re.compile(r"^\[\s*\d+/\d+\] (.+?)\s+XLA total\s+([\d.]+) MiB .*?\(([\d.]+)s;")
_TIME = re.compile(r"^([\d.]+) s wall ([\d.]+) s user$")


def parse_log(text: str) -> dict:
    """``{"wall_seconds", "user_seconds", "rows": [{"name", "xla_total_mib", "seconds"}]}``
    of one run's output (progress lines, then ``/usr/bin/time``'s line)."""
    rows, wall, user = [], None, None
    for line in text.splitlines():
        if m := _ROW.match(line):
            rows.append({"name": m[1], "xla_total_mib": float(m[2]), "seconds": float(m[3])})
        elif m := _TIME.match(line.strip()):
            wall, user = float(m[1]), float(m[2])
    if not rows or wall is None:
        raise ValueError("the log holds no progress line or no '/usr/bin/time' line")
    return {"wall_seconds": wall, "user_seconds": user, "rows": rows}


def table(runs: dict, labels: list[str]) -> str:
    """Markdown: one column per run, seconds per row, the whole process last."""
    names = []
    for label in labels:
        names += [r["name"] for r in runs[label]["rows"] if r["name"] not in names]
    lines = ["| row | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for name in names:
        cells = []
        for label in labels:
            found = [r["seconds"] for r in runs[label]["rows"] if r["name"] == name]
            cells.append(f"{found[0]:.1f}" if found else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    wall = " | ".join(f"**{runs[label]['wall_seconds']:.0f} s**" for label in labels)
    user = " | ".join(
        f"{runs[label]['user_seconds']:.0f} s" if runs[label].get("user_seconds") else "-"
        for label in labels
    )
    return "\n".join([*lines, f"| **whole process** | {wall} |", f"| user CPU | {user} |"])


def plot(runs: dict, labels: list[str], path: str) -> None:
    """Stacked bars, one per run: each row's seconds bottom to top, the whole process's wall
    time marked above (start-up, imports and writing the report make the difference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4.5))
    for x, label in enumerate(labels):
        bottom = 0.0
        for row in runs[label]["rows"]:
            dsr = "sparse" in row["name"] and "static" not in row["name"]
            ax.bar(x, row["seconds"], bottom=bottom, color="tab:red" if dsr else "tab:blue",
                   edgecolor="white", linewidth=0.5)  # fmt: skip
            bottom += row["seconds"]
        wall = runs[label]["wall_seconds"]
        ax.plot([x - 0.4, x + 0.4], [wall, wall], color="black")
        ax.annotate(f"{wall:.0f} s", (x, wall), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds: rows (red: DSR), line: process")
    ax.set_title("lowmem report, this 2-core machine (XLA:CPU, compile-only)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add one run's log to the results")
    add.add_argument("label")
    add.add_argument("--commit", required=True)
    add.add_argument("--cache", choices=["empty", "warm"], required=True)
    add.add_argument("--log", required=True)
    add.add_argument("--date", required=True)
    show = sub.add_parser("table", help="print a markdown table of runs")
    show.add_argument("labels", nargs="+")
    show.add_argument("--png", help="also draw the runs to this PNG")
    args = parser.parse_args(argv)
    data = json.loads(RESULTS.read_text())
    if args.command == "add":
        run = parse_log(pathlib.Path(args.log).read_text())
        data["runs"][args.label] = {
            "commit": args.commit,
            "cache": args.cache,
            "date": args.date,
            **run,
        }
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    missing = [label for label in args.labels if label not in data["runs"]]
    if missing:
        print(f"report_time: unknown run(s) {missing}; allowed values: {list(data['runs'])}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(table(data["runs"], args.labels))
    if args.png:
        plot(data["runs"], args.labels, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
