"""``baton train --node``: this machine's part of a run across machines, launcher side and process side.

``launch_here`` runs in the command the user starts on a machine: it checks the machine against the plan (its
GPUs' types and memory, the pre-flight memory check of its devices) before anything starts, then hands over to
torchelastic's agent (``runtime.launch.machines.run_machine``), which starts ``baton train`` once per plan device of
the node. ``join`` runs in each of those processes: it takes the plan rank after the rendezvous
(``runtime.launch.plan_ranks``), re-plans under --elastic when machines are missing and returns what the rank
needs to train. ``ended`` turns whatever ends a process into the one line its machine's launcher prints.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from baton.errors import BatonError
from runtime.launch.machines import (MACHINE_ENV, check_devices, clear_report, find_machine, interface_address,
                                     interface_of, machine_preflight, parse_endpoint, run_machine, write_report)
from runtime.launch.plan_ranks import Seat, elastic, lost_machine_line, take_seat


def on_machine(cfg) -> bool:
    """Whether this run is one machine's part of a run across machines (--rdzv-endpoint or --node, or a process the
    machine launcher started)."""
    return bool(cfg.rdzv_endpoint or cfg.node) or MACHINE_ENV in os.environ


def _cluster(cfg):
    from runtime.launch.devices import resolve_cluster

    cluster, note = resolve_cluster(cfg.plan, cfg.cluster_path)
    return None if note else cluster


def launch_here(cfg, config_file: Path, *, notice=lambda line: None, checked: dict | None = None) -> None:
    """Check this machine against the plan and run its processes (each ``baton train --config config_file``)."""
    from runtime.launch.machines import default_run_id

    if not cfg.rdzv_endpoint:
        raise BatonError("needs --rdzv-endpoint HOST:PORT, where the machines meet (or start the run under torchrun)",
                         field="--node")
    parse_endpoint(cfg.rdzv_endpoint)
    if cfg.elastic and not cfg.save_dir:
        raise BatonError("needs --save-dir, on storage every machine sees: the run resumes from its checkpoints",
                         field="--elastic")
    machine = find_machine(cfg.plan, cfg.node)
    cluster = _cluster(cfg)
    kind = check_devices(cfg.plan, machine, device=cfg.device, cluster=cluster)
    pre = machine_preflight(cfg.plan, machine, kind, cluster_path=cfg.cluster_path, profiles_dir=cfg.profiles_dir)
    if checked is not None:
        checked["preflight"] = pre
    interface = interface_of(machine, cfg.interface, cluster)
    if interface and not cfg.interface:
        try:
            interface_address(interface)
        except BatonError:
            raise BatonError(f"machine {machine.node} has no network interface '{interface}' (the cluster file's interface "
                             f"of node {machine.node}): is this machine {machine.node}? Else pass --interface",
                             source=str(cfg.cluster_path or cluster.source), field="interface") from None
    notice(f"machine {machine.node}: {len(machine.devices)} process(es) for {', '.join(machine.devices)} "
           f"({'GPUs ' + ', '.join(map(str, machine.gpus)) if kind == 'cuda' else 'CPU processes'}"
           + (f", network {interface}" if interface else "") + f"), meeting the others at {cfg.rdzv_endpoint}")
    run_machine(cfg.plan, machine, ["--config", str(config_file)], endpoint=cfg.rdzv_endpoint,
                run_id=default_run_id(str(cfg.plan.cluster), cfg.rdzv_endpoint), elastic=cfg.elastic,
                timeout_s=cfg.timeout_s, interface=interface)


def join(cfg, prepare, notice=lambda line: None):
    """(cfg, seat, device, pre-flight) of this process after the rendezvous: the plan it runs (re-solved under --elastic when
    machines are missing, resuming from the newest checkpoint, which ``prepare(cfg, notice)``, the launcher's,
    resolves), its plan rank and its device; None when the re-solved plan leaves its device out."""
    clear_report()
    node = cfg.node or os.environ.get(MACHINE_ENV)
    machine = find_machine(cfg.plan, node)
    cluster = _cluster(cfg)
    kind = check_devices(cfg.plan, machine, device=cfg.device, cluster=cluster)
    backend = "nccl" if kind == "cuda" else "gloo"
    seat = take_seat(cfg.plan, machine.node, backend=backend, timeout_s=cfg.timeout_s, cluster_path=cfg.cluster_path,
                     profiles_dir=cfg.profiles_dir, notice=notice)
    if seat is None:
        return None
    # Under --elastic every process of a round resumes from the newest intact checkpoint, however it came: a survivor
    # restarted by its agent and a machine that came back with the command it was first started with (its restart
    # count is 0) must agree, and at a rendezvous nobody is writing one.
    if seat.plan is not cfg.plan or (elastic() and _has_checkpoint(cfg.save_dir)):
        cfg = replace(cfg, plan=seat.plan, resume=_has_checkpoint(cfg.save_dir) or cfg.resume, resume_from=None)
        cfg = prepare(cfg, notice if seat.rank == 0 else None)
        if seat.rank == 0 and cfg.resume_from:
            notice(f"resuming from {Path(cfg.resume_from).name} under the "
                   f"{'re-solved' if seat.dropped else 'given'} plan")
    device = torch.device(f"cuda:{seat.gpu}") if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    return cfg, seat, device, _own_preflight(cfg, seat, kind, len(machine.devices))


def _own_preflight(cfg, seat: Seat, kind: str, on_machine_count: int):
    """This process's pre-flight check, on the plan it runs (the machine launcher checked the given plan's devices
    before starting; under torchrun, or after re-planning, this is the check)."""
    from runtime.launch.devices import cpu_capacity, cuda_capacity, preflight

    caps: list = [None] * len(cfg.plan.device_ids())
    where, cap = cuda_capacity(seat.gpu) if kind == "cuda" else cpu_capacity(on_machine_count)
    caps[seat.rank] = (f"machine {seat.node}'s {where}", cap)
    return preflight(cfg.plan, caps, cluster_path=cfg.cluster_path, profiles_dir=cfg.profiles_dir, ranks=[seat.rank])


def _has_checkpoint(save_dir) -> bool:
    from runtime.train.checkpoint import checkpoints

    return bool(save_dir) and bool(checkpoints(save_dir))


def ended(exc: BaseException, seat: Seat | None) -> BaseException:
    """What ends this process: its line left for the machine's launcher (which prints one line for the machine) and
    a silent exit, or ``exc`` itself outside the machine launcher."""
    if isinstance(exc, KeyboardInterrupt):
        from runtime.launch.machines import STOP_KINDS

        kind = STOP_KINDS[getattr(exc, "exit_code", 130) == 143]
        node = seat.node if seat is not None else os.environ.get(MACHINE_ENV, "?")
        detail = exc.args[0] if exc.args and exc.args[0] else f"machine {node}'s processes were stopped"
        if write_report(detail, kind):
            # A stop every rank agreed on and saved at ends this process without failing: an elastic agent must not
            # restart it (its launcher says the run was interrupted); any other interrupt exits as one.
            return SystemExit(0 if getattr(exc, "agreed", False) else getattr(exc, "exit_code", 130))
        return exc
    line = str(exc) if isinstance(exc, BatonError) else f"{type(exc).__name__}: {exc}".splitlines()[0]
    if seat is not None and not isinstance(exc, BatonError):
        line = lost_machine_line(seat, line) or f"machine {seat.node}, {seat.device_id} (rank {seat.rank}) failed: {line}"
    if write_report(line):
        return SystemExit(2)
    return exc if isinstance(exc, BatonError) else BatonError(line)
