"""Start one process per plan device and run training in each.

Locally, ``train`` spawns the processes itself: NCCL on CUDA when the machine has a GPU per device,
otherwise gloo on CPU processes that stand in for the plan's GPUs. Under torchrun (RANK, WORLD_SIZE,
LOCAL_RANK in the environment) the current process is one rank and rank 0 reports progress.

User errors are ``BatonError``s. Checks that need no process run in the parent before anything starts;
a rank that fails reports one line (a ``BatonError``'s message, or the exception with the path of its
traceback), and the parent kills the other ranks and raises that line.
"""
from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from baton.errors import BatonError
from baton.plan import Plan
from runtime.affinity import pin_rank, pinning_requested
from runtime.checkpoint import CheckpointReader, latest_checkpoint, read_meta, save_checkpoint
from runtime.data import TokenSource, check_data_file
from runtime.engine import Engine, StepStats
from runtime.processes import stop_processes


@dataclass(kw_only=True)
class TrainConfig:
    """What ``baton train`` was asked to do."""

    plan: Plan
    """The plan to run; one process per device, in ``plan.device_ids()`` order."""
    steps: int = 10
    """Train until this many optimizer steps have been taken (a resumed run counts its earlier steps)."""
    data: str | None = None
    """Byte-level text file; synthetic tokens when None."""
    save_dir: str | None = None
    """Where checkpoints go (``step-XXXXXX`` directories)."""
    save_every: int = 0
    """Save every N steps as well as at the end (0: at the end only)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``save_dir``."""
    resume_from: str | None = None
    """Resolved checkpoint directory (filled in by ``prepare``)."""
    init_from: str | None = None
    """Hugging Face GPT-2 directory to initialise the weights from."""
    seed: int = 0
    """Initialisation, data order and dropout masks (a resumed run keeps its checkpoint's seed)."""
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    device: str = "auto"
    """auto, cpu or cuda."""
    timeout_s: float = 300.0
    """Collective timeout; a rank stuck longer fails instead of hanging."""
    log_dir: str | None = None
    """Where failing ranks write their tracebacks (a temporary directory when None)."""
    collect_all_ranks: bool = False
    """Send every rank's step measurements back (for ``--report``), not just rank 0's."""


def prepare(cfg: TrainConfig) -> TrainConfig:
    """Check everything that can be checked before starting processes; resolve the checkpoint."""
    spec = cfg.plan.model
    if cfg.steps < 1:
        raise BatonError(f"must be at least 1, got {cfg.steps}", field="--steps")
    if cfg.data is not None:
        check_data_file(cfg.data, spec)
    if cfg.resume and cfg.init_from:
        raise BatonError("use either --resume or --init-from, not both", field="--resume")
    if cfg.resume:
        if not cfg.save_dir:
            raise BatonError("--resume needs --save-dir (the directory holding the checkpoints)", field="--resume")
        ckpt = latest_checkpoint(cfg.save_dir)
        if ckpt is None:
            raise BatonError("no checkpoint to resume from", source=cfg.save_dir, field="--save-dir")
        meta = read_meta(ckpt, spec)
        cfg.resume_from, cfg.seed = str(ckpt), int(meta.get("seed", cfg.seed))
    if cfg.init_from:
        from runtime.hf import load_gpt2

        load_gpt2(cfg.init_from, spec)  # fail early on a wrong directory or config
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise BatonError(f"unknown device '{cfg.device}' (expected auto, cpu or cuda)", field="--device")
    return cfg


def _choose_device(cfg: TrainConfig, world: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda" and gpus < world:
        raise BatonError(f"the plan has {world} devices but this machine has {gpus} CUDA GPUs; "
                         "start one process per GPU with torchrun on each machine, or use --device cpu", field="--device")
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= world) else "cpu"


# --- one rank --------------------------------------------------------------------------------------


def run_rank(cfg: TrainConfig, rank: int, device: torch.device, report=None) -> list[StepStats]:
    """Train on this rank (process group already initialised); ``report(stats)`` is called on rank 0."""
    plan = cfg.plan
    spec = plan.model
    full = None
    reader = None
    start_step, start_sample = 0, 0
    if cfg.resume_from:
        reader = CheckpointReader(cfg.resume_from, spec)
        start_step, start_sample = int(reader.meta["step"]), int(reader.meta["samples_seen"])
        full = reader.parameter
    elif cfg.init_from:
        from runtime.hf import load_gpt2

        weights = load_gpt2(cfg.init_from, spec)
        full = weights.__getitem__
    engine = Engine(plan, rank, device=device, seed=cfg.seed, lr=cfg.lr, weight_decay=cfg.weight_decay, full=full)
    pin_rank(int(os.environ.get("LOCAL_RANK", rank)))  # after the engine made its groups (see runtime.affinity)
    if reader is not None:
        reader.load_into(engine)
    data = TokenSource(spec, path=cfg.data, seed=cfg.seed, global_batch=plan.global_batch,
                       start_step=start_step, start_sample=start_sample)
    history = []
    for step in range(start_step, cfg.steps):
        stats = engine.train_step(step, data)
        history.append(stats)
        if report is not None and rank == 0:
            report(stats)
        done = step + 1
        if cfg.save_dir and (done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            save_checkpoint(engine, cfg.save_dir, step=done, samples_seen=data.samples_before(done),
                            extra={"data": {"path": cfg.data}, "plan_info": plan.info})
    return history


def _init_group(backend: str, rank: int, world: int, init_method: str, timeout_s: float) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _worker(rank: int, world: int, cfg: TrainConfig, device_kind: str, init_method: str, log_dir: str, q) -> None:
    """Entry point of a spawned rank: never raises, reports ('error', rank, line) or ('done', rank)."""
    torch.set_num_threads(1 if pinning_requested() else max(1, (os.cpu_count() or 1) // world))
    try:
        device = torch.device(f"cuda:{rank}") if device_kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _init_group("nccl" if device.type == "cuda" else "gloo", rank, world, init_method, cfg.timeout_s)
        history = run_rank(cfg, rank, device, report=lambda s: q.put(("step", asdict(s))))
        if cfg.collect_all_ranks:
            q.put(("rank_stats", rank, [asdict(s) for s in history]))
        dist.barrier()
        q.put(("done", rank))
    except BatonError as exc:
        q.put(("error", rank, str(exc), True))
    except BaseException as exc:
        path = Path(log_dir) / f"rank-{rank}.traceback.txt"
        path.write_text(traceback.format_exc())
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        device_id = cfg.plan.device_ids()[rank]
        q.put(("error", rank, f"rank {rank} (device {device_id}) failed: {line} (traceback: {path})", False))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# --- the whole run ---------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def train(cfg: TrainConfig, on_step=None, per_rank: dict | None = None) -> list[StepStats]:
    """Run ``cfg`` to the end; ``on_step(stats)`` sees every step's rank-0 stats. Returns them.

    With ``cfg.collect_all_ranks`` and a ``per_rank`` dict, it is filled with rank -> that rank's
    StepStats of every step (under torchrun, on rank 0 only).
    """
    cfg = prepare(cfg)
    world = len(cfg.plan.device_ids())
    if under_torchrun():
        return _train_torchrun(cfg, world, on_step, per_rank)
    return _train_spawned(cfg, world, on_step, per_rank)


def _train_torchrun(cfg: TrainConfig, world: int, on_step, per_rank=None) -> list[StepStats]:
    env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_world != world:
        raise BatonError(f"the plan has {world} devices but {env_world} processes were started "
                         f"(WORLD_SIZE={env_world}); start exactly one process per plan device", field="WORLD_SIZE")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    _init_group("nccl" if use_cuda else "gloo", rank, world, "env://", cfg.timeout_s)
    try:
        history = run_rank(cfg, rank, device, report=on_step)
        if cfg.collect_all_ranks:
            gathered = [None] * world if rank == 0 else None
            dist.gather_object([asdict(s) for s in history], gathered, dst=0)
            if rank == 0 and per_rank is not None:
                per_rank.update({r: [StepStats(**s) for s in h] for r, h in enumerate(gathered)})
        dist.barrier()
        return history
    finally:
        dist.destroy_process_group()


def _train_spawned(cfg: TrainConfig, world: int, on_step, per_rank=None) -> list[StepStats]:
    import torch.multiprocessing as mp

    device_kind = _choose_device(cfg, world)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="baton-train-")
    rdzv = Path(tempfile.mkdtemp(prefix="baton-rdzv-")) / "store"
    procs = [ctx.Process(target=_worker, args=(r, world, cfg, device_kind, f"file://{rdzv}", log_dir, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    history, done = [], set()
    last_news = time.monotonic()
    try:
        while len(done) < world:
            try:
                msg = q.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and r not in done]
                if dead:
                    time.sleep(0.5)  # its error message may still be in flight
                    if q.empty():
                        raise BatonError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a report")
                    continue
                if time.monotonic() - last_news > cfg.timeout_s + 60:
                    raise BatonError(f"no progress for {cfg.timeout_s + 60:.0f} s; stopped all ranks", field="--timeout")
                continue
            last_news = time.monotonic()
            if msg[0] == "step":
                stats = StepStats(**msg[1])
                history.append(stats)
                if on_step is not None:
                    on_step(stats)
            elif msg[0] == "rank_stats":
                if per_rank is not None:
                    per_rank[msg[1]] = [StepStats(**s) for s in msg[2]]
            elif msg[0] == "done":
                done.add(msg[1])
            elif msg[0] == "error":
                raise BatonError(_first_error(msg, q))
        return history
    finally:
        stop_processes(procs)


def _first_error(msg, q) -> str:
    """Prefer a user error (BatonError) over the knock-on failures of the other ranks."""
    errors = [msg]
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            m = q.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        if m[0] == "error":
            errors.append(m)
    user = [e for e in errors if e[3]]
    return (user or errors)[0][2]
