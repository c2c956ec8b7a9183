"""Helpers for the runtime tests: spawn real ranks over gloo, and the single-device reference run."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baton.model_spec import PRESETS
from baton.plan import Plan, simple_plan, validate
from runtime.launch.processes import die_with_parent, pid_alive, stop_processes

RANK_TIMEOUT_S = 60


def tiny(dropout: float = 0.1, **changes):
    return PRESETS["tiny"].with_overrides(dropout=dropout, **changes)


def plan_of(spec, stages, layers, units, *, m=2, mbs=2, recompute=None, replicas=1) -> Plan:
    """``stages`` as [[units, ...], ...]; device ids are generated ('r0:0', ...); ``recompute`` maps a
    flat device index to operator names; ``replicas`` > 1 copies the pipeline onto fresh devices."""
    pipes = []
    per_pipe = sum(len(st) for st in stages)
    for r in range(replicas):
        ids = iter(f"d{r}:{j}" for j in range(per_pipe))
        groups = [[(next(ids), u) for u in st] for st in stages]
        rec = {f"d{r}:{j}": ops for j, ops in (recompute or {}).items()}
        p = simple_plan(spec, cluster="cpu", stages=groups, layers=layers, units_per_layer=units,
                        micro_batch_size=mbs, num_microbatches=m, recompute=rec)
        pipes.append(p.pipelines[0])
    return validate(replace(p, pipelines=tuple(pipes)))


# --- spawning ranks --------------------------------------------------------------------------------


def _entry(fn, rank, world, tmp, args, test_pid, environ, cwd):
    # A test run that is killed (or times out) leaves no ranks behind: a spawned rank's parent is the test
    # process; a fork server's children end with the server, which ends with the test process.
    die_with_parent(os.getppid())
    if not pid_alive(test_pid) or os.getppid() == 1:
        os._exit(1)  # the test (or the server) ended while this rank started
    # A fork server hands its children the environment and directory it started with: the test's own now.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S))
        out = fn(rank, world, *args)
        torch.save(out, f"{tmp}/result-{rank}.pt")
    except BaseException:
        with open(f"{tmp}/error-{rank}.txt", "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_context():
    """Ranks fork from a server that imported torch and the runtime once: a spawned rank spent about 3 s
    of a small parity test importing them, every time. The server is a fresh process (no threads, no CUDA,
    nothing a test did to this one), so ranks start as clean as spawned ones; where there is none, spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "runtime.train.engine", "runtime.model.gpt", "tests.runtime_helpers"])
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 150.0) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes over gloo; return their results.

    A failing rank's traceback is raised here (the first one written, not a peer's 'connection reset');
    a run past ``timeout`` seconds is killed.
    """
    tmp = tempfile.mkdtemp(prefix="baton-ranks-")
    ctx = _rank_context()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, tmp, args, os.getpid(), dict(os.environ), os.getcwd()), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            errors = sorted((os.path.getmtime(os.path.join(tmp, f)), f) for f in os.listdir(tmp) if f.startswith("error-"))
            if errors:
                time.sleep(0.5)
                first = errors[0][1]
                raise AssertionError(f"{first[:-4]} failed:\n" + open(os.path.join(tmp, first)).read())
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout} s")
            time.sleep(0.05)
        errors = sorted(f for f in os.listdir(tmp) if f.startswith("error-"))
        if errors:
            raise AssertionError(f"{errors[0][:-4]} failed:\n" + open(os.path.join(tmp, errors[0])).read())
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        assert not bad, f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}"
        return [torch.load(f"{tmp}/result-{r}.pt", weights_only=False) for r in range(world)]
    finally:
        stop_processes(procs)
        shutil.rmtree(tmp, ignore_errors=True)  # results are loaded; rendezvous and error files would pile up


# --- what the parity tests compare -----------------------------------------------------------------


def parallel_worker(rank, world, plan, steps, seed, lr):
    """One step's loss and local gradients, then the losses of ``steps`` optimizer steps."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    from runtime.parallel.tensor_parallel import gather_uneven

    engine = Engine(plan, rank, seed=seed, lr=lr)
    gathered = None
    if engine.groups.tp is not None and engine.model.h:  # uneven all-gather of an FFN weight
        block = next(iter(engine.model.h.values()))
        stage = engine.topo.stage(engine.pos)
        sizes = [d.units * plan.model.ffn_dim // stage.units_per_layer for d in stage.devices]
        weight = block.mlp.gate_proj.weight if plan.model.llama else block.mlp.c_fc.weight
        gathered = (block.layer, gather_uneven(weight.detach(), sizes, 0, engine.groups.tp))
    data = TokenSource(plan.model, seed=seed, global_batch=plan.global_batch)
    stats = engine.forward_backward(0, data)
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    losses = [stats.loss]
    engine.optimizer.step()
    # A caller's zero_grad() drops the gradients' views of the engine's flat buffer; the engine must
    # bind them again, or data-parallel replicas would all-reduce a stale buffer and drift apart.
    engine.model.zero_grad(set_to_none=True)
    for step in range(1, steps):
        losses.append(engine.train_step(step, data).loss)
    return {"grads": grads, "slices": engine.model.slices(), "losses": losses, "stats": stats,
            "position": engine.pos, "gathered": gathered}


def reference_run(spec, *, global_batch, steps, seed, lr):
    """The single-device model on the same data: step-0 gradients and the loss of every step."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import ADAM_BETAS, ADAM_EPS
    from runtime.model.family import reference_model

    model = reference_model(spec, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    data = TokenSource(spec, seed=seed, global_batch=global_batch)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(step, torch.arange(global_batch))
        _, loss = model(x, y, step=step)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_parity(plan, *, steps=3, seed=0, lr=1e-3, tol=1e-5):
    """Run ``plan`` on spawned ranks and the reference; compare losses and every gradient slice."""
    from runtime.model.family import init_parameter
    from runtime.parallel.slicing import take_slice

    results = run_ranks(parallel_worker, len(plan.device_ids()), plan, steps, seed, lr)
    ref_losses, ref_grads = reference_run(plan.model, global_batch=plan.global_batch, steps=steps, seed=seed, lr=lr)
    for res in results:
        if res["gathered"] is not None:
            layer, full = res["gathered"]
            want = init_parameter(plan.model, f"h.{layer}.mlp.{'gate_proj' if plan.model.llama else 'c_fc'}.weight", seed)
            assert torch.equal(full, want), "uneven all-gather did not reassemble the full weight"
        pos = res["position"]
        stage = plan.pipelines[pos.pipeline].stages[pos.stage]
        planned = {op: plan.num_microbatches * stage.num_layers for op in pos.recompute if stage.num_layers}
        assert res["stats"].recomputed_ops == planned, f"rank {pos.rank} recomputed {res['stats'].recomputed_ops}, plan says {planned}"
        for i, (got, want) in enumerate(zip(res["losses"], ref_losses)):
            assert abs(got - want) <= tol * abs(want), f"step {i} loss {got} != reference {want}"
        for name, g in res["grads"].items():
            want = take_slice(ref_grads[name], res["slices"][name])
            assert g.shape == want.shape, name
            err = rel_err(g, want)
            assert err <= tol, f"rank {res['position'].rank}: grad of {name} off by {err:.2e} (relative)"
    return results


# --- replicas of different shapes (heterogeneous data parallelism) ---------------------------------


def replicas_plan(spec, replicas: list[dict], *, zero_stage: int = 0, ratios=None, cluster: str = "cpu4") -> Plan:
    """A plan of several replicas, each its own shape and batch: ``replicas[r]`` has ``stages`` ([[units,
    ...], ...]), ``layers``, ``units`` (per stage, or one for all) and optionally ``m``, ``mbs`` and
    ``recompute`` (flat device index in the replica -> operators). Device ids are ``local:<rank>`` (the
    cpu4 cluster's, for up to 4 devices). ``ratios``: one ``shard_ratio`` per device in rank order (or
    None for equal shares)."""
    from baton.plan import Pipeline

    pipes, rank = [], 0
    for rep in replicas:
        ids = [f"local:{rank + j}" for j in range(sum(len(st) for st in rep["stages"]))]
        it = iter(ids)
        groups = [[(next(it), u) for u in st] for st in rep["stages"]]
        rec = {ids[j]: ops for j, ops in (rep.get("recompute") or {}).items()}
        p = simple_plan(spec, cluster=cluster, stages=groups, layers=rep["layers"], units_per_layer=rep["units"],
                        recompute=rec).pipelines[0]
        pipes.append(Pipeline(stages=p.stages, micro_batch_size=rep.get("mbs", 2), num_microbatches=rep.get("m", 1)))
        rank += len(ids)
    if ratios is not None:
        flat = iter(ratios)
        pipes = [replace(p, stages=tuple(replace(s, devices=tuple(replace(d, shard_ratio=next(flat)) for d in s.devices))
                                         for s in p.stages)) for p in pipes]
    first = pipes[0]
    plan = Plan(model=spec, cluster=cluster, micro_batch_size=first.micro_batch_size, num_microbatches=first.num_microbatches,
                pipelines=tuple(pipes), zero_stage=zero_stage)
    return validate(plan)


def reference_adamw(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The single-device reference optimizer: torch's AdamW with the runtime's betas and epsilon, no weight
    decay for biases and LayerNorms (``runtime.train.optim_settings.decays``)."""
    from runtime.train.engine import ADAM_BETAS, ADAM_EPS
    from runtime.train.optim_settings import decays

    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if decays(n)]},
                              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}],
                             lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)


def reference_training(spec, global_batch: int, steps: int, *, seed: int, lr: float, weight_decay: float, clip: float,
                       schedule) -> dict:
    """The single-device model trained on the whole global batch: ``reference_adamw``, torch's
    clip_grad_norm_ at ``clip``, the learning rate of ``schedule`` (an ``LRSchedule``) at every step. Returns
    the model, its optimizer, the losses, the norms before clipping and the step-0 gradients by name."""
    from runtime.data.source import TokenSource
    from runtime.model.family import reference_model

    model = reference_model(spec, seed=seed)
    named = list(model.named_parameters())
    opt = reference_adamw(model, lr=lr, weight_decay=weight_decay)
    data = TokenSource(spec, seed=seed, global_batch=global_batch)
    losses, norms, grads = [], [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(step, torch.arange(global_batch))
        loss = model(x, y, step=step)[1]
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in named}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        for g in opt.param_groups:
            g["lr"] = schedule.lr_at(step)
        opt.step()
    return {"model": model, "optimizer": opt, "losses": losses, "norms": norms, "grads": grads}
