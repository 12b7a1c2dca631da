"""Training curves of the same compressor by different routes, from ``compare.py``'s results.json:
one panel per compressor, its metric against the epoch, a line per communicator (gathered, through
the shards' owners, hierarchical), Horovod's fp32 in grey in every panel, and in a table the final
value of each and its difference to the first route.

    .venv/bin/python -m scripts.tools.plot_routes data/results/alltoall/mnist-4workers.json \\
        --out data/results/alltoall/mnist-4workers.png

With ``--seeds``, runs of several seeds (``compare.py --seed``): per compressor and route, the
difference to the first route's run of the same seed (the mean of its runs where a seed has
several), final and over the last 3 epochs, one marker per seed and the mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics

from scripts import compare

STYLES = [("tab:red", "o", "-"), ("tab:blue", "s", "--"), ("tab:green", "^", ":")]


def route(spec: str) -> tuple[str, str]:
    """(compressor, route) of a run's compression spec."""
    if spec in compare.BASELINES:
        return spec, ""
    params = json.loads(spec)
    name = params.pop("compressor")
    extra = ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("ratio",))
    return name, extra or "default"


def metrics(runs: list[dict]):
    """(compressor, route, metric per epoch, run) of each successful run."""
    for run in runs:
        if run.get("status") == "ok":
            key = compare.METRIC[run["workload"]][0]
            yield (*route(run["compression"]), [e[key] for e in run["epochs"]], run)


def curves(runs: list[dict]) -> dict:
    """{compressor: {route: [metric per epoch]}} of the successful runs."""
    out: dict = {}
    for name, how, metric, _ in metrics(runs):
        out.setdefault(name, {})[how] = metric
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


def seed_differences(runs: list[dict]) -> dict:
    """{compressor: {route: {seed: (final, mean of the last 3)}}}, each a difference in points to
    the compressor's first route at the same seed (its runs averaged); seeds the first route
    lacks are left out."""
    values: dict = {}
    for name, how, metric, run in metrics(runs):
        per_seed = values.setdefault(name, {}).setdefault(how, {})
        per_seed.setdefault(run.get("seed", 0), []).append((metric[-1], statistics.fmean(metric[-3:])))
    out: dict = {}
    for name, routes in values.items():
        first, *others = routes
        base = {seed: _mean(got) for seed, got in routes[first].items()}
        for how in others:
            out.setdefault(name, {})[how] = {
                seed: tuple(100 * (m - b) for m, b in zip(_mean(got), base[seed]))
                for seed, got in sorted(routes[how].items()) if seed in base}
    return out


def _mean(pairs: list[tuple]) -> tuple:
    """The element-wise mean of a seed's (final, last 3) pairs."""
    return tuple(map(statistics.fmean, zip(*pairs)))


def seeds_table(diffs: dict) -> str:
    lines = ["| compressor | route | seeds | final, per seed | mean | last 3, per seed | mean |",
             "|---|---|---:|---|---:|---|---:|"]
    for name, routes in diffs.items():
        for how, by_seed in routes.items():
            if not by_seed:  # no run of the first route at its seeds: nothing to set against
                continue
            finals = [v[0] for v in by_seed.values()]
            lasts = [v[1] for v in by_seed.values()]
            lines.append(f"| {name} | {how} | {len(by_seed)} | {' / '.join(f'{v:+.2f}' for v in finals)} | "
                         f"**{statistics.fmean(finals):+.2f}** | {' / '.join(f'{v:+.2f}' for v in lasts)} | "
                         f"**{statistics.fmean(lasts):+.2f}** |")
    return "\n".join(lines)


SEED_MARKERS = "osD^vP*Xhp<>"


def plot_seeds(diffs: dict, path: str) -> None:
    """Per compressor two panels (final, last 3 epochs): a column per route, a marker per seed,
    a bar at the mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(diffs)
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.2 * len(names)), squeeze=False, sharey=True)
    seeds = sorted({seed for routes in diffs.values() for by in routes.values() for seed in by})
    colors = plt.cm.tab10.colors
    for row, name in zip(axes, names):
        routes = diffs[name]
        for panel, (ax, label) in enumerate(zip(row, ("final", "mean of the last 3 epochs"))):
            for x, by_seed in enumerate(routes.values()):
                for seed, value in by_seed.items():
                    i = seeds.index(seed)
                    ax.scatter(x + 0.06 * (i - len(seeds) / 2), value[panel], color=colors[i % 10],
                               marker=SEED_MARKERS[i % len(SEED_MARKERS)], s=22,
                               label=f"seed {seed}" if x == 0 else None)
                mean = statistics.fmean(v[panel] for v in by_seed.values())
                ax.hlines(mean, x - 0.3, x + 0.3, color="black", lw=2, label="mean" if x == 0 else None)
            ax.axhline(0, color="0.6", lw=1)
            ax.set_xticks(range(len(routes)), [how.replace(", ", "\n") for how in routes], fontsize=7)
            ax.set_title(f"{name}: {label}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        row[0].set_ylabel("points against the first route")
        row[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("results", nargs="+", help="compare.py results.json files")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--seeds", action="store_true",
                        help="differences to the first route seed by seed (runs of several seeds)")
    args = parser.parse_args(argv)
    runs = [run for path in args.results for run in json.load(open(path))]
    if args.seeds:
        diffs = seed_differences(runs)
        print(seeds_table(diffs))
        plot_seeds(diffs, args.out)
        return
    by_name = curves(runs)
    print(table(by_name))
    plot(by_name, args.out, compare.METRIC[runs[0]["workload"]][0].replace("_", " "))


if __name__ == "__main__":
    main()
