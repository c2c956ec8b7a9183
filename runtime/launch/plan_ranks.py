"""A process started on a machine takes its plan rank after the rendezvous.

torchelastic numbers processes in the order machines joined (``RANK``). A process of machine ``--node m`` with
local index j runs the plan's device ``machines_of(plan)[m].devices[j]`` and so the plan rank of that device.
After the rendezvous every process writes its claim (node, local index, address) into the round's store and
reads everyone's: two machines that started as the same node, a node without a machine or a process count the
plan does not have is one line before any process group exists. The default group is then made on the same
store (its own prefix) with the plan rank, so every group the runtime builds follows the plan, whatever order
machines joined in.

Under ``--elastic`` a round with machines missing re-plans: the process torchelastic ranks 0 solves for the
devices of the machines present (``replan``, bounded by ``REPLAN_TIME_LIMIT_S``) and shares the plan through
the store; processes whose device the new plan leaves out stop. The run resumes from the newest intact
checkpoint in --save-dir (``runtime.train.checkpoint``; they resume under any plan).
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta

from baton.errors import BatonError
from baton.plan import Plan
from runtime.launch.machines import ELASTIC_ENV, find_machine, interface_address, machines_of, split_device_id

REPLAN_TIME_LIMIT_S = 20.0
"""How long the solver may take to re-plan for the machines left (it answers in seconds on such clusters)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Seat:
    """Where this process sits: its device, its plan rank and the plan the run follows."""

    node: str
    """This machine's plan node."""
    device_id: str
    """The plan device this process runs."""
    gpu: int
    """Its GPU index on this machine."""
    rank: int
    """Its plan rank (the default group's rank)."""
    plan: Plan
    """The plan the run follows: the given one, or the one re-solved for the machines present."""
    dropped: tuple[str, ...] = ()
    """The plan's nodes without a machine in this round (re-planned without them)."""
    claims: tuple = ()
    """Every process's claim of this round (node, local index, address), by torchelastic rank."""
    store: object = None
    """The round's store (the default group's lives under it)."""


def elastic() -> bool:
    return os.environ.get(ELASTIC_ENV) == "1"


def _store(timeout_s: float):
    """This round's store, shared by all processes: a fresh TCPStore hosted by torchelastic's rank 0 (the machine
    launcher asks torchelastic for one per round), or the agent's shared one keyed by the restart."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size=int(os.environ["WORLD_SIZE"]),
                          is_master=not shared and os.environ["RANK"] == "0", timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "0"
    return dist.PrefixStore(f"baton/{restart}", store)


def _address() -> str:
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return interface_address(interface.split(",")[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def check_claims(plan: Plan, claims: list[dict], *, allow_missing: bool) -> list[str]:
    """The plan nodes present (in plan order) after checking every claim: each node at most one machine, and (unless
    ``allow_missing``) every node one."""
    machines = machines_of(plan)
    by_node: dict[str, set[str]] = {}
    for c in claims:
        by_node.setdefault(c["node"], set()).add(c["machine"])
    for node, who in by_node.items():
        if len(who) > 1:
            missing = [n for n in machines if n not in by_node]
            raise BatonError(f"machines {' and '.join(sorted(who))} both started as --node {node}"
                             + (f"; no machine started as {', '.join(missing)}" if missing else "")
                             + ": give every machine its own node", field="--node")
    present = [n for n in machines if n in by_node]
    missing = [n for n in machines if n not in by_node]
    if missing and not allow_missing:
        raise BatonError(f"no machine started as --node {', '.join(missing)} (the plan runs "
                         f"{', '.join(d for n in missing for d in machines[n].devices)} there)", field="--node")
    return present


def take_seat(plan: Plan, node: str | None, *, backend: str, timeout_s: float, cluster_path=None, profiles_dir=None,
              notice=lambda line: None) -> Seat | None:
    """Claim this process's plan device, check every machine's claim, re-plan if machines are missing (--elastic)
    and join the default group with the plan rank. None: the re-solved plan leaves this process's device out."""
    import torch.distributed as dist

    machine = find_machine(plan, node)
    local, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world != len(machine.devices):
        raise BatonError(f"machine {machine.node} started {local_world} process(es) but the plan runs {len(machine.devices)} "
                         f"device(s) there ({', '.join(machine.devices)}): start one per device", field="--nproc-per-node")
    store = _store(timeout_s)
    rank_here, world_here = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    who = f"{socket.gethostname()} ({_address()})" if "GLOO_SOCKET_IFNAME" in os.environ else socket.gethostname()
    claim = {"node": machine.node, "local": local, "machine": who, "address": _address()}
    store.set(f"claim/{rank_here}", json.dumps(claim))
    keys = [f"claim/{r}" for r in range(world_here)]
    store.wait(keys, timedelta(seconds=timeout_s))
    claims = [json.loads(store.get(k)) for k in keys]
    # torchelastic's rank 0 holds the store: it leaves (on a refusal too) only once every process has read the claims.
    store.add("claims-read", 1)
    if rank_here == 0:
        deadline = time.monotonic() + timeout_s
        while store.add("claims-read", 0) < world_here and time.monotonic() < deadline:
            time.sleep(0.05)
    present = check_claims(plan, claims, allow_missing=elastic())
    dropped = tuple(n for n in machines_of(plan) if n not in present)
    run_plan = plan if not dropped else _shared_plan(store, plan, present, rank_here, timeout_s=timeout_s,
                                                     cluster_path=cluster_path, profiles_dir=profiles_dir, notice=notice)
    device_id = machine.devices[local]
    ids = run_plan.device_ids()
    if device_id not in ids:
        if rank_here == 0:  # it holds the store the others' groups live in: it leaves when the run is over
            while not store.check([RUN_OVER]):
                time.sleep(1.0)
        return None
    rank = ids.index(device_id)
    dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=len(ids),
                            timeout=timedelta(seconds=timeout_s))
    return Seat(node=machine.node, device_id=device_id, gpu=machine.gpus[local], rank=rank, plan=run_plan, dropped=dropped,
                claims=tuple(claims), store=store)


RUN_OVER = "run-over"
"""The key plan rank 0 sets when its run ends, however it ends."""


def release(seat: Seat) -> None:
    """Plan rank 0 at the end of its run: a process holding the store without a device of its own may now leave."""
    if seat.rank == 0 and seat.store is not None:
        try:
            seat.store.set(RUN_OVER, "1")
        except Exception:
            pass  # the store's holder is gone already


# --- re-planning for the machines left ------------------------------------------------------------


def replan(plan: Plan, present: list[str], *, cluster_path=None, profiles_dir=None,
           time_limit_s: float = REPLAN_TIME_LIMIT_S) -> Plan:
    """The best plan of the same model and global batch for the plan's devices on the ``present`` nodes (so the loss
    curve continues: the same samples per step)."""
    from baton.profile import ProfileSet
    from runtime.launch.devices import resolve_cluster
    from solver.search import search

    cluster, _ = resolve_cluster(plan, cluster_path)
    kept = {d for d in plan.device_ids() if split_device_id(d)[0] in present}
    devices = tuple(d for d in cluster.devices if d.id in kept)
    nodes = {d.node for d in devices}
    sub = replace(cluster, devices=devices, intra_links={n: l for n, l in cluster.intra_links.items() if n in nodes},
                  nics={n: l for n, l in cluster.nics.items() if n in nodes})
    profiles = ProfileSet(plan.model, directory=profiles_dir, derive_missing=lambda *a, **k: None)
    t0 = time.perf_counter()
    result = search(plan.model, sub, profiles, global_batch=plan.global_batch, time_limit=time_limit_s, threads=1,
                    log=lambda line: None)
    dropped = sorted({split_device_id(d)[0] for d in plan.device_ids()} - set(present))
    return result.plan.with_info(replanned_without=dropped, replan_s=round(time.perf_counter() - t0, 2))


def _shared_plan(store, plan: Plan, present: list[str], rank_here: int, *, timeout_s: float, cluster_path, profiles_dir,
                 notice) -> Plan:
    """One process (torchelastic's rank 0) solves and shares the plan through the store; the rest read it."""
    from baton.plan import from_dict

    if rank_here == 0:
        try:
            new = replan(plan, present, cluster_path=cluster_path, profiles_dir=profiles_dir)
        except BatonError as exc:
            store.set("replan", json.dumps({"error": str(exc)}))
            raise
        store.set("replan", json.dumps({"plan": new.to_dict()}))
        machines = machines_of(plan)
        lost = [n for n in machines if n not in present]
        notice(f"re-planned without machine(s) {', '.join(lost)} (devices "
               f"{', '.join(d for n in lost for d in machines[n].devices)}): {len(new.device_ids())} device(s) on "
               f"{', '.join(present)}, {len(new.pipelines)} pipeline(s) of {new.num_stages} stage(s), solved in "
               f"{new.info.get('replan_s')} s")
    store.wait(["replan"], timedelta(seconds=timeout_s + REPLAN_TIME_LIMIT_S * 2))
    got = json.loads(store.get("replan"))
    if "error" in got:
        raise BatonError(f"re-planning without the lost machine(s) failed: {got['error']}", field="--elastic")
    return from_dict(got["plan"], source="<re-plan>")


# --- naming a lost machine ----------------------------------------------------------------------------

_ADDRESS = re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3})\b")


def lost_machine_line(seat: Seat, error: str) -> str | None:
    """'machine m2 (devices m2:0, m2:1 at 10.0.0.3) was lost: ...' when ``error`` (a failed collective or
    receive) names the address of another machine's process; None otherwise."""
    machines = machines_of(seat.plan)
    mine = next((c["address"] for c in seat.claims if c["node"] == seat.node), None)
    for address in _ADDRESS.findall(error):
        if address == mine:
            continue
        nodes = sorted({c["node"] for c in seat.claims if c["address"] == address})
        if nodes:
            devices = ", ".join(d for n in nodes for d in (machines[n].devices if n in machines else ()))
            # gloo's own words, without its source location: 'Connection closed by peer [10.0.0.3]:39126'
            reason = re.sub(r"\[/[^\]]*\]\s*", "", error.split(":", 1)[-1]).strip().split(". ")[0][:120]
            return (f"machine {' and '.join(nodes)} (devices {devices} at {address}) was lost: {reason}; "
                    f"the processes of machine {seat.node} stopped")
    return None

