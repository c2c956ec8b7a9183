"""Start one process per plan device and run training in each.

Locally, ``train`` spawns the processes itself: NCCL on CUDA when the machine has a GPU per device,
otherwise gloo on CPU processes that stand in for the plan's GPUs. Under torchrun (RANK, WORLD_SIZE,
LOCAL_RANK in the environment) the current process is one rank and rank 0 reports progress.

User errors are ``BatonError``s. Checks that need no process run in the parent before anything starts,
the pre-flight memory check among them (``runtime.launch.devices``: every device's predicted peak against the
memory of the GPU, or the share of RAM, its rank will get);
a rank that fails reports one line (a ``BatonError``'s message, or the exception with the path of its
traceback), and the parent kills the other ranks and raises the line of the rank that failed first
(a rank that died or was stopped is blamed before the peers that lost their connection to it).

What ends a run, and what it leaves:

* Spawned ranks die with their launcher (``runtime.launch.processes.die_with_parent``), whatever kills it.
* Every wait inside a rank is bounded by ``--timeout``: the default group, every subgroup and every
  point-to-point receive. Under torchrun, where no launcher watches, that is what ends a rank whose
  peers are gone.
* Ctrl-C or SIGTERM with ``--save-dir``: the ranks finish the step they are in, agree on it, save a
  checkpoint and stop (the launcher waits at most ``--timeout`` for that; a second Ctrl-C or SIGTERM
  stops at once without saving). Without ``--save-dir`` the ranks are stopped at once. Exit code 130
  (Ctrl-C) or 143 (SIGTERM).
* With a run directory (``run_dir``), the launcher (rank 0 under torchrun) appends one JSON record per
  step to ``metrics.jsonl`` there (``runtime.measure.metrics``), validation losses included.
* The run's temporary directory (rendezvous store) is removed at the end; those of launchers that
  were SIGKILLed are removed by the next run. A traceback file is written only for a failing rank.
"""
from __future__ import annotations

import math
import os
import queue as queue_mod
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from baton.cli_support import check_writable_dir
from baton.errors import BatonError
from baton.plan import Plan
from runtime.launch.affinity import pin_rank, pinning_requested
from runtime.train.checkpoint import CheckpointReader, find_resumable, remove_stale_temporaries, save_checkpoint
from runtime.data.source import TokenSource, ValidationSource, check_data_file, data_fingerprint, open_dataset
from runtime.launch.devices import Preflight, RunDevices, capacities, choose_devices, cpu_capacity, cuda_capacity, preflight
from runtime.train.engine import Engine, StepStats
from runtime.measure.metrics import MetricsLog
from runtime.train.precision import cpu_runs_natively, emulation_note
from runtime.launch.processes import (Terminated, die_with_parent, interrupts_as_flags, process_state, run_directory, stop_processes,
                               sweep_stale_run_directories, terminate_as_interrupt)
from runtime.train.optim_settings import DECAYS, LRSchedule

MAX_STEPS = 10**9
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(kw_only=True)
class TrainConfig:
    """What ``baton train`` was asked to do.

    A field that an option of ``baton train`` sets (``runtime.commands.train_options``) gives that option
    its default, and its docstring is the option's help: write it for the command line, naming flags.
    Outside the command, ``run_dir`` None writes no metrics (the command always gives one)."""

    plan: Plan
    """The plan to run; one process per device, in ``plan.device_ids()`` order (the command loads --plan)."""
    steps: int = 10
    """Train until this many optimizer steps have been taken (a resumed run counts its earlier steps)."""
    data: str | None = None
    """Text file read as bytes (vocab 256), or a token dataset directory from `baton data prepare`;
    synthetic tokens if omitted."""
    save_dir: str | None = None
    """Directory for checkpoints (step-XXXXXX)."""
    save_every: int = 0
    """Also save every N steps (0: only at the end)."""
    keep: int = 0
    """Keep only the newest N checkpoints in --save-dir (0: all)."""
    resume: bool = False
    """Continue from the newest intact checkpoint in --save-dir (any plan)."""
    resume_from: str | None = None
    """Resolved checkpoint directory (filled in by ``prepare``)."""
    allow_other_data: bool = False
    """With --resume: continue on other data than the checkpoint's."""
    init_from: str | None = None
    """Hugging Face GPT-2 directory to initialise from."""
    seed: int = 0
    """Initialisation, data order and dropout masks (a resumed run keeps its checkpoint's seed)."""
    lr: float = 3e-4
    """Peak AdamW learning rate (after warm-up, before decay)."""
    lr_min: float = 0.0
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up."""
    decay: str = "constant"
    """Learning-rate decay after warm-up, reaching --lr-min at --steps: cosine, linear or constant."""
    clip_grad: float = 0.0
    """Clip the global gradient norm (all ranks) to this (0: off)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (biases and LayerNorms never decay)."""
    eval_every: int = 0
    """Validation loss every N steps and at the end (needs --data DIR with a val split; 0: off)."""
    eval_windows: int = 0
    """At most this many validation windows (0: the whole val split)."""
    run_dir: str | None = None
    """Directory for metrics.jsonl and resolved.yaml (default: --save-dir, else runs/<time>)."""
    device: str = "auto"
    """auto, cpu or cuda (cuda: an error without a GPU per plan device)."""
    gpus: tuple[int, ...] | None = None
    """CUDA devices of the ranks in rank order, e.g. 0,1 (implies --device cuda; default: GPUs 0..n-1, under
    torchrun by LOCAL_RANK)."""
    cluster_path: str | None = None
    """Cluster YAML the plan was made for: the pre-flight memory check and MFU use it (default: the shipped
    spec of the plan's cluster); --report and --report-timeline need it."""
    profiles_dir: str | None = None
    """Profile tables for the predictions (default: the shipped ones)."""
    timeout_s: float = 300.0
    """Seconds a rank may wait on a peer (any collective or receive) before failing."""
    rdzv_endpoint: str | None = None
    """HOST:PORT where the machines of a run across machines meet (one of them): this machine starts the plan's
    devices of its node (`baton launch --print` prints every machine's command)."""
    node: str | None = None
    """With --rdzv-endpoint: the plan node this machine is (default: the node named like its hostname)."""
    elastic: bool = False
    """With --rdzv-endpoint: when a machine is lost, go on without it: re-plan for the devices left and resume from
    the newest checkpoint in --save-dir."""
    interface: str | None = None
    """With --rdzv-endpoint: the network interface gloo and NCCL use on this machine (default: the node's
    `interface` in the cluster file)."""
    log_dir: str | None = None
    """Where the traceback of a failing rank is written (the system's temporary directory when None)."""
    collect_all_ranks: bool = False
    """Send every rank's step measurements back (for ``--report``), not just rank 0's."""
    trace: str | None = None
    """Write a Chrome/Perfetto trace (JSON) of every rank's measured forward, backward, recompute,
    sends/receives, all-reduces and optimizer."""
    compile: bool = False
    """Run each layer's operators as torch.compile graphs (compiled in the first step; refused with activation
    offload); see docs/errors.md."""


def _finite(value: float, flag: str, *, minimum: float, inclusive: bool, maximum: float = math.inf) -> None:
    ok = math.isfinite(value) and (value >= minimum if inclusive else value > minimum) and value <= maximum
    if not ok:
        lower = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        upper = f" and <= {maximum:g}" if math.isfinite(maximum) else ""
        raise BatonError(f"must be a finite number {lower}{upper}, got {value!r}", field=flag)


def _check_same_data(meta: dict, cfg: TrainConfig, ckpt: Path) -> None:
    theirs = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    ours = data_fingerprint(cfg.data)
    if (theirs.get("path") is None) != (ours["path"] is None):
        differs = True
    elif ours["path"] is None or "fingerprint" not in theirs:
        differs = False  # both synthetic, or a checkpoint that recorded only a path
    else:
        differs = theirs.get("fingerprint") != ours["fingerprint"]
    if differs:
        was = "synthetic tokens" if theirs.get("path") is None else f"'{theirs.get('path')}'"
        now = "synthetic tokens" if cfg.data is None else f"'{cfg.data}'"
        raise BatonError(f"{ckpt.name} was trained on {was}, this run reads {now}; "
                         "pass --allow-other-data to continue on other data", field="--data")


def prepare(cfg: TrainConfig, on_notice=None) -> TrainConfig:
    """Check everything that can be checked before starting processes; resolve the checkpoint.

    ``on_notice(line)`` hears what the user should know but is no error (a skipped damaged checkpoint)."""
    spec = cfg.plan.model
    notice = on_notice or (lambda line: None)
    if isinstance(cfg.steps, bool) or not 1 <= cfg.steps <= MAX_STEPS:
        raise BatonError(f"must be in 1..{MAX_STEPS}, got {cfg.steps}", field="--steps")
    _finite(cfg.lr, "--lr", minimum=0.0, inclusive=False)
    _finite(cfg.weight_decay, "--weight-decay", minimum=0.0, inclusive=True)
    _finite(cfg.lr_min, "--lr-min", minimum=0.0, inclusive=True, maximum=cfg.lr)
    _finite(cfg.clip_grad, "--clip-grad", minimum=0.0, inclusive=True)
    if cfg.decay not in DECAYS:
        raise BatonError(f"unknown decay '{cfg.decay}' (expected {', '.join(DECAYS)})", field="--decay")
    if isinstance(cfg.warmup_steps, bool) or not 0 <= cfg.warmup_steps <= MAX_STEPS:
        raise BatonError(f"must be in 0..{MAX_STEPS}, got {cfg.warmup_steps}", field="--warmup-steps")
    for value, flag in ((cfg.eval_every, "--eval-every"), (cfg.eval_windows, "--eval-windows")):
        if not 0 <= value <= MAX_STEPS:
            raise BatonError(f"must be in 0..{MAX_STEPS} (0: off), got {value}", field=flag)
    if cfg.eval_every:
        if cfg.data is None or not Path(cfg.data).is_dir():
            raise BatonError("needs --data DIR, a token dataset with a validation split (`baton data prepare`)",
                             field="--eval-every")
        open_dataset(cfg.data, spec, need_val=True)
    if cfg.trace is not None:
        from baton.cli_support import check_output_path

        check_output_path(cfg.trace, "--trace")
    _finite(cfg.timeout_s, "--timeout", minimum=0.0, inclusive=False, maximum=MAX_TIMEOUT_S)
    if cfg.save_every < 0:
        raise BatonError(f"must be >= 0 (0: save only at the end), got {cfg.save_every}", field="--save-every")
    if cfg.keep < 0:
        raise BatonError(f"must be >= 0 (0: keep every checkpoint), got {cfg.keep}", field="--keep")
    if not 0 <= cfg.seed < 2**63:
        raise BatonError(f"must be in 0..2^63-1, got {cfg.seed}", field="--seed")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise BatonError(f"unknown device '{cfg.device}' (expected auto, cpu or cuda)", field="--device")
    if cfg.data is not None:
        check_data_file(cfg.data, spec)
    if cfg.resume and cfg.init_from:
        raise BatonError("use either --resume or --init-from, not both", field="--resume")
    if cfg.save_dir is not None:
        check_writable_dir(cfg.save_dir, "--save-dir")
        for p in remove_stale_temporaries(cfg.save_dir):
            notice(f"removed {p.name}, left by a run that died while saving")
    elif cfg.save_every or cfg.keep:
        raise BatonError("needs --save-dir", field="--save-every" if cfg.save_every else "--keep")
    if cfg.run_dir is not None and cfg.run_dir != cfg.save_dir:  # the save dir was checked as --save-dir
        check_writable_dir(cfg.run_dir, "--run-dir")
    if cfg.resume:
        if not cfg.save_dir:
            raise BatonError("--resume needs --save-dir (the directory holding the checkpoints)", field="--resume")
        ckpt, meta, skipped = find_resumable(cfg.save_dir, spec)
        for why in skipped:
            notice(f"skipping {why}")
        if skipped:
            notice(f"resuming from {ckpt.name}, the newest intact checkpoint")
        step = int(meta.get("step", 0))
        if step >= cfg.steps:
            raise BatonError(f"{ckpt.name} has already trained {step} steps, not fewer than --steps {cfg.steps}; "
                             "raise --steps to train further", field="--steps")
        if not cfg.allow_other_data:
            _check_same_data(meta, cfg, ckpt)
        theirs = meta.get("optimizer", {}).get("schedule") if isinstance(meta.get("optimizer"), dict) else None
        ours = schedule_of(cfg).as_dict()
        if isinstance(theirs, dict) and theirs != ours:
            changed = ", ".join(f"{k} {theirs.get(k)} -> {v}" for k, v in ours.items() if theirs.get(k) != v)
            notice(f"the learning-rate schedule differs from {ckpt.name}'s ({changed}); continuing with this run's")
        cfg.resume_from, cfg.seed = str(ckpt), int(meta.get("seed", cfg.seed))
    if cfg.init_from:
        from runtime.model.hf_import import load_hf

        load_hf(cfg.init_from, spec)  # fail early on a wrong directory or config
    if cfg.compile:
        from runtime.parallel.stage import check_compile

        check_compile(cfg.plan)
    return cfg


def check_before_start(cfg: TrainConfig, devices: RunDevices, world: int) -> Preflight:
    """The pre-flight check of a run started here: every rank's predicted peak against its device."""
    return preflight(cfg.plan, capacities(devices, world), cluster_path=cfg.cluster_path, profiles_dir=cfg.profiles_dir)


# --- one rank --------------------------------------------------------------------------------------


def _agree_to_stop(wanted: bool, device: torch.device) -> bool:
    """True on every rank once any rank was asked to stop: all ranks must end after the same step, or
    the checkpoint's collective would pair the wrong sends."""
    flag = torch.tensor([1.0 if wanted else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def run_rank(cfg: TrainConfig, rank: int, device: torch.device, report=None, stop_requested=None,
             outcome: dict | None = None) -> list[StepStats]:
    """Train on this rank (process group already initialised); ``report(stats)`` is called on rank 0.

    With a ``save_dir``, ``stop_requested()`` is polled after every step; once any rank says yes, every
    rank saves a checkpoint of that step and returns. ``outcome`` receives ``saved`` (the last
    checkpoint's path) and ``stopped_after`` (the step count at a requested stop)."""
    plan = cfg.plan
    spec = plan.model
    if device.type == "cuda":  # the model's TF32 setting, which its derived tables assumed (baton.model_spec)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.tf32
    outcome = {} if outcome is None else outcome
    full = None
    reader = None
    start_step, start_sample = 0, 0
    if cfg.resume_from:
        reader = CheckpointReader(cfg.resume_from, spec)
        start_step, start_sample = int(reader.meta["step"]), int(reader.meta["samples_seen"])
        full = reader.parameter
    elif cfg.init_from:
        from runtime.model.hf_import import load_hf

        weights = load_hf(cfg.init_from, spec)
        full = weights.__getitem__
    engine = Engine(plan, rank, device=device, seed=cfg.seed, lr=cfg.lr, weight_decay=cfg.weight_decay, full=full,
                    timeout_s=cfg.timeout_s, schedule=schedule_of(cfg), clip_grad=cfg.clip_grad)
    pin_rank(int(os.environ.get("LOCAL_RANK", rank)))  # after the engine made its groups (see runtime.launch.affinity)
    if cfg.compile:
        engine.model.compile_layers()
    if cfg.trace:
        from runtime.measure.trace import Tracer

        engine.tracer = Tracer()
    if reader is not None:
        reader.load_into(engine)
    data = TokenSource(spec, path=cfg.data, seed=cfg.seed, global_batch=plan.global_batch,
                       start_step=start_step, start_sample=start_sample)
    val = ValidationSource(spec, cfg.data, global_batch=plan.global_batch, max_windows=cfg.eval_windows or None) \
        if cfg.eval_every else None
    extra = {"data": data_fingerprint(cfg.data), "plan_info": plan.info}
    history = []
    for step in range(start_step, cfg.steps):
        stats = engine.train_step(step, data)
        done = step + 1
        if val is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            t0 = time.perf_counter()
            stats.val_loss = engine.evaluate(val)
            if engine.tracer is not None:
                engine.tracer.add("validation", "eval", t0, time.perf_counter(), step=step)
        history.append(stats)
        if report is not None and rank == 0:
            report(stats)
        stopping = bool(cfg.save_dir) and done < cfg.steps and \
            _agree_to_stop(bool(stop_requested and stop_requested()), engine.device)
        if cfg.save_dir and (done == cfg.steps or stopping or (cfg.save_every and done % cfg.save_every == 0)):
            outcome["saved"] = str(save_checkpoint(engine, cfg.save_dir, step=done, samples_seen=data.samples_before(done),
                                                   extra=extra, keep=cfg.keep))
        if stopping:
            outcome["stopped_after"] = done
            break
    if engine.tracer is not None:
        outcome["trace"] = engine.tracer.events
    return history


def schedule_of(cfg: TrainConfig) -> LRSchedule:
    """The run's learning-rate schedule: the decay ends at ``--steps``."""
    return LRSchedule(lr=cfg.lr, lr_min=cfg.lr_min, warmup_steps=cfg.warmup_steps, decay=cfg.decay,
                      decay_steps=0 if cfg.decay == "constant" else cfg.steps)  # constant: --steps is irrelevant


def _init_group(backend: str, rank: int, world: int, init_method: str, timeout_s: float) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _worker(rank: int, world: int, cfg: TrainConfig, devices: RunDevices, init_method: str, q, stop, parent_pid: int) -> None:
    """Entry point of a spawned rank: never raises; reports ('error', rank, line, is_user_error,
    traceback) or ('done', rank, outcome)."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the launcher alone decides what it means (stop now, or
    # save first), so a rank must not die of it halfway through a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1 if pinning_requested() else max(1, (os.cpu_count() or 1) // world))
    try:
        device = torch.device(f"cuda:{devices.gpus[rank]}") if devices.kind == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _init_group("nccl" if device.type == "cuda" else "gloo", rank, world, init_method, cfg.timeout_s)
        outcome: dict = {}
        history = run_rank(cfg, rank, device, report=lambda s: q.put(("step", asdict(s))),
                           stop_requested=stop.is_set, outcome=outcome)
        if cfg.collect_all_ranks:
            q.put(("rank_stats", rank, [asdict(s) for s in history]))
        if "trace" in outcome:
            q.put(("trace", rank, outcome.pop("trace")))
        dist.barrier()
        q.put(("done", rank, outcome))
    except BatonError as exc:
        q.put(("error", rank, str(exc), True, None))
    except BaseException as exc:
        import traceback

        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        q.put(("error", rank, f"rank {rank} (device {cfg.plan.device_ids()[rank]}) failed: {line}", False,
               traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# --- the whole run ---------------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def train(cfg: TrainConfig, on_step=None, per_rank: dict | None = None, on_notice=None,
          checked: dict | None = None) -> list[StepStats]:
    """Run ``cfg`` to the end; ``on_step(stats)`` sees every step's rank-0 stats. Returns them.

    With ``cfg.collect_all_ranks`` and a ``per_rank`` dict, it is filled with rank -> that rank's
    StepStats of every step (under torchrun, on rank 0 only). ``on_notice(line)`` hears what is worth
    saying but is no error. ``checked``, when given, receives ``preflight``: the pre-flight check's
    ``Preflight`` (prediction, capacities, peak FLOP/s for MFU), and with ``cfg.run_dir`` ``metrics``: the
    ``MetricsLog`` (its ``last`` record is the step ``on_step`` hears). An interrupted run raises
    KeyboardInterrupt (``Terminated`` for SIGTERM) whose message says what was saved.
    """
    cfg = prepare(cfg, on_notice)
    world = len(cfg.plan.device_ids())
    checked = {} if checked is None else checked
    log = None
    if cfg.run_dir is not None:
        # Created now, opened at the first step: the pre-flight check fills in the peak FLOP/s first.
        log = checked["metrics"] = MetricsLog(cfg.run_dir, cfg.plan)
        user_on_step = on_step

        def on_step(stats):
            if log.peak_flops is None and checked.get("preflight") is not None:
                log.peak_flops = checked["preflight"].peak_flops
            log.write(stats)
            if user_on_step is not None:
                user_on_step(stats)
    try:
        if under_torchrun():
            return _train_torchrun(cfg, world, on_step, per_rank, checked, on_notice or (lambda line: None))
        devices = choose_devices(cfg.device, cfg.gpus, world)
        if devices.kind == "cpu" and cfg.device == "auto" and torch.cuda.is_available() and on_notice:
            on_notice(f"the plan has {world} devices and this machine {torch.cuda.device_count()} CUDA GPU(s): "
                      "running CPU processes (--device cuda --gpus to choose GPUs)")
        checked["preflight"] = check_before_start(cfg, devices, world)
        dtype = cfg.plan.model.dtype
        slow = emulation_note(dtype, devices.kind, cpu_runs_natively(dtype))
        if slow and on_notice:
            on_notice(slow)
        return _train_spawned(cfg, world, devices, on_step, per_rank, on_notice or (lambda line: None))
    finally:
        if log is not None:
            log.close()


def _torchrun_device(cfg: TrainConfig, local: int, local_world: int) -> torch.device:
    """This rank's device under torchrun: GPU ``--gpus[LOCAL_RANK]`` (else LOCAL_RANK) when CUDA is asked
    for or present; asking for CUDA without a GPU for this rank is an error, not a CPU fallback."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.gpus is not None and cfg.device == "cpu":
        raise BatonError("--gpus chooses CUDA devices; it cannot go with --device cpu", field="--gpus")
    use_cuda = cfg.device == "cuda" or cfg.gpus is not None or (cfg.device == "auto" and available > 0)
    if not use_cuda:
        return torch.device("cpu")
    if cfg.gpus is not None and local >= len(cfg.gpus):
        raise BatonError(f"lists {len(cfg.gpus)} GPU(s) but this machine runs {local_world} ranks (LOCAL_RANK={local})",
                         field="--gpus")
    index = cfg.gpus[local] if cfg.gpus is not None else local
    if index >= available:
        raise BatonError(f"rank with LOCAL_RANK={local} needs GPU {index} but this machine has {available} CUDA GPU(s)",
                         field="--gpus" if cfg.gpus is not None else "--device")
    return torch.device(f"cuda:{index}")


def _train_torchrun(cfg: TrainConfig, world: int, on_step, per_rank=None, checked: dict | None = None,
                    notice=lambda line: None) -> list[StepStats]:
    from runtime.launch.machine_train import ended, join, on_machine

    seat = None
    if on_machine(cfg):  # one machine's processes of a run across machines: plan ranks after the rendezvous
        try:
            joined = join(cfg, prepare, notice)
        except BaseException as exc:
            raise ended(exc, None) from None
        if joined is None:
            notice("the re-solved plan leaves this process's device out: nothing to do")
            return []
        cfg, seat, device, pre = joined
        if checked is not None:
            checked["preflight"] = pre
        return _train_joined(cfg, seat.rank, len(cfg.plan.device_ids()), device, on_step, per_rank, seat=seat)
    env_world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_world != world:
        raise BatonError(f"the plan has {world} devices but {env_world} processes were started "
                         f"(WORLD_SIZE={env_world}); start exactly one process per plan device", field="WORLD_SIZE")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = _torchrun_device(cfg, local, local_world)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    # Pre-flight, before joining the group: each rank checks its own device (torchrun then stops the others).
    caps = [None] * world
    caps[rank] = cuda_capacity(device.index) if use_cuda else cpu_capacity(local_world)
    result = preflight(cfg.plan, caps, cluster_path=cfg.cluster_path, profiles_dir=cfg.profiles_dir, ranks=[rank])
    if checked is not None:
        checked["preflight"] = result
    _init_group("nccl" if use_cuda else "gloo", rank, world, "env://", cfg.timeout_s)
    return _train_joined(cfg, rank, world, device, on_step, per_rank)


def _train_joined(cfg: TrainConfig, rank: int, world: int, device: torch.device, on_step, per_rank=None,
                  seat=None) -> list[StepStats]:
    """Train as ``rank`` of a default group already made (torchrun's, or a machine's after the rendezvous)."""
    # torchrun forwards SIGINT/SIGTERM to every rank: with a save directory, the ranks finish the step,
    # agree, save and stop (a second signal stops at once); without one the default applies.
    signalled: list[int] = []
    previous = {}
    if cfg.save_dir:
        def on_signal(signum, frame):
            if signalled:
                raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
            signalled.append(signum)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        outcome: dict = {}
        history = run_rank(cfg, rank, device, report=on_step, stop_requested=lambda: bool(signalled), outcome=outcome)
        if cfg.collect_all_ranks:
            gathered = [None] * world if rank == 0 else None
            dist.gather_object([asdict(s) for s in history], gathered, dst=0)
            if rank == 0 and per_rank is not None:
                per_rank.update({r: [StepStats(**s) for s in h] for r, h in enumerate(gathered)})
        if cfg.trace:
            spans = [None] * world if rank == 0 else None
            dist.gather_object(outcome.pop("trace", []), spans, dst=0)
            if rank == 0:
                _write_trace(cfg, dict(enumerate(spans)))
        dist.barrier()
        if "stopped_after" in outcome:
            kind = Terminated if signalled and signalled[0] == signal.SIGTERM else KeyboardInterrupt
            where = " (asked on another machine)" if seat is not None and not signalled else ""
            stop = kind(f"stopped after step {outcome['stopped_after']}{where}; saved {outcome.get('saved')}")
            stop.agreed = True
            raise stop
        return history
    except BaseException as exc:
        if seat is None:
            raise
        from runtime.launch.machine_train import ended

        out = ended(exc, seat)
        if isinstance(out, SystemExit):
            # The line is with the machine's launcher. Tearing down a gloo group whose peers died can abort in C++
            # ("terminate called without an active exception", on stderr beside that line), so this process leaves
            # without its group's destructors; nothing of it is left to save.
            from runtime.launch.plan_ranks import release

            release(seat)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(out.code)
        raise out from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if seat is not None:
            from runtime.launch.plan_ranks import release

            release(seat)
        try:
            dist.destroy_process_group()
        except Exception:
            pass  # a group whose peers are gone


def _train_spawned(cfg: TrainConfig, world: int, devices: RunDevices, on_step, per_rank, notice) -> list[StepStats]:
    import torch.multiprocessing as mp

    sweep_stale_run_directories()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    run_dir = run_directory()
    procs = []
    try:
        with terminate_as_interrupt():
            for r in range(world):
                procs.append(ctx.Process(target=_worker, args=(r, world, cfg, devices, f"file://{run_dir}/store", q, stop,
                                                               os.getpid()), daemon=True))
                procs[-1].start()
            return _supervise(cfg, world, procs, q, stop, on_step, per_rank, notice)
    finally:
        stop_processes(procs)
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(cfg: TrainConfig, world: int, procs, q, stop, on_step, per_rank, notice) -> list[StepStats]:
    """Follow the ranks' messages until all are done; raise the first failure's line, or the interrupt."""
    history, done, outcomes, traces = [], set(), {}, {}
    interrupt: KeyboardInterrupt | None = None
    last_news = time.monotonic()
    deadline = None  # once interrupted: how long the ranks get to finish the step and save
    with interrupts_as_flags() as interrupted:
        while len(done) < world:
            try:
                try:
                    interrupted()  # a Ctrl-C or SIGTERM is taken here, between two messages
                    msg = q.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and r not in done]
                    if dead:
                        time.sleep(0.5)  # its error message may still be in flight
                        if q.empty():
                            raise BatonError(_root_cause([], procs, cfg, done))
                        continue
                    now = time.monotonic()
                    if deadline is not None and now > deadline:
                        raise type(interrupt)(f"the ranks did not finish the step and save within "
                                              f"--timeout {cfg.timeout_s:g} s, so nothing was saved")
                    if now - last_news > cfg.timeout_s + 60:
                        raise BatonError(f"no progress for {cfg.timeout_s + 60:.0f} s; stopped all ranks "
                                         f"({_stuck_ranks(procs, cfg) or 'no rank is stopped'})", field="--timeout")
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
                elif msg[0] == "trace":
                    traces[msg[1]] = msg[2]
                elif msg[0] == "done":
                    done.add(msg[1])
                    outcomes[msg[1]] = msg[2]
                elif msg[0] == "error":
                    raise BatonError(_root_cause(_collect_errors(msg, q), procs, cfg, done))
            except KeyboardInterrupt as exc:
                if interrupt is not None or not cfg.save_dir:
                    raise
                interrupt = exc
                stop.set()
                deadline = time.monotonic() + cfg.timeout_s
                notice(f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'}: the ranks finish this step and "
                       f"save a checkpoint (at most {cfg.timeout_s:g} s); interrupt again to stop at once without saving")
    if cfg.trace and traces:
        _write_trace(cfg, traces)  # before an interrupt's exception: the steps run so far are worth seeing
    if interrupt is not None:
        o = outcomes.get(0, {})
        if "stopped_after" in o:
            raise type(interrupt)(f"stopped after step {o['stopped_after']}; saved {o.get('saved')}")
        # The run reached its last step anyway: it ended normally.
    return history


def _write_trace(cfg: TrainConfig, per_rank: dict) -> None:
    from runtime.measure.trace import write_chrome_trace

    write_chrome_trace(cfg.trace, cfg.plan, per_rank)


# --- which rank failed first -----------------------------------------------------------------------

# Messages of ranks that only lost a peer: they name the victim, not the cause.
_KNOCK_ON = re.compile(r"connection (reset|closed|refused)|broken pipe|timed out|timeout|waited more than|"
                       r"socket|peer", re.IGNORECASE)


def _collect_errors(first, q, window_s: float = 1.0) -> list:
    """The first error and those that arrive within ``window_s`` (a peer's line may come later than the
    knock-on failures it caused)."""
    errors = [first]
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        try:
            m = q.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        if m[0] == "error":
            errors.append(m)
    return errors


def _describe(cfg: TrainConfig, rank: int) -> str:
    return f"rank {rank} (device {cfg.plan.device_ids()[rank]})"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stuck_ranks(procs, cfg: TrainConfig) -> str:
    stopped = [r for r, p in enumerate(procs) if p.is_alive() and p.pid and process_state(p.pid) == "T"]
    return ", ".join(f"{_describe(cfg, r)} is stopped (SIGSTOP?)" for r in stopped)


def _root_cause(errors: list, procs, cfg: TrainConfig, done: set) -> str:
    """One line naming the rank that failed first: a user error; else a rank that died without a word
    (killed) or is stopped; else the first error that is not a lost connection; else the first error."""
    user = [e for e in errors if e[3]]
    if user:
        return user[0][2]
    reported = {e[1] for e in errors}
    dead = [(r, p.exitcode) for r, p in enumerate(procs)
            if r not in done and r not in reported and not p.is_alive() and p.exitcode not in (0, None)]
    stuck = _stuck_ranks(procs, cfg)
    if dead:
        r, code = dead[0]
        line = f"{_describe(cfg, r)} {_exit_reason(code)} without a report"
        return line + (f"; {len(errors)} other rank(s) then lost their connection to it" if errors else "")
    if stuck:
        first = errors[0][2] if errors else ""
        return f"{stuck} and stopped answering; " + (first or "the other ranks waited for it")
    own = [e for e in errors if not _KNOCK_ON.search(e[2])]
    chosen = (own or errors)[0]
    if chosen[4]:
        where = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.gettempdir())
        path = where / f"baton-train-{os.getpid()}-rank{chosen[1]}.traceback.txt"
        try:
            where.mkdir(parents=True, exist_ok=True)
            path.write_text(chosen[4])
            return f"{chosen[2]} (traceback: {path})"
        except OSError:
            pass
    return chosen[2]
