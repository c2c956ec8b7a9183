"""``baton launch --print``: the command every machine of a plan runs, or a Slurm batch script that runs them.

Nobody writes rank arithmetic by hand: each machine names its plan node and the rendezvous, and the ranks follow
from the plan after the rendezvous (``runtime.launch.machines``, ``runtime.launch.plan_ranks``).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from baton.cli_support import guarded
from baton.errors import BatonError
from baton.plan import load_plan


def register(app: typer.Typer) -> None:
    from baton.commands import set_link_measurer

    set_link_measurer(measure_link_between)
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(guarded(launch))


def launch(
    ctx: typer.Context,
    plan: Path = typer.Option(..., "--print", help="Plan JSON whose machines' commands to print."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                help="HOST:PORT of the rendezvous, on one of the machines (with --slurm only its port counts)."),
    slurm: bool = typer.Option(False, "--slurm", help="Print a Slurm batch script instead (the rendezvous on the first host)."),
    torchrun: bool = typer.Option(False, "--torchrun", help="Print the equivalent torchrun lines instead."),
) -> None:
    """Print the command each machine runs for PLAN; options after `--` are passed on to `baton train`
    (e.g. `-- --steps 100 --save-dir /shared/ckpt --elastic`)."""
    from runtime.launch.machines import machine_commands, parse_endpoint, slurm_script, torchrun_command

    extra: List[str] = list(ctx.args)
    the_plan = load_plan(plan)
    if slurm:
        if torchrun:
            raise BatonError("give either --slurm or --torchrun", field="--slurm")
        port = parse_endpoint(rdzv_endpoint)[1] if rdzv_endpoint else 29500
        print(slurm_script(the_plan, str(plan), port=port, extra=extra), end="")
        return
    if rdzv_endpoint is None:
        raise BatonError("needs HOST:PORT of the rendezvous, on one of the machines (or --slurm)", field="--rdzv-endpoint")
    parse_endpoint(rdzv_endpoint)
    for machine, command in machine_commands(the_plan, str(plan), rdzv_endpoint, extra):
        if torchrun:
            command = torchrun_command(the_plan, machine, str(plan), rdzv_endpoint, extra)
        print(f"# machine {machine.node}: plan devices {', '.join(machine.devices)} (GPUs {', '.join(map(str, machine.gpus))})")
        print(command)


def measure_link_between(*, peer: str, peer_rank: int, interface: str | None, out: Path | None) -> None:
    """``baton profile --comm --peer``: the link between this machine and another; rank 0 writes the ``nic`` block
    (default ``link-<peer host>.yaml``) to paste into the cluster file's node entries."""
    from baton.atomic import write_atomically
    from baton.cli_support import say
    from runtime.launch.machines import parse_endpoint
    from runtime.measure.comm_profiler import measure_between_machines

    host, _ = parse_endpoint(peer)
    if out is not None and peer_rank == 0:
        from baton.cli_support import check_output_path

        check_output_path(out, "--out")
    fit = measure_between_machines(peer, peer_rank, interface=interface)
    if fit is None:
        say("measured the link with the machine at rank 0, which writes the figures")
        return
    path = out or Path(f"link-{host}.yaml")
    write_atomically(path, fit.yaml_block("nic"))
    say(f"link between the two machines over gloo: {fit.bandwidth_gb_per_s:.3f} GB/s, {fit.latency_us:.0f} us per message "
        f"(all-reduce implies {fit.allreduce_bandwidth_gb_per_s:.3f} GB/s); wrote {path}: the 'nic' of each node")
