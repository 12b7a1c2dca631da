"""An emulated cluster on one machine: N hosts as network namespaces, each joined to a switch namespace
by a veth pair whose two ends are rate-limited with ``tc`` (token bucket, ``tbf``), so each host has an
uplink and a downlink of the chosen rate, as behind a switch port. Horovod workers are started on those
hosts by Horovod's own Gloo launcher (``horovod.runner.gloo_run.launch_gloo``), given a command runner
that enters the host's namespace (``ip netns exec``) instead of ``ssh``. A PyTorch DDP job runs
as on a real cluster: one ``torchrun`` per host, its rendezvous at host 0's address
(``EmulatedCluster.torchrun``).

Needs root (namespaces and ``tc``). Everything is torn down on exit, Ctrl-C and failure; names all
start with ``grace-`` and addresses are in 10.231.0.0/16, inside namespaces this script created.

    sudo python -m scripts.cluster run --hosts 2 --rate 1gbit -- python -m scripts.compare_worker ...
    sudo python -m scripts.cluster run --hosts 2 --workers-per-host 2 -- python train.py
    sudo python -m scripts.cluster torchrun --hosts 2 --workers-per-host 2 -- train_ddp.py  # DDP
    sudo python -m scripts.cluster iperf --rate 100mbit          # measure a shaped transfer
    sudo python -m scripts.cluster cleanup                       # remove leftovers of a killed run

Each host's workers run on cores of their own (``taskset``; ``host_cpus``), as on machines of
their own: left to the scheduler, two workers' busy threads could share one core while the other
waited on softirqs, and a step's time moved by a third between runs (docs/exchange-studies.md,
"Hosts on cores of their own"). ``--no-pin`` (``pin=False``) leaves them to the scheduler.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

PREFIX = "grace-"
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` mounts /etc/netns/NS/* over /etc/*
RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")
UNITS = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


def is_root() -> bool:
    return os.geteuid() == 0


def can_emulate() -> tuple[bool, str]:
    """Whether this process can build namespaces and shape links, and why not."""
    if not is_root():
        return False, "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return False, f"`{tool}` (Debian's iproute2) is missing"
    return True, ""


def host_cpus(host: int, hosts: int, cpus: int | None = None) -> list[int]:
    """The cores host ``host`` of ``hosts`` runs on, of this machine's ``cpus``: an equal block of
    its own where there are at least as many cores as hosts, else one core shared round-robin."""
    cpus = cpus or os.cpu_count() or 1
    if hosts <= cpus:
        width = cpus // hosts
        return list(range(host * width, (host + 1) * width))
    return [host % cpus]


def rate_bits(rate: str | None) -> float | None:
    """Bits per second of a tc rate such as ``100mbit``; ``None`` (or "unshaped") for no limit."""
    if rate in (None, "", "unshaped"):
        return None
    match = RATE.match(rate.lower())
    if not match:
        raise ValueError(f"rate must look like 100mbit, 1gbit, 10gbit or be 'unshaped', got {rate!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """This machine's network namespaces whose names this script would have made."""
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def cleanup(tag: str = "") -> list[str]:
    """Delete this script's namespaces (all of them, or those of one cluster's ``tag``); their veths
    go with them, and so do their ``/etc/netns`` files."""
    gone = []
    for ns in namespaces():
        if not tag or ns.startswith(f"{PREFIX}{tag}-"):
            _sh("ip", "netns", "del", ns, check=False)
            gone.append(ns)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            if name.startswith(f"{PREFIX}{tag}-" if tag else PREFIX):
                shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    return gone


class EmulatedCluster:
    """``hosts`` namespaces ``grace-<tag>-h<i>`` with address 10.231.<subnet>.<i+1> on ``eth0``,
    joined by a bridge in ``grace-<tag>-sw``; with ``rate`` (a tc rate, e.g. ``1gbit``) both
    directions of every host's link are shaped by ``tbf``; with ``pin``, the workers ``launch_args``
    starts on a host run on its cores (``host_cpus``). A context manager: leaving it, by return,
    exception or signal, deletes the namespaces."""

    def __init__(self, hosts: int, rate: str | None = None, tag: str | None = None,
                 pin: bool = True):
        if int(hosts) < 1:
            raise ValueError(f"hosts must be at least 1, got {hosts}")
        self.hosts = int(hosts)
        self.rate = rate if rate_bits(rate) is not None else None
        self.pin = pin
        self.tag = tag or f"{os.getpid() % 10000}"
        self.subnet = int(self.tag) % 250 + 1 if self.tag.isdigit() else 1
        self.switch = f"{PREFIX}{self.tag}-sw"
        self.names = [f"{PREFIX}{self.tag}-h{i}" for i in range(self.hosts)]
        self.addresses = [f"10.231.{self.subnet}.{i + 1}" for i in range(self.hosts)]
        self._previous_handlers: dict = {}

    # --- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        ok, why = can_emulate()
        if not ok:
            raise PermissionError(why)
        self._trap_signals()
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        self._restore_signals()

    def _trap_signals(self) -> None:
        def raise_exit(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._previous_handlers[sig] = signal.signal(sig, raise_exit)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def up(self) -> None:
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        for i, (ns, address) in enumerate(zip(self.names, self.addresses)):
            port = f"port{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                "netns", sw)
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._hosts_file(ns, address)
            if self.rate:
                self._shape(ns, "eth0")  # the host's uplink
                self._shape(sw, port)  # its downlink: what the switch sends to it

    @staticmethod
    def _hosts_file(ns: str, address: str) -> None:
        # Gloo finds its own address by resolving the machine's hostname (Horovod 0.28.1 does so for
        # process sets even when HOROVOD_GLOO_IFACE is set); inside a host that must be its address.
        os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
        with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()} {ns}\n")

    def _shape(self, ns: str, dev: str) -> None:
        bits = rate_bits(self.rate)
        # The bucket must hold at least one timer tick of traffic at this rate (HZ >= 250), and a
        # few full-size (GSO) packets.
        burst = max(256 * 1024, int(bits / 8 / 250))
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            self.rate, "burst", str(burst), "latency", "100ms")

    def down(self) -> None:
        cleanup(self.tag)

    # --- running things on hosts -----------------------------------------------------------------
    def exec_args(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def launch_args(self, np: int, command: list[str], per_host: int = 1) -> list[str]:
        """The command line that starts Horovod's Gloo launcher inside host 0 (where its rendezvous
        server listens) for ``np`` workers, ``per_host`` on each host (Horovod's local ranks; the
        last host may hold fewer), running ``command``. Workers on one host talk over its loopback,
        as processes on one machine do; only traffic between hosts crosses the shaped links."""
        if per_host < 1:
            raise ValueError(f"per_host must be at least 1, got {per_host}")
        needed = -(-np // per_host)
        if needed > self.hosts:
            raise ValueError(f"np ({np}) at {per_host} per host needs {needed} hosts; the cluster "
                             f"has {self.hosts}")
        slots = [min(per_host, np - i * per_host) for i in range(needed)]
        hosts = ",".join(f"{name}:{k}" for name, k in zip(self.names, slots))
        return self.exec_args(0, [sys.executable, os.path.abspath(__file__), "launch", "--hosts",
                                  hosts, "--server", self.addresses[0], "--np", str(np),
                                  *(["--pin"] if self.pin else []), "--", *command])

    def torchrun_args(self, host: int, per_host: int, command: list[str], port: int = 29500
                      ) -> list[str]:
        """The command line that starts PyTorch's launcher (torchrun) inside host ``host`` for
        ``per_host`` workers, node ``host`` of ``self.hosts``, its rendezvous at host 0's address;
        every host runs its own (as on a real cluster). With ``pin``, on the host's cores. Gloo
        then talks over the host's ``eth0``: set ``GLOO_SOCKET_IFNAME=eth0``."""
        cores = []
        if self.pin:
            cores = ["taskset", "-c", ",".join(map(str, host_cpus(host, self.hosts)))]
        return self.exec_args(host, [*cores, sys.executable, "-m", "torch.distributed.run",
                                     f"--nnodes={self.hosts}", f"--node_rank={host}",
                                     f"--nproc_per_node={per_host}",
                                     f"--master_addr={self.addresses[0]}", f"--master_port={port}",
                                     *command])

    def torchrun(self, per_host: int, command: list[str], env: dict | None = None,
                 timeout: float | None = None) -> tuple[int, str]:
        """torchrun on every host at once (``torchrun_args``); the highest exit code and every
        host's output, host by host."""
        env = dict(os.environ if env is None else env)
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        procs = [subprocess.Popen(self.torchrun_args(h, per_host, command), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in range(self.hosts)]
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=timeout)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        return max(p.returncode for p in procs), "".join(
            f"--- host {h} ---\n{out}" for h, out in enumerate(outputs))


def launch(hosts: str, server: str, np: int, command: list[str], verbose: bool = False,
           pin: bool = False) -> None:
    """Horovod's Gloo launcher, run inside the first host: every worker is started through
    ``ip netns exec <host>`` in place of ``ssh <host>`` (and ``taskset`` onto the host's cores,
    with ``pin``); the rendezvous server listens here."""
    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.gloo_run import launch_gloo

    cwd = os.getcwd()
    order = [entry.split(":")[0] for entry in hosts.split(",")]

    def exec_command(cmd, slot_info, events):
        cores = ""
        if pin:
            cpus = host_cpus(order.index(slot_info.hostname), len(order))
            cores = f"taskset -c {','.join(map(str, cpus))} "
        wrapped = (f"ip netns exec {shlex.quote(slot_info.hostname)} {cores}sh -c "
                   f"{shlex.quote(f'cd {shlex.quote(cwd)} && {cmd}')}")
        if verbose:
            print(wrapped, flush=True)
        code = safe_shell_exec.execute(wrapped, index=slot_info.rank, events=events)
        if code != 0:
            print(f"Process {slot_info.rank} exit with status code {code}.", flush=True)
        return code, time.time()

    settings = SimpleNamespace(hosts=hosts, num_proc=np, verbose=verbose, output_filename=None,
                               elastic=False, prefix_output_with_timestamp=False)
    launch_gloo(command, exec_command, settings, ["eth0"], dict(os.environ), server)


def measure_throughput(cluster: EmulatedCluster, nbytes: int = 8 * 2**20, src: int = 0,
                       dst: int = 1) -> float:
    """Send ``nbytes`` over TCP from host ``src`` to host ``dst``; bits per second, timed by the
    receiver from the first byte to the last."""
    receiver = (
        "import socket,sys,time\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(({cluster.addresses[dst]!r}, 5201)); s.listen(1); print('ready', flush=True)\n"
        "c,_=s.accept(); n=0; t0=None\n"
        "while True:\n"
        "    b=c.recv(1<<20)\n"
        "    if not b: break\n"
        "    t0=t0 or time.perf_counter(); n+=len(b)\n"
        "print(n, time.perf_counter()-t0, flush=True)\n")
    sender = (
        "import socket,sys\n"
        f"s=socket.create_connection(({cluster.addresses[dst]!r}, 5201), timeout=60)\n"
        f"s.sendall(bytes({nbytes})); s.close()\n")
    rx = subprocess.Popen(cluster.exec_args(dst, [sys.executable, "-c", receiver]),
                          stdout=subprocess.PIPE, text=True)
    try:
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("receiver did not start")
        subprocess.run(cluster.exec_args(src, [sys.executable, "-c", sender]), check=True,
                       timeout=300)
        received, seconds = rx.communicate(timeout=300)[0].split()
    finally:
        if rx.poll() is None:
            rx.kill()
    if int(received) != nbytes:
        raise RuntimeError(f"received {received} of {nbytes} bytes")
    return nbytes * 8 / float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="build a cluster, launch a Horovod job on it, tear it down")
    run.add_argument("--hosts", type=int, default=2)
    run.add_argument("--rate", default="unshaped", help="tc rate per link, e.g. 100mbit, 1gbit")
    run.add_argument("--workers-per-host", type=int, default=1,
                     help="Horovod workers on each host (local ranks); they share its link")
    run.add_argument("--no-pin", action="store_true",
                     help="leave the workers to the scheduler instead of each host's own cores")
    run.add_argument("command", nargs=argparse.REMAINDER)
    trun = sub.add_parser("torchrun", help="build a cluster, run torchrun on every host (a DDP "
                          "job), tear it down")
    trun.add_argument("--hosts", type=int, default=2)
    trun.add_argument("--rate", default="unshaped", help="tc rate per link, e.g. 100mbit, 1gbit")
    trun.add_argument("--workers-per-host", type=int, default=1)
    trun.add_argument("--no-pin", action="store_true")
    trun.add_argument("command", nargs=argparse.REMAINDER)
    perf = sub.add_parser("iperf", help="measure a shaped link with one TCP transfer")
    perf.add_argument("--rate", default="100mbit")
    perf.add_argument("--mib", type=int, default=8)
    sub.add_parser("cleanup", help="delete every namespace this script made")
    inner = sub.add_parser("launch", help=argparse.SUPPRESS)
    inner.add_argument("--hosts", required=True)
    inner.add_argument("--server", required=True)
    inner.add_argument("--np", type=int, required=True)
    inner.add_argument("--pin", action="store_true")
    inner.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = [a for a in getattr(args, "command", []) if a != "--"] if args.cmd != "cleanup" else []

    if args.cmd == "cleanup":
        print("deleted:", " ".join(cleanup()) or "nothing")
    elif args.cmd == "launch":
        code = 0
        try:
            launch(args.hosts, args.server, args.np, command, pin=args.pin)
        except RuntimeError as e:  # a worker failed; Horovod has stopped the others
            print(e, file=sys.stderr, flush=True)
            code = 1
        sys.stdout.flush()
        os._exit(code)  # the rendezvous server's threads would keep a plain exit waiting
    elif args.cmd == "torchrun":
        with EmulatedCluster(args.hosts, args.rate, pin=not args.no_pin) as cluster:
            code, output = cluster.torchrun(args.workers_per_host, command)
        print(output, end="")
        sys.exit(code)
    elif args.cmd == "iperf":
        with EmulatedCluster(2, args.rate) as cluster:
            bps = measure_throughput(cluster, args.mib * 2**20)
        print(f"{args.rate}: measured {bps / 1e6:.1f} Mbit/s")
    else:
        with EmulatedCluster(args.hosts, args.rate, pin=not args.no_pin) as cluster:
            code = subprocess.call(cluster.launch_args(args.hosts * args.workers_per_host, command,
                                                       args.workers_per_host))
        sys.exit(code)


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    main()
