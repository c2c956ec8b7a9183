"""``baton train --report``: what the runtime measured next to what the evaluator predicts for the plan.

Measured figures are medians over the steps after the first (the first pays for warm-up). Per device:
forward, backward (recomputation included) and recomputation time per micro-batch, the peak bytes
of activations kept for backward in device memory, and those kept in host memory (the plan's ``offload``:
measured by the stage's ``OffloadStash``, predicted as the evaluator's ``host_activation_bytes``, in-flight
micro-batches x layers x offloaded bytes per layer); per stage: compute time of one micro-batch (TP rank 0's forward +
backward, all-reduces included); the iteration time, and its phases (1F1B pipeline, gradient
all-reduces, optimizer step; at ``zero_stage`` 2 and 3 the passes, the units' reduce-scatters, their
all-gathers and the optimizer step, and per unit its reduce-scatter and all-gather time next to eq. 16's
ring pass, ``units``). Predicted figures are the evaluator's for
the same plan, cluster and profiles (docs/cost-model.md).

Memory per device besides activations (eq. 7/8), measured from the rank's tensors after its last step:
weights and gradients in the compute dtype, and the optimizer state (fp32 master weights in fp16/bf16,
AdamW's two fp32 moments); at ``zero_stage`` 2 and 3 the weights and gradients are the peaks over the step
(owned shards, gathered units, full gradients before their reduce-scatter: eq. 18's terms). Throughput: the run's average tokens/s and MFU (``runtime.measure.meters``), next
to the evaluator's; for fp16, the final loss scale and the steps skipped for overflowing gradients.

``--report-timeline PATH.png`` draws one step (``timeline_step``: the median one after the first) twice over
one time axis: the evaluator's 1F1B timeline and the spans every rank recorded (``runtime.measure.trace``), on the
same rows (devices) in the same colours (``baton.pictures``). What the runtime records but the cost model
folds into other terms or leaves out is drawn too: waits for a peer (receives, send completion; gaps and
transfers in the prediction), tensor-parallel all-reduces (inside the predicted passes) and the step's small
loss / grad-norm all-reduce (not predicted). A rank's tied-embedding and data-parallel all-reduces are one
span, drawn as the data-parallel sync when the plan has replicas.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import TYPE_CHECKING

from baton.cluster import ClusterSpec
from baton.evaluate import PlanReport, evaluate
from baton.profile import ProfileSet
from baton.atomic import write_atomically
from baton.plan import Plan
from baton.costmodel import SyncTerms, peak_flops, sync_terms
from runtime.train.engine import StepStats
from runtime.measure.meters import Throughput, throughput
from runtime.parallel.topology import Topology

if TYPE_CHECKING:
    from baton.pictures import Timeline


def _rel(measured: float, predicted: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def build_report(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, per_rank: dict[int, list[StepStats]],
                 speed: Throughput | None = None) -> dict:
    """The report as one JSON-ready dict; ``speed`` is the run's throughput (computed from rank 0's
    steps against the catalog peaks of ``cluster`` when None)."""
    pred = evaluate(plan, cluster, profiles)
    ids = plan.device_ids()
    steps = {r: (h[1:] if len(h) > 1 else h) for r, h in per_rank.items()}
    rank0 = steps[0]
    measured_iter = statistics.median(s.iteration_ms for s in rank0)
    phases, units = _phases(plan, cluster, pred, steps, measured_iter)
    if speed is None:
        peak = peak_flops([cluster.device(i).gpu for i in ids], plan.model)
        speed = throughput(per_rank[0], plan.model, plan.global_batch, peak)
    last0 = per_rank[0][-1]
    return {
        "plan": {"model": plan.model.name, "cluster": plan.cluster, "global_batch": plan.global_batch,
                 "micro_batch_size": plan.micro_batch_size, "num_microbatches": plan.num_microbatches,
                 "zero_stage": plan.zero_stage, "devices": ids},
        "steps_measured": len(rank0),
        "iteration_time_ms": {"measured": measured_iter, "predicted": pred.iteration_time_ms,
                              "rel_error": _rel(measured_iter, pred.iteration_time_ms)},
        "tokens_per_s": {"measured": plan.global_batch * plan.model.seq_len / measured_iter * 1e3,
                         "predicted": pred.tokens_per_s},
        "throughput": {"steps": speed.steps, "tokens_per_s": speed.tokens_per_s, "model_tflops_per_s": speed.model_tflops_per_s,
                       "peak_tflops": speed.peak_tflops, "mfu": {"measured": speed.mfu, "predicted": pred.mfu}},
        "precision": {"dtype": plan.model.dtype, "loss_scale": last0.loss_scale, "skipped_steps": speed.skipped_steps},
        "phases": phases,
        "arrival_wait_ms": {"predicted": pred.arrival_wait_ms, "replica_time_cv": cluster.replica_time_cv},
        **({"units": units} if units is not None else {}),
        "replicas": _replica_rows(plan, pred, steps),
        "stages": _stage_rows(plan, pred, steps),
        "devices": _device_rows(plan, pred, per_rank, steps),
        "prediction": pred.to_dict(),
    }


def _device_rows(plan: Plan, pred: PlanReport, per_rank: dict[int, list[StepStats]], steps: dict) -> list[dict]:
    """Per device: its passes' times and activation peak (medians over ``steps``), and the weights, gradients
    and optimizer state after its last step (of ``per_rank``), next to the prediction."""
    devices = []
    for rank, dev_id in enumerate(plan.device_ids()):
        hist = steps.get(rank, [])
        p = next(d for d in pred.devices if d.id == dev_id)
        fwd = statistics.median(statistics.mean(s.forward_ms) for s in hist) if hist else None
        bwd = statistics.median(statistics.mean(s.backward_ms) for s in hist) if hist else None
        rec = statistics.median(statistics.mean(s.recompute_ms) for s in hist) if hist else None
        saved = max(s.peak_saved_bytes for s in hist) if hist else None
        host = max(s.peak_host_activation_bytes for s in hist) if hist else None
        host_pred = p.host_activation_bytes
        alloc = max(s.peak_allocated_bytes for s in hist) if hist else 0
        last = per_rank[rank][-1] if per_rank.get(rank) else None
        state = {"weights_bytes": last.weights_bytes, "grads_bytes": last.grads_bytes,
                 "optimizer_bytes": last.master_bytes + last.moments_bytes,
                 "master_bytes": last.master_bytes, "moments_bytes": last.moments_bytes} if last else {}
        # Optimizer-state offload (the plan's ``offload_optimizer``): what the host keeps and its step's time; the
        # device-side figures above then hold no optimizer state.
        host_state = {"host_optimizer_bytes": last.host_optimizer_bytes,
                      "host_optimizer_ms": statistics.median(s.host_optimizer_ms for s in hist) if hist else None} \
            if last else {}
        devices.append({
            "id": dev_id, "rank": rank, "pipeline": p.pipeline, "stage": p.stage,
            "measured": {"fwd_ms": fwd, "bwd_ms": bwd, "recompute_ms": rec, "peak_saved_bytes": saved,
                         "peak_host_activation_bytes": host, "peak_allocated_bytes": alloc, **state, **host_state},
            "predicted": {"fwd_ms": p.fwd_ms, "bwd_ms": p.bwd_ms + p.recompute_ms, "recompute_ms": p.recompute_ms,
                          "activation_bytes": p.activation_bytes, "host_activation_bytes": host_pred,
                          "peak_memory_bytes": p.peak_memory_bytes,
                          "weights_bytes": p.weights_bytes, "grads_bytes": p.grads_bytes, "optimizer_bytes": p.optimizer_bytes,
                          "host_optimizer_bytes": p.host_optimizer_bytes, "optimizer_ms": p.optimizer_ms},
            "activation_rel_error": _rel(saved, p.activation_bytes) if saved else None,
            "host_activation_rel_error": _rel(host, host_pred) if host else None,
            "state_rel_error": {k: _rel(state[k], getattr(p, k)) for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")}
            if state else None,
        })
    return devices


def _stage_rows(plan: Plan, pred: PlanReport, steps: dict) -> list[dict]:
    """Per stage: one micro-batch's compute time and its tensor-parallel all-reduces, next to the prediction (an
    interleaved pipeline: per device group, the sum of its chunks)."""
    ids, rank0 = plan.device_ids(), steps[0]
    stages = []
    for s in pred.stages:
        groups = len(plan.pipelines[s.pipeline].device_stages)
        if s.index >= groups:
            continue
        chunks = [c for c in pred.stages if c.pipeline == s.pipeline and c.index % groups == s.index]
        s = replace(s, fwd_ms=sum(c.fwd_ms for c in chunks), bwd_ms=sum(c.bwd_ms for c in chunks),
                    allreduce_ms=sum(c.allreduce_ms for c in chunks))
        m = plan.batch(s.pipeline)[1]
        rank = ids.index(s.devices[0])
        hist = steps.get(rank, [])
        if s.pipeline == 0:
            measured_stage = statistics.median(st.stage_ms[s.index] for st in rank0) / m
        else:  # stage_ms covers replica 0's stages; elsewhere TP rank 0's own passes per micro-batch
            measured_stage = statistics.median(statistics.mean(st.forward_ms) + statistics.mean(st.backward_ms) for st in hist)
        timed = [st.tp_allreduce_ms for st in hist]
        measured_ar = statistics.median(timed) / m if timed and None not in timed else None
        stages.append({"pipeline": s.pipeline, "index": s.index, "devices": s.devices,
                       "measured_ms": measured_stage, "predicted_ms": s.fwd_ms + s.bwd_ms,
                       "rel_error": _rel(measured_stage, s.fwd_ms + s.bwd_ms),
                       "allreduce_measured_ms": measured_ar, "allreduce_predicted_ms": s.allreduce_ms})
    return stages


def _phases(plan: Plan, cluster: ClusterSpec, pred: PlanReport, steps: dict,
            measured_iter: float) -> tuple[dict, list[dict] | None]:
    """The step's phases, measured and predicted, and (zero_stage 2 and 3) the units' collectives."""
    rank0 = steps[0]

    # In each set of ranks joined by gradient all-reduces, the time of the rank that arrives last (the
    # others also wait out slower pipelines), the slowest such set; the slowest optimizer step; the
    # pipeline as the rest.
    def per_step(k, field, ranks):
        return [getattr(steps[r][k], field) for r in ranks if r in steps and k < len(steps[r])]

    sets = _gradient_sync_sets(plan)
    sync_m = statistics.median(max((min(per_step(k, "grad_sync_ms", g) or [0.0]) for g in sets), default=0.0)
                               for k in range(len(rank0)))
    opt_m = statistics.median(max(per_step(k, "optimizer_ms", list(steps))) for k in range(len(rank0)))
    gather_m = statistics.median(max(per_step(k, "gather_ms", list(steps))) for k in range(len(rank0)))
    if plan.zero_stage >= 2:
        # The collectives of every set of ranks joined by them, as the reduce-scatters above: the rank that
        # arrives last at each waits least, so its time is the collective's own.
        gather_m = statistics.median(max((min(per_step(k, "gather_ms", g) or [0.0]) for g in sets), default=0.0)
                                     for k in range(len(rank0)))
    # At zero_stage 1 the data-parallel sync is two passes (eq. 15): the reduce-scatters before the step's
    # norm, the all-gathers after the owners' update (measured inside the optimizer step). Eq. 17 (stages 2
    # and 3): the passes (compute, and the waits for slower replicas at every collective), the units'
    # reduce-scatters during the backward pass, their all-gathers (stage 2: after the update, inside the
    # measured optimizer step; stage 3: before each unit's forward and backward, inside the passes).
    terms = sync_terms(cluster, plan)
    units = _unit_phases(plan, terms, steps, sets, len(rank0)) if plan.zero_stage >= 2 else None
    if units is None:
        reduce_pred, gather_pred = terms.dp_reduce_ms, pred.dp_sync_ms - terms.dp_reduce_ms
    else:
        reduce_pred = sum(u["reduce_scatter_ms"]["predicted"] for u in units)
        gather_pred = sum(u["gather_ms"]["predicted"] for u in units)
    in_passes = plan.zero_stage == 3
    phases = {
        "pipeline_ms": {"measured": measured_iter - sync_m - opt_m - (gather_m if in_passes else 0.0),
                        "predicted": pred.pipeline_ms},
        "grad_sync_ms": {"measured": sync_m, "predicted": pred.embedding_sync_ms + reduce_pred},
        **({"gather_ms": {"measured": gather_m, "predicted": gather_pred}} if plan.zero_stage else {}),
        "optimizer_ms": {"measured": opt_m if in_passes else opt_m - gather_m, "predicted": pred.optimizer_ms},
    }
    for v in phases.values():
        v["rel_error"] = _rel(v["measured"], v["predicted"])
    return phases, units


def _replica_rows(plan: Plan, pred: PlanReport, steps: dict) -> list[dict]:
    """Per replica: its batch and its pipeline's time, next to the prediction."""
    ids, rank0 = plan.device_ids(), steps[0]
    replicas = []
    for r in range(len(plan.pipelines)):
        ranks = [k for k, i in enumerate(ids) if next(d for d in pred.devices if d.id == i).pipeline == r]
        # A replica's pipeline: its slowest rank's step before the gradient sync (which includes waiting
        # for slower replicas) and the optimizer.
        # (stage 3: less the gathers too, which fall inside the passes)
        own = statistics.median(max(st.iteration_ms - st.grad_sync_ms - st.optimizer_ms
                                    - (st.gather_ms if plan.zero_stage == 3 else 0.0)
                                    for st in (steps[k][j] for k in ranks if k in steps and j < len(steps[k])))
                                for j in range(len(rank0)))
        b, mr = plan.batch(r)
        replicas.append({"pipeline": r, "micro_batch_size": b, "num_microbatches": mr, "samples": b * mr,
                         "pipeline_ms": {"measured": own, "predicted": pred.replica_pipeline_ms[r],
                                         "rel_error": _rel(own, pred.replica_pipeline_ms[r])}})
    return replicas


def _unit_phases(plan: Plan, terms: SyncTerms, steps: dict, sets: list[list[int]], num_steps: int) -> list[dict]:
    """Stages 2 and 3: per unit (the edges, then each layer) its reduce-scatter and all-gather time, measured
    (``StepStats.unit_reduce_ms`` / ``unit_gather_ms``: median over steps of the slowest set of the time of
    the rank that arrives last) next to eq. 16's ring passes (reduce-scatter: one; all-gathers: stage 2
    one after the update, stage 3 the edges one and a layer two, before its forward and its backward)."""
    from baton.costmodel import layered_chain
    from baton.peers import EDGES, unit_groups

    chain = layered_chain(plan.zero_stage, plan.model.num_layers)
    out = []
    for k, (unit, _) in enumerate(unit_groups(plan)):
        r_u, g_u = terms.unit_reduce_ms[unit], terms.unit_gather_ms[unit]
        gathers = sum(1 for kind, u in chain if kind == "gather" and u == unit)

        def measured(field, k=k):
            def one(j):
                times = [[getattr(steps[r][j], field)[k] for r in g if r in steps and j < len(steps[r])] for g in sets]
                return max((min(t) for t in times if t), default=0.0)
            return statistics.median(one(j) for j in range(num_steps))

        rs, ga = measured("unit_reduce_ms"), measured("unit_gather_ms")
        out.append({"unit": "edges" if unit is EDGES else unit,
                    "reduce_scatter_ms": {"measured": rs, "predicted": r_u, "rel_error": _rel(rs, r_u)},
                    "gather_ms": {"measured": ga, "predicted": gathers * g_u, "rel_error": _rel(ga, gathers * g_u)}})
    return out


def _gradient_sync_sets(plan: Plan) -> list[list[int]]:
    """Ranks joined by a gradient all-reduce (the runtime's tied-embedding and data-parallel groups),
    as connected sets of two or more."""
    topo = Topology(plan)
    sets: list[set[int]] = []
    for ranks in topo.tied_rank_lists() + topo.dp_rank_lists():
        joined = set(ranks)
        for other in [s for s in sets if s & joined]:
            joined |= other
            sets.remove(other)
        sets.append(joined)
    return sorted(sorted(s) for s in sets)


def timeline_step(history: list[StepStats]) -> int:
    """The step ``--report-timeline`` draws: of the steps after the first (which pays for warm-up) that ran
    no validation, the one of median time (rank 0's; the lower median); the first only when it is alone."""
    later = [s for s in history[1:] if s.val_loss is None] or history[1:] or history
    ordered = sorted(later, key=lambda s: s.iteration_ms)
    return ordered[(len(ordered) - 1) // 2].step


def _span_kind(event: dict, rank: int, topo: Topology, sync_kind: dict[int, str]) -> str | None:
    """The picture's kind of block for a trace span of ``rank`` (None: not drawn)."""
    cat, name = event["cat"], event["name"]
    if cat in ("forward", "backward", "recompute", "optimizer"):
        return cat
    if cat == "p2p":
        if not name.startswith("send to "):
            return "wait"  # a receive (waiting for the peer included) or the wait for posted sends
        target = int(name.removeprefix("send to ").split(",")[0])
        downstream = topo.position(target).stage > topo.position(rank).stage
        return "send activations" if downstream else "send gradients"
    if cat == "allreduce":
        if name == "tp all-reduce":
            return "tp all-reduce"
        if name.startswith("gradient sync"):
            return sync_kind.get(rank)  # a rank in no gradient all-reduce waits for nothing there
        return "step all-reduce"
    return None  # validation, and anything the engine may record later


def measured_timeline(plan: Plan, pred: PlanReport, spans: dict[int, list[dict]], step: int) -> Timeline:
    """The spans of ``step`` that every rank recorded (``runtime.measure.trace.read_spans``: rank -> complete events,
    microseconds) as blocks on the rows of ``pred``'s devices, in ms from the earliest span of the step."""
    from baton.pictures import Block, Timeline, timeline_rows

    topo = Topology(plan)
    sync_kind = {r: "embedding sync" for g in topo.tied_rank_lists() for r in g}
    sync_kind.update({r: "data-parallel sync" for g in topo.dp_rank_lists() for r in g})
    row_of = {d.id: y for y, d in enumerate(pred.devices)}
    ids = plan.device_ids()
    chosen = {r: [e for e in events if e.get("args", {}).get("step") == step] for r, events in spans.items()}
    starts = [e["ts"] for events in chosen.values() for e in events]
    if not starts:
        raise ValueError(f"the trace holds no span of step {step}")
    origin = min(starts)
    blocks = []
    for rank in sorted(chosen):
        for e in chosen[rank]:
            kind = _span_kind(e, rank, topo, sync_kind)
            if kind is None:
                continue
            a = (e["ts"] - origin) / 1e3
            label = e["name"] if kind in ("forward", "backward") else ""
            blocks.append(Block(row_of[ids[rank]], kind, a, a + e["dur"] / 1e3, label))
    return Timeline(timeline_rows(pred), blocks, max((b.end_ms for b in blocks), default=0.0))


def timeline_figure(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, spans: dict[int, list[dict]],
                    history: list[StepStats]):
    """The picture ``--report-timeline`` writes, and the step it shows (``timeline_step``)."""
    from baton import pictures

    pred = evaluate(plan, cluster, profiles)
    step = timeline_step(history)
    measured = measured_timeline(plan, pred, spans, step)
    took = next(s.iteration_ms for s in history if s.step == step)
    why = "the run's only step, warm-up included" if len(history) == 1 else "the median step after the first"
    ratio = f", measured {measured.end_ms / pred.iteration_time_ms:.2g}x as long" if pred.iteration_time_ms > 0 else ""
    fig = pictures.comparison_figure(
        pictures.predicted_timeline(pred, plan.num_microbatches), measured,
        title=f"{plan.model.name} on {plan.cluster}: "
              + (f"{plan.num_microbatches} micro-batch(es) of {plan.micro_batch_size}" if plan.uniform_batches
                 else "replicas' batches " + ", ".join(f"{m}x{b}" for b, m in map(plan.batch, range(len(plan.pipelines)))))
              + f", {len(plan.device_ids())} device(s)",
        predicted_title=f"predicted (the evaluator, docs/cost-model.md): {pred.iteration_time_ms:.1f} ms{ratio}",
        measured_title=f"measured: step {step + 1} ({why}), {measured.end_ms:.1f} ms from its first span to its last "
                       f"(rank 0's step: {took:.1f} ms)")
    return fig, step


def write_report(report: dict, path) -> None:
    write_atomically(path, json.dumps(report, indent=2) + "\n")


def summary_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(what, measured, predicted, error) lines for the console."""
    def pct(x):
        return "-" if x is None else f"{x:+.1%}"
    it = report["iteration_time_ms"]
    rows = [("iteration ms", f"{it['measured']:.1f}", f"{it['predicted']:.1f}", pct(it["rel_error"]))]
    for name, v in report.get("phases", {}).items():
        rows.append((f"  {name.removesuffix('_ms').replace('_', ' ')} ms", f"{v['measured']:.1f}", f"{v['predicted']:.1f}", pct(v["rel_error"])))
    for u in report.get("units", ()):  # stages 2 and 3: one row per unit, its reduce-scatter + its gathers
        rs, ga = u["reduce_scatter_ms"], u["gather_ms"]
        name = "edges" if u["unit"] == "edges" else f"layer {u['unit']}"
        rows.append((f"    {name} reduce-scatter + gather ms", f"{rs['measured']:.1f} + {ga['measured']:.1f}",
                     f"{rs['predicted']:.1f} + {ga['predicted']:.1f}",
                     pct(_rel(rs["measured"] + ga["measured"], rs["predicted"] + ga["predicted"]))))
    many = len(report.get("replicas", ())) > 1
    for r in report.get("replicas", ()) if many else ():
        v = r["pipeline_ms"]
        rows.append((f"replica {r['pipeline']} pipeline ms ({r['num_microbatches']} x {r['micro_batch_size']})",
                     f"{v['measured']:.1f}", f"{v['predicted']:.1f}", pct(v["rel_error"])))
    for s in report["stages"]:
        where = f"replica {s['pipeline']} stage {s['index']}" if many else f"stage {s['index']}"
        rows.append((f"{where} ms / micro-batch", f"{s['measured_ms']:.2f}", f"{s['predicted_ms']:.2f}", pct(s["rel_error"])))
    tp = report.get("throughput")
    if tp:
        rows.append(("tokens/s (average)", f"{tp['tokens_per_s']:,.0f}", f"{report['tokens_per_s']['predicted']:,.0f}",
                     pct(_rel(tp["tokens_per_s"], report["tokens_per_s"]["predicted"]))))
        mfu = tp["mfu"]
        if mfu["measured"] is not None:
            rows.append(("MFU", f"{mfu['measured']:.2%}", f"{mfu['predicted']:.2%}", pct(_rel(mfu["measured"], mfu["predicted"]))))
    for d in report["devices"]:
        if d["measured"]["peak_saved_bytes"] is not None:
            rows.append((f"{d['id']} activations MiB", f"{d['measured']['peak_saved_bytes'] / 2**20:.2f}",
                         f"{d['predicted']['activation_bytes'] / 2**20:.2f}", pct(d["activation_rel_error"])))
        host, host_pred = d["measured"].get("peak_host_activation_bytes"), d["predicted"].get("host_activation_bytes", 0.0)
        if host or host_pred:  # only where the plan offloads
            rows.append((f"{d['id']} host activations MiB", f"{(host or 0) / 2**20:.2f}", f"{host_pred / 2**20:.2f}",
                         pct(d.get("host_activation_rel_error"))))
        host_opt = d["measured"].get("host_optimizer_bytes")
        if host_opt:  # only where the plan offloads the optimizer state (eq. 7h)
            want = d["predicted"]["host_optimizer_bytes"]
            rows.append((f"{d['id']} host optimizer MiB", f"{host_opt / 2**20:.2f}", f"{want / 2**20:.2f}", pct(_rel(host_opt, want))))
        if d.get("state_rel_error"):
            m, p = d["measured"], d["predicted"]
            got = m["weights_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
            want = p["weights_bytes"] + p["grads_bytes"] + p["optimizer_bytes"]
            rows.append((f"{d['id']} weights+grads+optimizer MiB", f"{got / 2**20:.2f}", f"{want / 2**20:.2f}", pct(_rel(got, want))))
    return rows
