"""Several "machines" on this one host, for the tests of runs across machines.

Every machine is a network namespace of its own (``unshare -n``) holding its loopback and one interface,
``bm<k>``: one end of a veth pair whose other end sits on a bridge in a hub namespace, also made here. Machine
k has address ``127.77.0.<k+2>`` on that interface and nothing else: addresses of the loopback range, which
exist nowhere outside these namespaces (each machine's ``lo`` keeps only 127.0.0.1, so the rest of 127/8
routes over the veth, which ``route_localnet`` allows). The hub has no other interface, so no packet can reach
any address outside the namespaces made here. A machine's bandwidth is shaped with ``tc`` (a token
bucket, ``tbf``; ``netem`` does not exist on these machines, so no latency is added) both ways: its interface's
egress and the hub end's egress towards it, as a NIC of that rate would.

A machine runs commands through ``nsenter`` into its namespace, each in a session of its own; ``kill`` SIGKILLs
every process in the machine's namespace at once (its whole process tree, whatever sessions torchelastic gave
its workers), and ``close`` does that to every namespace, so a test leaves nothing running. Root is needed;
``unavailable()`` says why not where it is missing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "127.77.0"
HOLD_S = 900
"""How long a namespace's holder process lives at most (a test that forgets ``close`` frees it by then)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why machines cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (unshare -n)"
    for tool in ("unshare", "nsenter", "ip", "tc"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"needs '{tool}'"
    probe = _run("unshare", "-n", "sh", "-c", "ip link set lo up && ip link add vx0 type veth peer name vx1 && "
                 "ip link add hubbr type bridge && tc qdisc add dev vx0 root tbf rate 100mbit burst 32kb latency 100ms",
                 check=False)
    if probe.returncode != 0:
        return f"cannot create namespaces, veth pairs, bridges or tbf here: {probe.stderr.strip()[:200]}"
    return None


def _netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _pids_in(netns: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == netns:
                    out.append(int(entry))
            except OSError:
                pass
    return out


@dataclass
class Machine:
    """One machine: its namespace's holder process, interface and address."""

    index: int
    holder: subprocess.Popen
    netns: str
    interface: str
    address: str
    procs: list = field(default_factory=list)

    def popen(self, args: list[str], *, env: dict | None = None, cwd=None, log: Path | None = None) -> subprocess.Popen:
        """Start ``args`` inside this machine (its own session; stdout to ``log`` and stderr to ``log`` + '.err', or
        captured)."""
        out = open(log, "w") if log is not None else subprocess.PIPE
        err = open(f"{log}.err", "w") if log is not None else subprocess.PIPE
        p = subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "-n", "--", *args], env=env, cwd=cwd,
                             stdout=out, stderr=err, text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def pids(self) -> list[int]:
        return _pids_in(self.netns)

    def kill(self) -> None:
        """SIGKILL every process of this machine at once (stopped first, so none can start another meanwhile)."""
        pids = [p for p in self.pids() if p != self.holder.pid]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


class Machines:
    """``count`` machines joined by a bridge; ``rates_mbit`` (one per machine, None: unshaped) their NICs."""

    def __init__(self, count: int, rates_mbit: list[float | None] | None = None):
        self.hub = subprocess.Popen(["unshare", "-n", "sleep", str(HOLD_S)], start_new_session=True)
        self.machines: list[Machine] = []
        try:
            self._wait_for_namespace(self.hub)
            self._hub("ip", "link", "set", "lo", "up")
            self._hub("ip", "link", "add", "br0", "type", "bridge")
            self._hub("ip", "link", "set", "br0", "up")
            for k in range(count):
                self.machines.append(self._machine(k, (rates_mbit or [None] * count)[k]))
        except BaseException:
            self.close()
            raise

    def _wait_for_namespace(self, holder: subprocess.Popen) -> None:
        mine = _netns(os.getpid())
        deadline = time.monotonic() + 10
        while _netns(holder.pid) == mine:
            if time.monotonic() > deadline or holder.poll() is not None:
                raise RuntimeError("unshare -n did not give its process a namespace of its own")
            time.sleep(0.02)

    def _hub(self, *cmd: str) -> None:
        _run("nsenter", "-t", str(self.hub.pid), "-n", "--", *cmd)

    def _machine(self, k: int, rate_mbit: float | None) -> Machine:
        holder = subprocess.Popen(["unshare", "-n", "sleep", str(HOLD_S)], start_new_session=True)
        self._wait_for_namespace(holder)
        interface, address = f"bm{k + 1}", f"{SUBNET}.{k + 2}"
        self._hub("ip", "link", "add", f"hub{k + 1}", "type", "veth", "peer", "name", interface, "netns", str(holder.pid))
        self._hub("ip", "link", "set", f"hub{k + 1}", "master", "br0", "up")
        inside = ["nsenter", "-t", str(holder.pid), "-n", "--"]
        for cmd in (["ip", "link", "set", "lo", "up"],
                    # lo answers for all of 127/8 by default: keep only 127.0.0.1 there, so the other machines'
                    # loopback-range addresses route over the veth.
                    ["ip", "addr", "del", "127.0.0.1/8", "dev", "lo"], ["ip", "addr", "add", "127.0.0.1/32", "dev", "lo"],
                    ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"],
                    ["sysctl", "-qw", f"net.ipv4.conf.{interface}.route_localnet=1"],
                    ["ip", "addr", "add", f"{address}/24", "dev", interface], ["ip", "link", "set", interface, "up"]):
            _run(*inside, *cmd)
        if rate_mbit is not None:
            # The bucket refills on kernel timers; with a bucket smaller than what the rate sends between two
            # ticks (up to 4 ms on a coarse-timer kernel), it caps the link below its rate (a CI host measured
            # 74% of 400 Mbit/s with 32 KiB). 4 ms of traffic stays below the smallest message timed between
            # machines (256 KiB at 400 Mbit/s), so the bucket's head start lands in the fit's latency, not its
            # bandwidth.
            burst_kib = max(32, int(rate_mbit * 1e6 / 8 * 0.004 / 1024))
            shape = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kib}kb", "latency", "2000ms"]
            _run(*inside, "tc", "qdisc", "add", "dev", interface, *shape)
            self._hub("tc", "qdisc", "add", "dev", f"hub{k + 1}", *shape)
        return Machine(index=k, holder=holder, netns=_netns(holder.pid), interface=interface, address=address)

    def leftovers(self) -> list[int]:
        """Processes still in any namespace made here, besides the holders."""
        holders = {m.holder.pid for m in self.machines} | {self.hub.pid}
        namespaces = [m.netns for m in self.machines] + ([_netns(self.hub.pid)] if self.hub.poll() is None else [])
        return [p for ns in namespaces for p in _pids_in(ns) if p not in holders]

    def close(self) -> None:
        """Kill everything in every namespace made here, holders last (the namespaces go with them)."""
        for m in self.machines:
            m.kill()
        for holder in [m.holder for m in self.machines] + [self.hub]:
            if holder.poll() is None:
                holder.kill()
            holder.wait(10)

    def __enter__(self) -> "Machines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
