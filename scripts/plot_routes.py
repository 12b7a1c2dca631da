"""Training curves of the same compressor by different routes, from ``compare.py``'s results.json:
one panel per compressor, its metric against the epoch, a line per communicator (gathered, through
the shards' owners, hierarchical), Horovod's fp32 in grey in every panel, and in a table the final
value of each and its difference to the first route.

    .venv/bin/python scripts/plot_routes.py docs/results/alltoall/mnist-4workers.json \\
        --out docs/results/alltoall/mnist-4workers.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402

STYLES = [("tab:red", "o", "-"), ("tab:blue", "s", "--"), ("tab:green", "^", ":")]


def route(spec: str) -> tuple[str, str]:
    """(compressor, route) of a run's compression spec."""
    if spec in compare.BASELINES:
        return spec, ""
    params = json.loads(spec)
    name = params.pop("compressor")
    extra = ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("ratio",))
    return name, extra or "default"


def curves(runs: list[dict]) -> dict:
    """{compressor: {route: [metric per epoch]}} of the successful runs."""
    out: dict = {}
    for run in runs:
        if run.get("status") != "ok":
            continue
        key = compare.METRIC[run["workload"]][0]
        name, how = route(run["compression"])
        out.setdefault(name, {})[how] = [e[key] for e in run["epochs"]]
    return out


def table(by_name: dict) -> str:
    lines = ["| compressor | route | final | vs the first route |", "|---|---|---:|---:|"]
    for name, routes in by_name.items():
        first = None
        for how, values in routes.items():
            first = values[-1] if first is None else first
            lines.append(f"| {name} | {how or '-'} | {values[-1]:.4f} | "
                         f"{100 * (values[-1] - first):+.2f} |")
    return "\n".join(lines)


def plot(by_name: dict, path: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in by_name if n not in compare.BASELINES]
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), sharex=True, sharey=True,
                             squeeze=False)
    dense = by_name.get("fp32", {}).get("")
    for ax, name in zip(axes.flat, names):
        if dense:
            ax.plot(range(1, len(dense) + 1), dense, color="0.7", lw=2, label="fp32")
        for (how, values), (color, marker, style) in zip(by_name[name].items(), STYLES):
            ax.plot(range(1, len(values) + 1), values, style, color=color, marker=marker, ms=3,
                    label=how)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("results", nargs="+", help="compare.py results.json files")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    runs = [run for path in args.results for run in json.load(open(path))]
    by_name = curves(runs)
    print(table(by_name))
    plot(by_name, args.out, compare.METRIC[runs[0]["workload"]][0].replace("_", " "))


if __name__ == "__main__":
    main()
