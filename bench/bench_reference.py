"""Baton's one-device step against the plainest fast PyTorch loop of the same model, in one run (issue 27).

The two contenders train the same model from the same initial weights on the same micro-batches:

* **reference**: ``runtime.model.family.reference_model`` (the single-device module the runtime's parity tests
  compare against), the model spec's attention (``fused``: one ``F.scaled_dot_product_attention``),
  gradient accumulation over the plan's micro-batches (each micro-batch's mean loss divided by their
  count), ``torch.optim.AdamW(fused=True)`` where this torch has it for the device, else ``foreach=True``;
  one ``loss.item()`` per step, as a loop that logs its loss pays; gradients set to None after the update; no
  gradient norm (the engine computes one every step for its log, clipping or not);
* **baton**: a one-device plan (``baton.plan.simple_plan``, as bench/bench_gpu.py builds them) trained by
  ``runtime.train.engine.Engine.train_step``, as ``baton train`` runs its one rank (``runtime.launch.launcher.run_rank``):
  in a default process group of this process alone (gloo on CPU, NCCL on CUDA), with the thread count
  and TF32 setting the launcher gives a one-rank run. A ``+offload`` label (``plan_choices``) also keeps some of its
  layers' activations in host memory between the passes (the plan's ``offload``); the reference never does.

Precision (``--dtype``): in fp32 both train fp32 weights. In bf16/fp16 the reference does what the runtime
does (``--precision masters``, the default): the module in the compute dtype, fp32 master weights that
AdamW updates, the gradients cast to fp32 on their way in and the weights rounded back after the step.
That is the fair comparison: the two do the same arithmetic on the same bytes, so the ratio measures
Baton's overhead, not a different recipe. ``--precision autocast`` (fp32 weights under
``torch.autocast``, fp32 gradients) is there for information: it casts every weight once per
micro-batch and keeps fp32 gradients, so it does other work.

Rounds are interleaved (reference, baton, reference, baton, ...; ``--steps`` steps each per round) so the
machine's drift hits both; ``--warmup`` steps of each come first and are not counted. Per contender:
median step time and tokens/s (global batch x sequence / median); the ratio is Baton's tokens/s over
the reference's (target >= 0.97), with the median of the per-round ratios beside it.

On CPU the engine's ``keep_freed_memory`` (``runtime.launch.host_memory``: freed host memory is reused, not
returned) holds for the whole process, so the reference runs with it too. On CUDA both models live on the GPU at
once: the peak memory of a step is the contender's own state (its weights, gradients and optimizer state, counted
from its tensors) plus what the step allocated above all that was allocated before it.

On CPU both run on ``--threads`` threads (default: every core, as ``baton train`` gives one rank; on a shared
machine ``--threads 1`` is steadier: two threads there swung steps tenfold).

Run: ``python bench/bench_reference.py [--device cpu|cuda] [--model small] [--dtype fp32] ...``; writes
bench/results/reference.json and reference.md (``--out``, ``--name``).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from baton.model_spec import PRESETS, ModelSpec  # noqa: E402
from baton.plan import Plan, simple_plan  # noqa: E402
from runtime.train.precision import storage_bytes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEVICE_ID = "gpu:0"
CLUSTER_NAME = "local-gpu"
TARGET = 0.97
"""Baton's tokens/s over the reference's that issue 27 asks for."""


def bench_spec(base: str, *, seq_len: int | None = None, dtype: str = "fp32", attention: str = "fused") -> ModelSpec:
    """A preset with fused attention and no dropout (the reference's attention keeps no dropout mask)."""
    spec = PRESETS[base]
    return spec.with_overrides(name=f"{base}-{dtype}-s{seq_len or spec.seq_len}", dtype=dtype, attention=attention, dropout=0.0,
                               seq_len=seq_len or spec.seq_len)


def one_device_plan(spec: ModelSpec, *, micro_batch_size: int, num_microbatches: int,
                    recompute: list[str] | tuple[str, ...] = (), offload: list[str] | tuple[str, ...] = ()) -> Plan:
    """The whole model on one device, as bench/bench_gpu.py plans it; ``offload``: the tensors its layers keep in host
    memory between the passes (``DeviceShare.offload``)."""
    from baton.plan import validate

    plan = simple_plan(spec, cluster=CLUSTER_NAME, stages=[[(DEVICE_ID, 1)]], layers=[spec.num_layers], units_per_layer=1,
                       micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                       recompute={DEVICE_ID: list(recompute)})
    if not offload:
        return plan
    # simple_plan has no offload argument: set it on the one device and validate again (offload_problem).
    (pipe,) = plan.pipelines
    (stage,) = pipe.stages
    (share,) = stage.devices
    stage = dataclasses.replace(stage, devices=(dataclasses.replace(share, offload=tuple(offload)),))
    return validate(dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=(stage,)),)))


def recompute_sets(spec: ModelSpec) -> dict[str, list[str]]:
    """Recomputation choices of a plan: none, the attention core, every operator of the layer."""
    from baton.operators import operator_names

    names = operator_names(spec)
    attention = [n for n in names if n in ("attn_core", "attn_scores", "softmax", "attn_dropout", "attn_v")]
    return {"none": [], "attention": attention, "all": names}


OFFLOAD = "+offload"
"""Suffix of a label whose plan also keeps activations in host memory (``plan_choices``)."""


def plan_choices(spec: ModelSpec) -> dict[str, tuple[list[str], list[str]]]:
    """Label -> (operators recomputed, tensors offloaded) of a one-device plan: each of ``recompute_sets`` as it is, and
    with ``+offload``:

    * ``all+offload``: the layer boundary, every tensor a layer holds with every operator recomputed
      (``baton.memory.held_tensors``): Cephalo's choice (``solver.baselines.cephalo_offload``). Four tensors beside
      a whole layer's compute: the cost model expects the copies in to hide behind the backward and its
      recomputation, the copies out mostly behind the forward;
    * ``none+offload`` and ``attention+offload``: the held tensors of the attention block (``baton.memory.tensor_blocks``).
      Without recomputation the layer holds seven activations of the hidden width there (the input, the
      LayerNorm's output, q, k, v, the attention's output, the residual sum; and two small statistics) beside the
      block's few matmuls, so the copies outlast it and eq. 2o predicts an exposed transfer: the other end of the
      model's range. The MLP block's tensors (two of them 4x wide) would expose it too, at more pinned memory and
      copy time than the bench needs; fused q, k, v go together, as ``offload_problem`` asks."""
    from baton.memory import held_tensors, tensor_blocks

    sets = recompute_sets(spec)
    block = tensor_blocks(spec)
    out = {label: (ops, []) for label, ops in sets.items()}
    for label, ops in sets.items():
        held = held_tensors(spec, frozenset(ops))
        chosen = list(held) if label == "all" else [t for t in held if block[t] == "attn"]
        out[label + OFFLOAD] = (ops, chosen)
    return out


def base_label(label: str) -> str:
    """The label of the same recompute set without offload (``all+offload`` -> ``all``)."""
    return label[: -len(OFFLOAD)] if label.endswith(OFFLOAD) else label


@contextmanager
def one_rank_group(device: torch.device):
    """The default process group of this process alone, as the launcher makes it for a one-device plan (NCCL on
    CUDA, gloo on CPU); an existing group is used as it is."""
    if dist.is_initialized():
        yield
        return
    tmp = tempfile.mkdtemp(prefix="baton-bench-reference-")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=600))
    try:
        yield
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


def adamw_kwargs(device: torch.device) -> dict:
    """``fused=True`` where this torch has fused AdamW for ``device`` (CUDA; CPU since torch 2.4), else foreach."""
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError):
        return {"foreach": True}
    return {"fused": True}


class ReferenceLoop:
    """The plainest fast training loop of ``spec`` on one device (see the module docstring)."""

    def __init__(self, spec: ModelSpec, *, device: torch.device, micro_batch_size: int, num_microbatches: int,
                 seed: int = 0, lr: float = 3e-4, precision: str = "masters", model: torch.nn.Module | None = None):
        from runtime.model.family import reference_model
        from runtime.train.precision import compute_dtype

        if precision not in ("masters", "autocast"):
            raise ValueError(f"precision must be 'masters' or 'autocast', got {precision!r}")
        self.spec, self.device = spec, device
        self.micro_batch_size, self.num_microbatches = micro_batch_size, num_microbatches
        self.model = (model if model is not None else reference_model(spec, seed=seed)).to(device)
        dtype = compute_dtype(spec.dtype)
        self.autocast = dtype != torch.float32 and precision == "autocast"
        self.params = list(self.model.parameters())
        self.masters = None
        if dtype != torch.float32 and not self.autocast:
            # fp32 masters copied before the cast, the module in the compute dtype (runtime.train.precision).
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            self.model.to(dtype)
            self.params = list(self.model.parameters())
        self.adamw = adamw_kwargs(device)
        self.lr = lr
        self.optimizer = self._adamw()
        self.precision = "autocast" if self.autocast else ("masters" if self.masters else "fp32")
        self._dtype = dtype

    def _adamw(self) -> torch.optim.Optimizer:
        from runtime.train.engine import ADAM_BETAS, ADAM_EPS

        return torch.optim.AdamW(self.masters or self.params, lr=self.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0,
                                 **self.adamw)

    @torch.no_grad()
    def reset(self, initial: dict[str, torch.Tensor]) -> None:
        """Back to the weights ``initial`` (name -> fp32 value) with a fresh AdamW, as if just built."""
        names = [n for n, _ in self.model.named_parameters()]
        for name, p, master in zip(names, self.params, self.masters or self.params):
            master.copy_(initial[name])
            if master is not p:
                p.copy_(master)
        self.optimizer = self._adamw()

    def train_step(self, step: int, data) -> float:
        """One optimizer step on the global batch ``data.batch(step, 0..b*m-1)``; returns its mean loss."""
        mbs, m, dev = self.micro_batch_size, self.num_microbatches, self.device
        cast = torch.autocast(dev.type, dtype=self._dtype) if self.autocast else nullcontext()
        total = torch.zeros((), device=dev)
        for i in range(m):
            samples = torch.arange(mbs) + i * mbs
            x, y = data.batch(step, samples)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with cast:
                logits, _ = self.model(x, step=step, samples=samples)  # (b, T, V)
            # Cross-entropy in fp32 whatever the compute dtype, as the runtime's head (and autocast) computes it.
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            (loss / m).backward()  # accumulates into .grad
            total += loss.detach().float()
        with torch.no_grad():
            if self.masters is not None:
                for master, p in zip(self.masters, self.params):
                    master.grad = p.grad.float()
            self.optimizer.step()
            if self.masters is not None:
                torch._foreach_copy_(self.params, self.masters)  # round the updated masters into the module
                for master in self.masters:
                    master.grad = None
        self.model.zero_grad(set_to_none=True)
        return float(total) / m

    def resident_bytes(self) -> int:
        """Bytes it holds between steps: weights, masters, AdamW state (the gradients are freed)."""
        state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return storage_bytes([*self.params, *(self.masters or []), *state])


class BatonContender:
    """Baton's engine on a one-device plan, trained step by step as ``runtime.launch.launcher.run_rank`` does."""

    def __init__(self, plan: Plan, *, device: torch.device, seed: int = 0, lr: float = 3e-4, full=None):
        from runtime.train.engine import Engine
        from runtime.train.optim_settings import LRSchedule

        # run_rank's engine with baton train's defaults: no weight decay, no clipping, constant learning rate.
        self.engine = Engine(plan, 0, device=device, seed=seed, lr=lr, full=full, timeout_s=600.0,
                             schedule=LRSchedule(lr=lr), clip_grad=0.0)
        self.stats = []

    def train_step(self, step: int, data) -> float:
        stats = self.engine.train_step(step, data)
        self.stats.append(stats)
        return stats.loss

    def resident_bytes(self) -> int:
        held = self.engine.precision.state_bytes()
        return held.weights_bytes + held.grads_bytes + held.master_bytes + held.moments_bytes


def timed(fn, device: torch.device) -> tuple[float, object]:
    """(wall ms, result) of ``fn()``, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


def build_reference(spec: ModelSpec, *, device: torch.device, seed: int = 0, lr: float = 3e-4,
                    precision: str = "masters") -> tuple[ReferenceLoop, dict[str, torch.Tensor]]:
    """The reference loop of ``spec`` on ``device`` (its micro-batches set per run), and its initial weights by name
    (fp32, on the host): Baton's engines start from them."""
    loop = ReferenceLoop(spec, device=torch.device(device), micro_batch_size=1, num_microbatches=1, seed=seed, lr=lr,
                         precision=precision)
    names = [n for n, _ in loop.model.named_parameters()]
    initial = {n: p.detach().float().cpu().clone() for n, p in zip(names, loop.masters or loop.params)}
    return loop, initial


def interleave(contenders: dict, data, *, device: torch.device, warmup: int, rounds: int, steps: int) -> dict:
    """Train ``contenders`` (name -> ``ReferenceLoop``, ``BatonContender`` or anything with their ``train_step`` and
    ``resident_bytes``, each counting its own steps from 0, so all see the same batches) ``warmup`` steps each, then
    ``rounds`` rounds of ``steps`` steps each in turn. Returns per contender its measured step times by round, every
    step's loss, and (CUDA) each measured step's peak memory: the contender's own state (``resident_bytes``) plus
    what its step allocated above all that was allocated before it. Baton's ``StepStats`` get that peak too (the
    engine's own would count the others')."""
    cuda = device.type == "cuda"
    counters = dict.fromkeys(contenders, 0)
    record = {k: {"step_ms": [], "losses": [], "peak_bytes": []} for k in contenders}

    def one_step(name: str, measured: list | None) -> None:
        contender = contenders[name]
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        ms, loss = timed(lambda: contender.train_step(counters[name], data), device)
        counters[name] += 1
        record[name]["losses"].append(loss)
        # Its own state plus what the step allocated above everything held before it. Not the allocator's peak less
        # the other's state: the idle reference loop held about 2 GiB more than its weights, masters and moments
        # (gpt3-350m on an H200, 2026-11-27), which made Baton's peak read 2 GiB high.
        peak = contender.resident_bytes() + torch.cuda.max_memory_allocated(device) - before if cuda else 0
        if measured is not None:
            measured.append(ms)
            if cuda:
                record[name]["peak_bytes"].append(peak)
        if cuda and isinstance(contender, BatonContender):
            contender.stats[-1] = dataclasses.replace(contender.stats[-1], peak_allocated_bytes=peak, memory_bytes=[peak])

    for name in contenders:  # warm-up, not counted
        for _ in range(warmup):
            one_step(name, None)
    for _ in range(rounds):  # reference, baton, reference, baton, ...
        for name in contenders:
            record[name]["step_ms"].append([])
            for _ in range(steps):
                one_step(name, record[name]["step_ms"][-1])
    return record


def _summary(step_ms: list[list[float]], tokens: int) -> dict:
    flat = [t for r in step_ms for t in r]
    median = statistics.median(flat)
    return {"median_ms": median, "tokens_per_s": tokens / median * 1e3, "min_ms": min(flat), "max_ms": max(flat),
            "round_median_ms": [statistics.median(r) for r in step_ms], "step_ms": step_ms}


def run_reference(spec: ModelSpec, *, device: str = "cpu", micro_batch_size: int, global_batch: int, steps: int = 3,
                  rounds: int = 4, warmup: int = 2, seed: int = 0, lr: float = 3e-4,
                  recompute: dict[str, list[str]] | None = None, offload: dict[str, list[str]] | None = None,
                  precision: str = "masters", built: tuple[ReferenceLoop, dict] | None = None, threads: int | None = None,
                  log=print) -> tuple[dict, dict]:
    """Time the reference loop against Baton's one-device plan of each ``recompute`` entry (label -> operators the plan
    recomputes; default ``{"none": []}``), one plan after another, each in interleaved rounds with the reference
    (which stays built, and starts every pair from the initial weights and the first batch again). ``offload``: label
    -> tensors that label's plan keeps in host memory (``plan_choices``; a label not in it offloads nothing); the
    reference keeps everything on the device whatever Baton's plan does.

    Returns (the JSON-ready result, label -> Baton's ``StepStats`` of the plan's last warm-up step and its measured
    steps, as ``runtime.measure.report.build_report`` wants them: it drops the first). On CUDA each step's peak
    memory is the contender's own state plus what the step allocated above all that was held before it (``interleave``). ``built``: a ``build_reference`` of ``spec``
    to reuse (building a 1.3B model on the host takes tens of seconds); its loop takes this call's micro-batches.
    ``threads``: on CPU, torch's threads (default: every core, as ``baton train`` gives a run of one rank)."""
    from runtime.data.source import TokenSource

    if global_batch % micro_batch_size:
        raise ValueError(f"micro-batch {micro_batch_size} does not divide the global batch {global_batch}")
    if min(steps, rounds) < 1 or warmup < 0:
        raise ValueError("steps and rounds must be at least 1, warmup at least 0")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    m = global_batch // micro_batch_size
    recompute = {"none": []} if recompute is None else recompute
    offload = offload or {}
    unknown = sorted(set(offload) - set(recompute))
    if unknown:
        raise ValueError(f"offload names labels without a recompute set: {', '.join(unknown)}")
    tokens = global_batch * spec.seq_len
    if cuda:  # the launcher's one rank: the model's TF32 setting (runtime.launch.launcher.run_rank)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.tf32
    else:  # and its threads: every core for a run of one rank (runtime.launch.launcher._worker)
        torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    data = TokenSource(spec, seed=seed, global_batch=global_batch)
    t0 = time.perf_counter()
    if built is None:
        built = build_reference(spec, device=dev, seed=seed, lr=lr, precision=precision)
    reference, initial = built
    reference.micro_batch_size, reference.num_microbatches = micro_batch_size, m
    build_s = {"reference": time.perf_counter() - t0}
    pairs, baton_stats = [], {}
    with one_rank_group(dev):
        for label, ops in recompute.items():
            t0 = time.perf_counter()
            reference.reset(initial)  # every pair starts from the same weights and the same first batch
            plan = one_device_plan(spec, micro_batch_size=micro_batch_size, num_microbatches=m, recompute=ops,
                                   offload=offload.get(label, ()))
            baton = BatonContender(plan, device=dev, seed=seed, lr=lr, full=initial.__getitem__)
            build_s[f"baton {label}"] = time.perf_counter() - t0
            record = interleave({"reference": reference, "baton": baton}, data, device=dev, warmup=warmup, rounds=rounds,
                                steps=steps)
            summary = {k: {**_summary(v["step_ms"], tokens), "losses": v["losses"],
                           **({"peak_allocated_bytes": max(v["peak_bytes"])} if v["peak_bytes"] else {})}
                       for k, v in record.items()}
            ratio = summary["reference"]["median_ms"] / summary["baton"]["median_ms"]
            paired = statistics.median(a / b for a, b in zip(summary["reference"]["round_median_ms"],
                                                              summary["baton"]["round_median_ms"]))
            pairs.append({"plan": f"mb {micro_batch_size} x {m}, recompute {label}", "recompute": label,
                          "offload": list(offload.get(label, ())), **summary, "ratio": ratio, "ratio_paired": paired})
            baton_stats[label] = baton.stats[max(0, warmup - 1):]  # the last warm-up step, then the measured ones
            log(f"{spec.name} {pairs[-1]['plan']}: reference {summary['reference']['median_ms']:.1f} ms "
                f"({summary['reference']['tokens_per_s']:,.0f} tokens/s), baton {summary['baton']['median_ms']:.1f} ms "
                f"({summary['baton']['tokens_per_s']:,.0f} tokens/s), baton/reference {ratio:.3f} (per round {paired:.3f})")
            del baton
            gc.collect()  # the engine's GPU memory back before the next plan's is built
            if cuda:
                torch.cuda.empty_cache()
    settings = {"model": spec.to_dict(), "device": device, "micro_batch_size": micro_batch_size, "global_batch": global_batch,
                "num_microbatches": m, "steps_per_round": steps, "rounds": rounds, "warmup_steps": warmup, "seed": seed,
                "lr": lr, "precision": reference.precision, "reference_adamw": reference.adamw,
                "tokens_per_step": tokens, "build_s": build_s}
    return {"settings": settings, "pairs": pairs}, baton_stats


# --- the command ---------------------------------------------------------------------------------


def environment(device: str) -> dict:
    """Where the run ran: the machine, the torch build, the device, the load on the host."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "processor": _cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
           "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if device.startswith("cuda") and torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def host_description(env: dict) -> str:
    """The CPU of ``environment``, its cores and torch's threads, as the results' Markdown names them."""
    return f"{env['processor']} ({env['cpus']} cores, torch on {env['threads']} thread{'s' if env['threads'] != 1 else ''})"


def markdown(result: dict) -> str:
    """The result as a Markdown table, one line per pair of contenders."""
    s, env = result["settings"], result["environment"]
    model = s["model"]
    lines = [f"# Baton's one-device step against the plainest fast PyTorch loop (`{result['command']}`)", "",
             "| model | plan | reference ms | reference tokens/s | Baton ms | Baton tokens/s | Baton / reference | "
             "per round (median) | target |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in result["pairs"]:
        ref, bat = p["reference"], p["baton"]
        lines.append(f"| {model['name']} | {p['plan']} | {ref['median_ms']:.1f} | {ref['tokens_per_s']:,.0f} | "
                     f"{bat['median_ms']:.1f} | {bat['tokens_per_s']:,.0f} | {p['ratio']:.3f} | {p['ratio_paired']:.3f} | "
                     f">= {TARGET} |")
    where = env.get("gpu") or host_description(env)
    load = env.get("load_average")
    lines += ["", f"Model `{model['name']}`: {model['num_layers']} layers, hidden {model['hidden_dim']}, {model['num_heads']} heads, "
                  f"sequence {model['seq_len']}, vocabulary {model['vocab_size']}, {model['dtype']}"
                  f"{'' if s['precision'] == 'fp32' else ' (reference: ' + s['precision'] + ')'}, "
                  f"{model['attention']} attention. Global batch {s['global_batch']} = {s['micro_batch_size']} x "
                  f"{s['num_microbatches']} micro-batches. {s['rounds']} interleaved rounds of {s['steps_per_round']} steps "
                  f"each after {s['warmup_steps']} warm-up steps; ms are medians over every measured step. "
                  f"Reference AdamW: {', '.join(f'{k}={v}' for k, v in s['reference_adamw'].items())}.",
              f"Device: {s['device']} on {where}; torch {env['torch']}"
              + (f", load average {load[0]:.2f} at the start" if load else "") + f", {env['date_utc']} UTC."]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out: Path, name: str = "reference") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--model", default="small", choices=sorted(PRESETS), help="preset, with fused attention and no dropout")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--precision", default="masters", choices=("masters", "autocast"),
                    help="the reference's bf16/fp16 recipe (see the module docstring)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps of each contender per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", default="none",
                    choices=tuple(f"{r}{o}" for o in ("", OFFLOAD) for r in ("none", "attention", "all")),
                    help="what Baton's plan recomputes, and with +offload keeps in host memory (plan_choices; the "
                         "reference recomputes and offloads nothing)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: every core, as baton train gives one rank; 1 is steadier on a shared machine)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="reference", help="the results' file name (without .json/.md)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    spec = bench_spec(args.model, seq_len=args.seq_len, dtype=args.dtype)
    env = environment(args.device)  # the load before the run
    if args.device == "cpu":
        env["threads"] = args.threads or max(1, os.cpu_count() or 1)
    ops, offloaded = plan_choices(spec)[args.recompute]
    result, _ = run_reference(spec, device=args.device, micro_batch_size=args.micro_batch, global_batch=args.global_batch,
                              steps=args.steps, rounds=args.rounds, warmup=args.warmup, precision=args.precision,
                              recompute={args.recompute: ops}, offload={args.recompute: offloaded}, threads=args.threads)
    result = {"command": " ".join(["python bench/bench_reference.py", *(argv if argv is not None else sys.argv[1:])]).strip(),
              "environment": env, **result}
    write_results(result, args.out, args.name)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
