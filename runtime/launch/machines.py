"""A plan across machines: which plan devices each machine starts, checked, and the commands that start them.

A plan's device ids are ``<node>:<GPU index>`` (``baton.cluster``): the node is a machine and the index the
GPU it runs on. Every machine runs the same command naming the plan, the rendezvous endpoint and its node
(``--node``, else its hostname); it starts one process per plan device of that node, the process of local
index j on the node's j-th device in GPU-index order. The machines meet through torchelastic's own agent
and c10d rendezvous (``torch.distributed.launcher.api.elastic_launch``; torchelastic gives machines
different process counts a rank range each). torchelastic numbers ranks in the order machines joined, so a
process takes its plan rank after the rendezvous, from its node and local index
(``runtime.launch.plan_ranks``), and every group the runtime builds follows the plan.

Before any process starts, the machine checks what it has against the plan: every plan device's GPU exists,
is of the catalog type the cluster names (``catalog_gpu`` of its CUDA name and memory; CPU processes are
``cpu``) and holds its predicted peak memory (the pre-flight check on this machine's devices alone). A
mismatch is one line naming the machine, the GPU index, what the plan expected and what was found.

The equivalent torchrun line (same checks in every process; the launcher's own refusal before start is
lost, and ``--elastic`` needs the launcher):

    BATON_MACHINE=m1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes N --nproc-per-node <devices of m1> \\
        --rdzv-backend c10d --rdzv-endpoint H:P -m cli train --plan plan.json ...
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from baton.errors import BatonError
from baton.plan import Plan

ENDPOINT_DEFAULT_PORT = 29500
MACHINE_ENV = "BATON_MACHINE"
"""The node this machine is, for the processes of a run across machines: set by the machine launcher, or by hand in
front of torchrun (``torchrun_command``)."""
REPORT_DIR_ENV = "BATON_MACHINE_REPORTS"
"""Set by the launcher: where each process writes the one line that ended it, for the launcher to print."""
ELASTIC_ENV = "BATON_ELASTIC"
"""Set by the launcher with --elastic: processes re-plan for the machines present after a restart."""
REJOIN_WAIT_MAX_S = 30.0
"""The longest an elastic rendezvous waits for missing machines once enough are present (torch's default); a third
of --timeout when that is shorter."""
KEEP_ALIVE_S = 2
"""Seconds between a machine's heartbeats to the rendezvous; three missed ones and it is taken for lost."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """One plan node and the plan devices it runs."""

    node: str
    """The node's name in the plan's device ids."""
    devices: tuple[str, ...]
    """Its plan device ids in GPU-index order: local process j runs ``devices[j]``."""
    ranks: tuple[int, ...]
    """The plan rank of each device (its place in ``plan.device_ids()``)."""
    gpus: tuple[int, ...]
    """The GPU index of each device on this machine."""


def split_device_id(device_id: str) -> tuple[str, int]:
    """(node, GPU index) of a plan device id ``<node>:<index>``."""
    node, _, index = device_id.rpartition(":")
    if not node or not index.isdigit():
        raise BatonError(f"device id '{device_id}' is not '<node>:<GPU index>', so no machine can run it", field="--plan")
    return node, int(index)


def machines_of(plan: Plan) -> dict[str, Machine]:
    """Every node of the plan, in the order its first device comes in rank order."""
    by_node: dict[str, list[tuple[int, str, int]]] = {}
    for rank, device_id in enumerate(plan.device_ids()):
        node, gpu = split_device_id(device_id)
        by_node.setdefault(node, []).append((gpu, device_id, rank))
    out = {}
    for node, entries in by_node.items():
        entries.sort()
        out[node] = Machine(node=node, devices=tuple(d for _, d, _ in entries), ranks=tuple(r for _, _, r in entries),
                            gpus=tuple(g for g, _, _ in entries))
    return out


def find_machine(plan: Plan, node: str | None, hostname: str | None = None) -> Machine:
    """This machine's part of the plan: ``--node`` when given, else the node named like the hostname (or its
    first label)."""
    machines = machines_of(plan)
    names = ", ".join(machines)
    if node is not None:
        if node not in machines:
            raise BatonError(f"node '{node}' runs no device of the plan (its nodes: {names})", field="--node")
        return machines[node]
    host = hostname if hostname is not None else socket.gethostname()
    for candidate in (host, host.split(".")[0]):
        if candidate in machines:
            return machines[candidate]
    raise BatonError(f"this machine's hostname '{host}' is no node of the plan ({names}); pass --node", field="--node")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` of --rdzv-endpoint (port 29500 when omitted)."""
    host, sep, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not sep:
        host, port = text, str(ENDPOINT_DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BatonError(f"expected HOST:PORT such as node1:29500, got '{text}'", field="--rdzv-endpoint")
    return host, int(port)


# --- what the machine has, against the plan -------------------------------------------------------


def check_devices(plan: Plan, machine: Machine, *, device: str, cluster=None, cuda: list[tuple[str, int]] | None = None) -> str:
    """The kind of process this machine runs ('cuda' or 'cpu'), after checking its devices against the plan.

    ``device`` is --device (auto, cpu or cuda); ``cuda`` the (name, total bytes) of this machine's GPUs (default:
    asked of torch); ``cluster`` the plan's cluster (None: the catalog types are not known, only indices are
    checked). CPU processes stand in for GPUs only when asked to (--device cpu)."""
    from runtime.launch.devices import GIB, catalog_gpu

    if cuda is None:
        cuda = _local_gpus()
    expected = {d: cluster.device(d).gpu.name for d in machine.devices} if cluster is not None else {}
    wants_gpu = any(t != "cpu" for t in expected.values())
    if device == "cpu" or (device == "auto" and not cuda and not wants_gpu):
        return "cpu"
    for device_id, index in zip(machine.devices, machine.gpus):
        want = expected.get(device_id)
        if index >= len(cuda):
            found = f"{len(cuda)} CUDA GPU(s)" if cuda else "no CUDA GPU"
            raise BatonError(f"machine {machine.node}, GPU {index}: the plan runs {device_id}"
                             + (f" ({want})" if want else "") + f" there but this machine has {found}"
                             + ("; pass --device cpu to run CPU processes in their place" if not cuda else ""),
                             field="--node")
        name, total = cuda[index]
        got = catalog_gpu(name, total)
        if want is not None and want != "cpu" and got != want:
            raise BatonError(f"machine {machine.node}, GPU {index}: the plan expects {want} for {device_id}, found "
                             f"{name} ({total / GIB:.1f} GiB" + (f", catalog {got})" if got else ", not in the catalog)"),
                             field="--node")
    return "cuda"


def _local_gpus() -> list[tuple[str, int]]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [(p.name, int(p.total_memory)) for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]


def machine_preflight(plan: Plan, machine: Machine, kind: str, *, cluster_path=None, profiles_dir=None):
    """The pre-flight memory check of this machine's devices on what this machine has."""
    from runtime.launch.devices import cpu_capacity, cuda_capacity, preflight

    caps: list = [None] * len(plan.device_ids())
    for rank, gpu in zip(machine.ranks, machine.gpus):
        where, cap = cuda_capacity(gpu) if kind == "cuda" else cpu_capacity(len(machine.devices))
        caps[rank] = (f"machine {machine.node}'s {where}", cap)
    return preflight(plan, caps, cluster_path=cluster_path, profiles_dir=profiles_dir, ranks=list(machine.ranks))


def interface_of(machine: Machine, option: str | None, cluster) -> str | None:
    """The network interface this machine's processes talk through: --interface, else the cluster's ``interface``
    of the node, else None (the libraries choose)."""
    if option:
        return option
    return (cluster.interfaces.get(machine.node) if cluster is not None else None) or None


def interface_env(interface: str | None) -> dict[str, str]:
    """The variables that make gloo and NCCL use ``interface``."""
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}


def interface_address(interface: str) -> str:
    """The IPv4 address of a local interface (the address this machine's processes are known by)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))  # SIOCGIFADDR
        except OSError:
            raise BatonError(f"this machine has no network interface '{interface}' with an IPv4 address",
                             field="--interface") from None
    return socket.inet_ntoa(packed[20:24])


# --- starting the machine's processes --------------------------------------------------------------


def launch_config(plan: Plan, machine: Machine, endpoint: str, *, run_id: str, elastic: bool, timeout_s: float,
                  local_addr: str | None = None, log_dir: str | None = None):
    """torchelastic's ``LaunchConfig`` for this machine: all the plan's machines (``--elastic``: at least one, the
    run restarting on the machines left when one is lost), c10d rendezvous at ``endpoint``, one process per plan
    device of the node."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    n = len(machines_of(plan))
    host = parse_endpoint(endpoint)[0]
    # How long a rendezvous waits for machines: the first for all of them (the run starts when the last joins),
    # a restart after a loss for the lost ones to come back before going on without them. A lost machine leaves the
    # rendezvous once its heartbeats stop (KEEP_ALIVE_S times 3), and only then can the next round start.
    wait = min(REJOIN_WAIT_MAX_S, timeout_s / 3)
    return LaunchConfig(
        min_nodes=1 if elastic else n, max_nodes=n, nproc_per_node=len(machine.devices), run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": max(int(timeout_s + 2 * wait + 3 * KEEP_ALIVE_S), 1),
                      "last_call_timeout": max(int(wait), 1), "close_timeout": max(int(wait), 1),
                      "read_timeout": max(int(timeout_s), 1), "keep_alive_interval": KEEP_ALIVE_S,
                      "keep_alive_max_attempt": 3, "is_host": hosts_endpoint(host, local_addr)},
        max_restarts=n - 1 if elastic else 0, monitor_interval=0.5, start_method="spawn", local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir), shutdown_timeout=min(int(timeout_s), 30))


def hosts_endpoint(host: str, local_addr: str | None) -> bool:
    """Whether this machine holds the rendezvous store: the endpoint is its interface's address, or names it the
    way torchelastic recognises (its hostname, one of its addresses, localhost)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return host == local_addr or _matches_machine_hostname(host)


def run_machine(plan: Plan, machine: Machine, argv: list[str], *, endpoint: str, run_id: str, elastic: bool,
                timeout_s: float, interface: str | None) -> None:
    """Start this machine's processes (``python -m cli train`` with ``argv``) under torchelastic's agent and wait
    for the run to end; a failure is raised as the one line that explains it (the lost machine first)."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from runtime.launch.processes import run_directory, sweep_stale_run_directories

    local_addr = interface_address(interface) if interface else None
    sweep_stale_run_directories()
    run_dir = run_directory()
    reports = run_dir / "reports"
    reports.mkdir()
    # A fresh store per rendezvous round, hosted by the process torchelastic ranks 0: a process's keys never meet
    # those of an earlier round, whichever machines came back.
    # The processes' C++ warnings (a store whose holder left, with its stack) would bury the one line that matters.
    env = {MACHINE_ENV: machine.node, REPORT_DIR_ENV: str(reports), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
           **({ELASTIC_ENV: "1"} if elastic else {}), **interface_env(interface)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # torchelastic logs every restart, failure and signal at length; the one line below says what matters. Its modules
    # set their loggers' own levels, so the parent's level alone does not reach them.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = launch_config(plan, machine, endpoint, run_id=run_id, elastic=elastic, timeout_s=timeout_s,
                           local_addr=local_addr, log_dir=str(run_dir / "logs"))
    from runtime.launch.processes import Terminated

    try:
        elastic_launch(config, sys.executable)("-m", "cli", "train", *argv)
    except SignalException as exc:  # Ctrl-C or SIGTERM: the agent passed it on to the processes and waited for them
        stop = _stop_report(reports)
        raise (Terminated if exc.sigval == signal.SIGTERM else KeyboardInterrupt)(
            stop[1] if stop else f"machine {machine.node}'s processes were stopped") from None
    except ChildFailedError:
        raise BatonError(_first_report(reports) or f"machine {machine.node}: its processes failed without a report") from None
    except Exception as exc:  # the rendezvous: no store at the endpoint, or machines that never came
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise BatonError(f"machine {machine.node} could not meet the others at {endpoint}: {line}",
                         field="--rdzv-endpoint") from None
    else:
        # A stop every machine agreed on (Ctrl-C or SIGTERM on another machine, or on this one's processes alone):
        # they saved and left without failing, so an elastic agent restarts nothing; the run still ends interrupted.
        stop = _stop_report(reports)
        if stop:
            raise (Terminated if stop[0] == "terminated" else KeyboardInterrupt)(stop[1])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(run_dir, ignore_errors=True)


STOP_KINDS = ("interrupted", "terminated")
"""Report kinds of a process that stopped on Ctrl-C or SIGTERM, beside ``error``."""


def _reports(reports: Path) -> list[tuple[str, str]]:
    """(kind, line) of every process's report, in the order they were written."""
    out = []
    for path in sorted(reports.glob("*.txt"), key=lambda p: p.stat().st_mtime):
        kind, _, line = path.read_text().strip().partition("\t")
        if line:
            out.append((kind, line.splitlines()[0]))
    return out


def _first_report(reports: Path) -> str | None:
    """The line of the process that explains the failure: one naming a lost machine, else the first error written,
    else the first line."""
    lines = _reports(reports)
    lost = [ln for kind, ln in lines if kind == "error" and " was lost" in ln]
    errors = [ln for kind, ln in lines if kind == "error"]
    return (lost or errors or [ln for _, ln in lines] or [None])[0]


def _stop_report(reports: Path) -> tuple[str, str] | None:
    """(kind, line) of a stop: the report of a process that saved at the stop (it names the checkpoint), else any."""
    stops = [(kind, ln) for kind, ln in _reports(reports) if kind in STOP_KINDS]
    saved = [s for s in stops if "saved" in s[1]]
    return (saved or stops or [None])[0]


def _report_path() -> Path | None:
    where = os.environ.get(REPORT_DIR_ENV)
    return Path(where, f"local-{os.environ.get('LOCAL_RANK', '0')}.txt") if where else None


def clear_report() -> None:
    """A process starting: what its local rank reported in an earlier round (torchelastic stops every process to
    take a returning machine in, and they save as at a stop) no longer says how the run ends."""
    path = _report_path()
    if path is not None:
        path.unlink(missing_ok=True)


def write_report(line: str, kind: str = "error") -> bool:
    """Under the machine launcher: leave the line that ends this process (``kind``: 'error' or one of
    ``STOP_KINDS``) for the launcher to print (True), rather than every process of every machine printing its own."""
    path = _report_path()
    if path is None:
        return False
    try:
        path.write_text(f"{kind}\t{line}\n")
    except OSError:
        return False
    return True


# --- the commands that start a plan ------------------------------------------------------------------


def machine_commands(plan: Plan, plan_path: str, endpoint: str, extra: list[str] = ()) -> list[tuple[Machine, str]]:
    """(machine, command) for every machine of the plan: the same command, each with its --node."""
    tail = " ".join(shlex.quote(a) for a in extra)
    out = []
    for machine in machines_of(plan).values():
        cmd = (f"baton train --plan {shlex.quote(str(plan_path))} --node {shlex.quote(machine.node)} "
               f"--rdzv-endpoint {shlex.quote(endpoint)}" + (f" {tail}" if tail else ""))
        out.append((machine, cmd))
    return out


def torchrun_command(plan: Plan, machine: Machine, plan_path: str, endpoint: str, extra: list[str] = ()) -> str:
    """The torchrun line that does what ``baton train --node`` does on ``machine`` (without --elastic). The node goes
    in ``BATON_MACHINE``: torchrun reads every option of the script's too, and takes ``--node`` for an abbreviation
    of its ``--node-rank``."""
    n = len(machines_of(plan))
    tail = " ".join(shlex.quote(a) for a in extra)
    return (f"{MACHINE_ENV}={shlex.quote(machine.node)} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes {n} "
            f"--nproc-per-node {len(machine.devices)} --rdzv-backend c10d --rdzv-endpoint {shlex.quote(endpoint)} "
            f"-m cli train --plan {shlex.quote(str(plan_path))}" + (f" {tail}" if tail else ""))


def slurm_script(plan: Plan, plan_path: str, *, port: int = ENDPOINT_DEFAULT_PORT, extra: list[str] = ()) -> str:
    """A Slurm batch script: one task per machine, each taking its node from the allocation's order (the plan's
    nodes in order onto ``SLURM_NODEID``), the rendezvous on the allocation's first host."""
    machines = list(machines_of(plan).values())
    tail = " ".join(shlex.quote(a) for a in extra)
    nodes = " ".join(shlex.quote(m.node) for m in machines)
    gpus = max(len(m.devices) for m in machines)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes={len(machines)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus}",
        "# Machine k of the allocation runs plan node k of NODES: give --nodelist in this order to put every node",
        "# on the hardware it was planned for. The rendezvous is on the allocation's first host.",
        "export HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        "srun --kill-on-bad-exit=1 bash -c " + shlex.quote(
            f"NODES=({nodes}); exec baton train --plan {shlex.quote(str(plan_path))} --node \"${{NODES[$SLURM_NODEID]}}\" "
            f"--rdzv-endpoint \"$HEAD:{port}\"" + (f" {tail}" if tail else "")),
        "",
    ])


def default_run_id(label: str, endpoint: str) -> str:
    """A run id every machine derives alike from what they were all given (the plan's cluster, the endpoint)."""
    import hashlib

    return "baton-" + hashlib.sha256(f"{label}|{endpoint}".encode()).hexdigest()[:12]



def runs_plan_rank_zero(plan: Plan) -> bool | None:
    """Under the machine launcher, whether this process runs the plan's rank 0 (the one that reports the run's
    progress); None elsewhere."""
    node = os.environ.get(MACHINE_ENV)
    if node is None or "LOCAL_RANK" not in os.environ:
        return None
    machine = machines_of(plan).get(node)
    local = int(os.environ["LOCAL_RANK"])
    return machine is not None and local < len(machine.ranks) and machine.ranks[local] == 0
