"""A cost model of one training step's exchange, for the cluster sizes this machine cannot run.

Per collective, an α-β model as Horovod runs them over Gloo or MPI on a full-duplex link of
``rate`` per host (α: a collective round's latency, β: the link's bytes per second), for one
worker per host and n hosts:

- **allreduce** (ring: reduce-scatter then all-gather) of B bytes: each worker sends and receives
  ``2 (n-1)/n · B`` in ``2 (n-1)`` hops: ``2 (n-1) α + 2 (n-1)/n · B / β``. Its bytes stay flat in n.
- **allgather** (ring) of P bytes per worker: each worker sends and receives ``(n-1) · P`` in
  ``n-1`` hops: ``(n-1) α + (n-1) P / β``. Its bytes grow with n.
- **all-to-all + all-gather** (``communicator="alltoall"``: shards to their owners, each
  owner re-compresses its shard, the shards gathered): ``(1 + s) (n-1)/n · P`` per worker in
  ``2 (n-1)`` hops, flat in n like the ring allreduce; ``s``, the owners' share
  (``grace.communicators.alltoall.owner_share``: 1 where an owner encodes as the workers do, 2
  for top-k's owners, which keep twice the workers' share, for 1-bit's, which send two passes,
  and for a sign vote's 2-bit codes).

A step is the compute, the compression (encode once; decode once after an allreduce, once per
worker's payload after an allgather, about twice after the two stages, whose owners also
re-encode a shard), and the collectives one after another (the exchange workload has no backward
pass to overlap with). The inputs are measured, not assumed: each compressor's payload and its
encode/decode times on ResNet-50's gradients come from ``make bench`` (``--bench``), the number
of collectives per step from grace's own buckets and rounds, the compute time and α from the
emulated cluster (``--validate``).

    .venv/bin/python -m scripts.tools.cost_model --out data/results/model        # tables and plots
    .venv/bin/python -m scripts.tools.cost_model --validate data/results/onepass/exchange-torch.json

``--validate`` sets the model against measured runs of ``compare.py`` (the exchange workload,
their workers, link rate, compute and payload): predicted and measured step time and bytes on
each host's link, side by side. Where a results file holds the same set-up on unshaped links as
well, the exchange's cost on this machine beyond its link (the unshaped run's exchange less its
link time: cores that two or more busy workers share, the owners' work between their two
collectives) is read off that run and added to the timed run's prediction, so that what the
timed run tests is the link's share; the predictions beyond this machine assume a core to spare
per worker and leave that term out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from dataclasses import dataclass

from scripts import ROOT, compare, plots, workloads

BENCH = os.path.join(ROOT, "data", "performance", "bench.json")
RATES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "10gbit": 10e9 / 8, "100gbit": 100e9 / 8}
# What an unshaped veth pair of the emulated cluster carries on this machine (docs/results.md,
# "The emulated cluster"), bytes/s: the link time subtracted from an unshaped run's exchange.
UNSHAPED_RATE = 6.6e9 / 8
# A collective round's latency: Horovod's negotiation cycle (HOROVOD_CYCLE_TIME, 1 ms by
# default in 0.28: a collective waits for the next cycle) and a TCP hop. Fitted on the emulated
# cluster by --validate (its residual is printed); a default for the sizes beyond it.
ALPHA_S = 1e-3
HOP_S = 50e-6
COMMUNICATORS = ("allreduce", "allgather", "alltoall")
# Horovod's own control traffic on a host's link (sent + received), per second of training: the
# coordinator's negotiation every cycle. Measured on the emulated cluster, 2 workers, 1 ms cycle
# (eth0's counters less the payloads, data/results/onepass: 0.47-0.73 MB/s over six runs).
CONTROL_BYTES_PER_S = 0.6e6


@dataclass
class Codec:
    """What the model needs of a compressor on the workload: bytes each worker puts into the
    exchange per step, seconds to encode them and to decode one payload, and its rounds."""

    name: str
    payload: float
    encode_s: float
    decode_s: float
    communicator: str  # its own: "allreduce" (summable payloads) or "allgather"
    rounds: int = 1
    owner_share: float = 1.0  # through the owners: what an owner sends on per byte it received


def collective(kind: str, n: int, nbytes: float, rate: float, alpha: float = ALPHA_S,
               hop: float = HOP_S, owner_share: float = 1.0) -> tuple[float, float]:
    """(seconds, bytes each worker sends, equal to what it receives) of one collective of
    ``nbytes`` per worker among ``n`` workers on links of ``rate`` bytes/s (``owner_share``: the
    owners' second stage per byte of the first, through the owners)."""
    if n < 2:
        return 0.0, 0.0
    if kind == "allreduce":
        sent, hops = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
    elif kind == "allgather":
        sent, hops = (n - 1) * nbytes, n - 1
    elif kind == "alltoall":  # all-to-all of the shards, then all-gather of the re-encoded ones
        sent, hops = (1 + owner_share) * (n - 1) / n * nbytes, 2 * (n - 1)
    else:
        raise ValueError(f"kind must be one of {', '.join(COMMUNICATORS)}, got {kind!r}")
    return alpha + hops * hop + sent / rate, sent


def step(codec: Codec, kind: str, n: int, rate: float, compute_s: float, collectives: int,
         alpha: float = ALPHA_S) -> dict:
    """A step's predicted time and bytes per worker with ``codec`` exchanged by ``kind``, in
    ``collectives`` collectives per round (the buckets)."""
    seconds = sent = 0.0
    for _ in range(codec.rounds):
        for _ in range(collectives):
            t, b = collective(kind, n, codec.payload / (collectives * codec.rounds), rate, alpha,
                              owner_share=codec.owner_share)
            seconds, sent = seconds + t, sent + b
    if kind == "allreduce":
        coding = codec.encode_s + codec.decode_s
    elif kind == "allgather":
        coding = codec.encode_s + n * codec.decode_s
    else:  # decode the n shards (one payload's worth), re-encode one, decode the n re-encoded
        coding = codec.encode_s * (1 + 1 / n) + (1 + codec.owner_share) * codec.decode_s
    if n < 2:
        coding = 0.0
    return {"step_s": compute_s + coding + seconds, "exchange_s": seconds, "coding_s": coding,
            "sent_bytes": sent, "link_bytes": 2 * sent}


@functools.cache  # asked per measured run, and again for each unshaped one
def collectives_per_round(name: str) -> int:
    """How many collectives a round of the exchange workload takes: grace's buckets of
    ResNet-50's gradients (``bucket_bytes``' default), dense and compressed alike."""
    import grace
    from grace.backends.numpy_ops import NumpyOps

    shapes = [(s, "float32") for _, s in reversed(workloads.resnet50_shapes())]
    pipeline = grace.build("none" if name == "fp32" else name)
    return len(pipeline.buckets(shapes, NumpyOps()))


def codecs(bench_path: str = BENCH) -> dict[str, Codec]:
    """Every compressor's ``Codec`` on ResNet-50's gradients from ``make bench``'s JSON (PyTorch,
    CPU, one thread), and Horovod's dense fp32 allreduce."""
    import grace
    from grace.communicators.alltoall import owner_share

    with open(bench_path) as f:
        rows = json.load(f)["catalogue"]
    numel = sum(math.prod(s) for _, s in workloads.resnet50_shapes())
    out = {"fp32": Codec("fp32", 4.0 * numel, 0.0, 0.0, "allreduce")}
    for row in rows:
        if row.get("framework") != "torch" or row.get("case") != "resnet50" or row.get("device") != "cpu":
            continue
        name = row["compressor"]
        pipeline = grace.build(name)
        out[name] = Codec(name, row["payload_bytes"], row["compress_s"], row["decompress_s"],
                          pipeline.communicator.resolve(2).name,  # "auto" gathers at 2
                          pipeline.compressor.rounds, owner_share(pipeline.compressor))
    return out


def alltoall_valid(codec: Codec) -> bool:
    """The two-stage exchange needs a compressor that can encode a shard on its own; a summable
    payload (allreduce) is flat already (PowerSGD, random-k)."""
    return codec.communicator == "allgather"


def predict(codec_map: dict[str, Codec], sizes, rates, compute_s: float) -> list[dict]:
    rows = []
    for name, codec in codec_map.items():
        count = collectives_per_round(name)
        kinds = [codec.communicator] + (["alltoall"] if alltoall_valid(codec) else [])
        for rate_name in rates:
            for kind in kinds:
                for n in sizes:
                    r = step(codec, kind, n, RATES[rate_name], compute_s, count)
                    rows.append({"compressor": name, "communicator": kind, "rate": rate_name,
                                 "workers": n, **r})
    return rows


# --- validation against the emulated cluster -----------------------------------------------------
def route(spec: str, codec: Codec, n: int, used: str | None = None) -> str:
    """The communicator a measured run used: as it reported (``used``), else the one its spec
    names (``auto`` resolved for ``n`` workers), else the compressor's default."""
    if used:
        return used
    named = None if spec in ("fp32", "hvd-fp16") else json.loads(spec).get("communicator")
    if named == "auto" or (named is None and codec.communicator == "allgather"):
        from grace.communicators.alltoall import ALLTOALL_FROM

        return "alltoall" if n >= ALLTOALL_FROM else "allgather"
    return named or codec.communicator


def _measured_runs(paths: list[str], codec_map: dict[str, Codec]):
    """(path, run, compressor name, route) of every measured exchange run the model knows."""
    for path in paths:
        with open(path) as f:
            runs = json.load(f)
        for run in runs:
            if run.get("status") != "ok" or run.get("workload") != "exchange":
                continue
            spec = run["compression"]
            name = spec if spec in ("fp32", "hvd-fp16") else json.loads(spec)["compressor"]
            if name in codec_map:
                yield path, run, name, route(spec, codec_map[name], run["workers"], run.get("communicator"))


def _predicted_exchange(run: dict, name: str, kind: str, codec_map: dict[str, Codec],
                        rate: float) -> dict:
    """The model's exchange of a measured run, from its own payload (its coding is measured).
    Through the owners a worker hands Horovod ``(n-1)/n`` of its payload and its own re-encoded
    shard, ``s/n`` of one (``bytes_per_step``), with ``s`` the owners' share the run recorded; a
    run recorded before it did ran with owners that kept the workers' share, ``s = 1``."""
    base = codec_map[name]
    share, n, payload = run.get("owner_share", 1.0), run["workers"], run["bytes_per_step"]
    if kind == "alltoall":
        payload = payload * n / (n - 1 + share)
    codec = Codec(name, payload, 0.0, 0.0, base.communicator, base.rounds, share)
    return step(codec, kind, n, rate, 0.0, collectives_per_round(name))


def _setup(path: str, run: dict, kind: str) -> tuple:
    """A run's set-up but for its link rate: results file, framework, the compression spec with
    its parameters (two settings of one compressor are two set-ups), route and workers."""
    return path, run.get("framework"), run["compression"], kind, run["workers"]


def host_overheads(paths: list[str], codec_map: dict[str, Codec]) -> dict[tuple, float]:
    """What an exchange costs on this machine beyond its link, per set-up: read off the runs on
    unshaped links (about ``UNSHAPED_RATE``), as their measured exchange less the model's time for
    their bytes at that rate. With two cores for two or more busy workers, Horovod's background
    thread, Gloo's copies and sums and every wake-up after a collective wait for a core; on a
    host with a core to spare they would not (the model's predictions beyond this machine leave
    this term out). Keyed by ``_setup``: only runs of one ``compare.py`` invocation are set side
    by side, as the machine's speed varies between sessions."""
    out = {}
    for path, run, name, kind in _measured_runs(paths, codec_map):
        if run["rate"] != "unshaped":
            continue
        measured = run["step_s"] - run["compute_s"] - run["compression_s"]
        link = _predicted_exchange(run, name, kind, codec_map, UNSHAPED_RATE)["exchange_s"]
        out[_setup(path, run, kind)] = max(0.0, measured - link)
    return out


def validate(paths: list[str], codec_map: dict[str, Codec]) -> list[dict]:
    """Each measured exchange run against the model given its own compute time, compression time
    and payload (so that what is checked is the exchange's model): step time and bytes on the
    host's link (eth0, sent + received). A run on unshaped links (no rate to model its time by)
    checks the bytes only, and gives its set-up's host overhead (``host_overheads``): a timed run
    of the same file with the same framework, compressor, route and workers is then predicted
    with it added (``predicted_with_host_ms``), so that the link's share is what is tested."""
    out = []
    overheads = host_overheads(paths, codec_map)
    for path, run, name, kind in _measured_runs(paths, codec_map):
        timed = run["rate"] in RATES
        n = run["workers"]
        predicted = _predicted_exchange(run, name, kind, codec_map, RATES[run["rate"] if timed else "1gbit"])
        measured_exchange = run["step_s"] - run["compute_s"] - run["compression_s"]
        row = {"source": os.path.relpath(path, ROOT), "framework": run.get("framework"),
               "compressor": name, "communicator": kind,
               "rate": run["rate"], "workers": n, "measured_step_ms": 1e3 * run["step_s"]}
        if kind == "alltoall":
            row["owner_share"] = run.get("owner_share", 1.0)
        if timed:
            row.update(predicted_step_ms=1e3 * (run["step_s"] - measured_exchange
                                                + predicted["exchange_s"]),
                       measured_exchange_ms=1e3 * measured_exchange,
                       predicted_exchange_ms=1e3 * predicted["exchange_s"])
            row["step_error"] = row["predicted_step_ms"] / row["measured_step_ms"] - 1
            host = overheads.get(_setup(path, run, kind))
            if host is not None:
                row["host_overhead_ms"] = 1e3 * host
                row["predicted_with_host_ms"] = row["predicted_step_ms"] + 1e3 * host
                row["step_error_with_host"] = row["predicted_with_host_ms"] / row["measured_step_ms"] - 1
        if run.get("wire_bytes_per_step"):
            row["measured_link_bytes"] = run["wire_bytes_per_step"]
            row["predicted_link_bytes"] = predicted["link_bytes"] + CONTROL_BYTES_PER_S * run["step_s"]
            row["bytes_error"] = row["predicted_link_bytes"] / run["wire_bytes_per_step"] - 1
        out.append(row)
    return out


def validation_table(rows: list[dict]) -> str:
    lines = ["| run | compressor | route | rate | workers | step ms measured | predicted | error | "
             "+ host overhead (unshaped run) | error | link MB measured | predicted | error |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        link = (f"{r['measured_link_bytes'] / 1e6:.2f} | {r['predicted_link_bytes'] / 1e6:.2f} | "
                f"{100 * r['bytes_error']:+.1f}%") if "bytes_error" in r else "– | – | –"
        timed = (f"{r['predicted_step_ms']:.0f} | {100 * r['step_error']:+.0f}%"
                 if "step_error" in r else "– | –")
        host = (f"{r['predicted_with_host_ms']:.0f} ({r['host_overhead_ms']:.0f}) | "
                f"{100 * r['step_error_with_host']:+.0f}%" if "step_error_with_host" in r else "– | –")
        lines.append(f"| {r['source']} | {r['compressor']} | {r['communicator']} | {r['rate']} | "
                     f"{r['workers']} | {r['measured_step_ms']:.0f} | {timed} | {host} | {link} |")
    return "\n".join(lines)


ROUTES = {"allreduce": "", "allgather": " gathered", "alltoall": " through the owners"}


def _route_label(row: dict) -> str:
    return row["compressor"] + ROUTES[row["communicator"]]


def link_and_step_table(rows: list[dict]) -> str:
    """The timed runs of ``validate`` (a link rate the model knows), one line each: bytes on the
    link and step time, measured → predicted from the link alone (error)."""
    lines = ["| run | bytes on the link: measured → predicted | step: measured → predicted |",
             "|---|---|---|"]
    for r in rows:
        if "step_error" not in r:
            continue
        link = (f"{r['measured_link_bytes'] / 1e6:.2f} → {r['predicted_link_bytes'] / 1e6:.2f} MB "
                f"({100 * r['bytes_error']:+.1f}%)") if "bytes_error" in r else "–"
        step_ms = (f"{r['measured_step_ms']:.0f} → {r['predicted_step_ms']:.0f} ms "
                   f"({100 * r['step_error']:+.0f}%)")
        who = f"{compare.FRAMEWORK_NAMES.get(r['framework'], r['framework'])} {_route_label(r)}"
        lines.append(f"| {who}, {r['workers']} workers at {r['rate']} | {link} | {step_ms} |")
    return "\n".join(lines)


def host_error_table(rows: list[dict]) -> str:
    """The step's error with the host's share added (``predicted_with_host_ms``), a line per
    compressor and route (and framework and rate, where the rows hold several), a column per
    number of workers, the run files side by side in the order given (run 1 / run 2 ...), and how
    many are within 25%."""
    timed = [r for r in rows if "step_error_with_host" in r]
    sources = list(dict.fromkeys(r["source"] for r in timed))
    workers = sorted({r["workers"] for r in timed})
    several_fw = len({r["framework"] for r in timed}) > 1
    several_rates = len({r["rate"] for r in timed}) > 1
    runs = " / ".join(f"run {i + 1}" for i in range(len(sources)))
    lines = ["| + host overhead, error of the prediction | "
             + " | ".join(f"{n} workers: {runs}" for n in workers) + " |",
             "|---|" + "---:|" * len(workers)]

    def setup(r: dict) -> tuple:
        return r["framework"], r["rate"], r["compressor"], r["communicator"]

    for fw, rate, name, route in dict.fromkeys(map(setup, timed)):
        cells = []
        for n in workers:
            found = {r["source"]: r["step_error_with_host"] for r in timed
                     if setup(r) == (fw, rate, name, route) and r["workers"] == n}
            cells.append(" / ".join(f"{100 * found[s]:+.0f}%" if s in found else "–" for s in sources))
        label = (_route_label({"compressor": name, "communicator": route})
                 + (f", {compare.FRAMEWORK_NAMES.get(fw, fw)}" if several_fw else "")
                 + (f" at {rate}" if several_rates else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    within = [abs(r["step_error_with_host"]) <= 0.25 for r in timed]
    lines.append("| within 25% | " + " | ".join(
        f"{sum(ok for ok, r in zip(within, timed) if r['workers'] == n)} of "
        f"{sum(r['workers'] == n for r in timed)}" for n in workers) + " |")
    return "\n".join(lines)


# --- tables and plots ---------------------------------------------------------------------------
def speedup_table(rows: list[dict], sizes, rates) -> str:
    """Step time of fp32 over each compressor's best route, per rate and size."""
    by = {(r["compressor"], r["communicator"], r["rate"], r["workers"]): r for r in rows}
    names = sorted({r["compressor"] for r in rows} - {"fp32"})
    lines = []
    for rate in rates:
        lines += [f"\n#### {rate}: fp32 step time / compressor's step time (best route; "
                  "a = all-to-all + all-gather wins)",
                  "| compressor | " + " | ".join(f"n={n}" for n in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for name in names:
            cells = []
            for n in sizes:
                dense = by[("fp32", "allreduce", rate, n)]["step_s"]
                options = [(by[k]["step_s"], k[1]) for k in by
                           if k[0] == name and k[2] == rate and k[3] == n]
                best, kind = min(options)
                cells.append(f"{dense / best:.2f}{' a' if kind == 'alltoall' else ''}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n")


def bytes_plot(checked: list[dict], path: str) -> None:
    """Measured bytes on a host's link per step against the number of hosts, on unshaped links,
    relative to the same route's at 2 hosts: one panel per compressor, a line per route (solid:
    gathered; dashed: all-to-all + all-gather, one line per owners' share where runs of both were
    made; the model's prediction as hollow markers), Horovod's fp32 ring allreduce in grey in every
    panel. Absolute megabytes at the largest size in the legend; where several runs measured the
    same set-up, the last one listed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in checked if "measured_link_bytes" in r and r["rate"] == "unshaped"]
    names = sorted({r["compressor"] for r in rows} - {"fp32"})
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False,
                             sharey=True)
    styles = {"allgather": ("-", "tab:red", "o"), "allreduce": ("-", "0.6", "D")}
    shared = [("--", "tab:blue", "s"), ("-.", "tab:green", "^"), (":", "tab:purple", "v")]

    def line_of(r):
        return r["compressor"], r["communicator"], r.get("owner_share")

    for ax, name in zip(axes.flat, names):
        lines = sorted({line_of(r) for r in rows if r["compressor"] in ("fp32", name)},
                       key=lambda k: (k[0] != "fp32", k[1], k[2] or 0))
        for compressor, kind, share in lines:
            by_hosts = {r["workers"]: r for r in rows if line_of(r) == (compressor, kind, share)}
            mine = [by_hosts[h] for h in sorted(by_hosts)]
            if kind == "alltoall":
                shares = sorted({k[2] for k in lines if k[1] == "alltoall"})
                style, color, marker = shared[shares.index(share) % len(shared)]
                how = f"alltoall, owners' share {share:.0f}" if len(shares) > 1 else kind
            else:
                (style, color, marker), how = styles[kind], kind
            base = mine[0]["measured_link_bytes"]
            hosts = [r["workers"] for r in mine]
            label = (f"{'fp32 ring' if compressor == 'fp32' else how}: "
                     f"{mine[-1]['measured_link_bytes'] / 1e6:.1f} MB at {hosts[-1]}")
            ax.plot(hosts, [r["measured_link_bytes"] / base for r in mine], style, color=color,
                    marker=marker, label=label)
            if compressor != "fp32":
                ax.plot(hosts, [r["predicted_link_bytes"] / base for r in mine], marker, color=color,
                        mfc="none", ms=10, ls="none")
        ax.set_title(name)
        ax.set_xlabel("hosts (one worker each)")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes.flat[0].set_ylabel("bytes on a host's link / at 2 hosts")
    fig.suptitle("bytes per host per step: gathered grows with the hosts, through the owners it "
                 "stays flat like the ring (hollow: the model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], rates, path: str) -> None:
    """Small multiples: one panel per compressor, step time against workers, a line per rate and
    route (solid: the compressor's own communicator; dashed: all-to-all), fp32 in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["compressor"] for r in rows} - {"fp32"})
    cols = 6
    lines_ = -(-len(names) // cols)
    fig, axes = plt.subplots(lines_, cols, figsize=(3.0 * cols, 2.6 * lines_), sharex=True,
                             sharey=True, squeeze=False)
    colors = {"1gbit": "tab:red", "10gbit": "tab:blue", "100gbit": "tab:green", "100mbit": "tab:purple"}
    markers = {"1gbit": "o", "10gbit": "s", "100gbit": "^", "100mbit": "D"}
    for ax, name in zip(axes.flat, names):
        for rate in rates:
            dense = [r for r in rows if r["compressor"] == "fp32" and r["rate"] == rate]
            ax.plot([r["workers"] for r in dense], [r["step_s"] for r in dense], color="0.75",
                    lw=2, zorder=1)
            for kind, style in (("allgather", "-"), ("allreduce", "-"), ("alltoall", "--")):
                mine = [r for r in rows if r["compressor"] == name and r["rate"] == rate
                        and r["communicator"] == kind]
                if mine:
                    ax.plot([r["workers"] for r in mine], [r["step_s"] for r in mine], style,
                            color=colors[rate], marker=markers[rate], ms=3, lw=1.2,
                            label=f"{rate} {'all-to-all' if kind == 'alltoall' else 'own route'}")
        ax.set_title(name, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    plots.shared_legend(fig, axes, "fp32 allreduce (grey)", "0.75", 2, ncol=4)
    fig.supxlabel("workers (one per host)")
    fig.supylabel("predicted step time, s")
    fig.suptitle("ResNet-50's exchange, modelled: step time against workers")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--bench", default=BENCH, help="make bench's JSON (codec costs, payloads)")
    parser.add_argument("--rates", default="1gbit,10gbit,100gbit")
    parser.add_argument("--sizes", default="2,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="compute per step (default 0: the exchange alone)")
    parser.add_argument("--codec-speedup", type=float, default=1.0,
                        help="divide the measured encode/decode times (one CPU thread) by this: "
                             "e.g. 20 for a GPU's kernels")
    parser.add_argument("--validate", nargs="*", default=[], metavar="RESULTS_JSON",
                        help="compare.py results of the exchange workload to set the model against")
    parser.add_argument("--out", default=None, help="folder for model.md, model.json, model.png")
    args = parser.parse_args(argv)
    rates = [r for r in args.rates.split(",") if r]
    for rate in rates:
        if rate not in RATES:
            parser.error(f"--rates: {rate!r} is not one of {', '.join(RATES)}")
    sizes = [int(n) for n in args.sizes.split(",")]
    codec_map = codecs(args.bench)
    for codec in codec_map.values():
        codec.encode_s /= args.codec_speedup
        codec.decode_s /= args.codec_speedup
    report = []
    if args.validate:
        checked = validate(args.validate, codec_map)
        report += ["### The model against the emulated cluster", validation_table(checked), ""]
    rows = predict(codec_map, sizes, rates, args.compute_ms / 1e3)
    report += ["### Predicted speed-up over Horovod's fp32 allreduce", speedup_table(rows, sizes, rates)]
    text = "\n".join(report)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "model.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "model.json"), "w") as f:
            json.dump({"predicted": rows, "validated": checked if args.validate else []}, f, indent=1)
        plot(rows, rates, os.path.join(args.out, "model.png"))
        if args.validate:
            bytes_plot(checked, os.path.join(args.out, "bytes.png"))
    return rows


if __name__ == "__main__":
    main()
