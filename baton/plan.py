"""A training plan as plain data: what every device holds and recomputes. JSON in, JSON out.

A plan has one or more pipelines (data-parallel replicas); each pipeline is a list of stages in order;
each stage is a tensor-parallel group of devices that holds a contiguous range of layers, cuts every
layer into ``units_per_layer`` units (groups of heads and the matching FFN columns) and gives each device
its own number of units and its own set of recomputed operators. Replicas may differ in shape and each
may train on its own micro-batch size and number of micro-batches (Poplar); with ``zero_stage`` 1 the
optimizer state (fp32 master weights and Adam moments) of the devices that hold the same parameters is
sharded between them by each device's ``shard_ratio`` (Cephalo), with 2 the gradients too and with 3 the
weights too (replicas of one stage each, run layer by layer). Who holds the same parameters is
``baton.peers``' business: it reads a plan's shapes as plain data and imports nothing from here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from baton.atomic import write_atomically
from baton.errors import BatonError
from baton.fields import Fields, excerpt, load_json
from baton.memory import offload_problem
from baton.model_spec import ModelSpec, from_mapping as model_from_mapping, splits_into
from baton.operators import operator_names
from baton.peers import peer_groups

FORMAT = "baton-plan/2"
INTERLEAVED_FORMAT = "baton-plan/3"
"""A plan with an interleaved pipeline (``Pipeline.chunks`` > 1) is written as /3, so that older readers refuse it
rather than read its virtual stages as stages; every other plan is still written as /2."""
READABLE_FORMATS = ("baton-plan/1", FORMAT, INTERLEAVED_FORMAT)
"""/1 had one batch for all replicas, identical replicas and no sharding; it reads as such a /2 plan."""

# Upper bounds (docs/errors.md, "Upper bounds"): beyond them a plan is a typo, and would make the runtime or the
# evaluator allocate without end.
MAX_DEVICES = 4096
"""Devices in a plan or a cluster."""
MAX_GLOBAL_BATCH = 1 << 20
"""Samples per iteration."""
MAX_MICROBATCHES = 1 << 16
"""Micro-batches per pipeline per iteration."""
SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
"""Sharding stages the cost model, planner and runtime implement: 0 replicated, 1 optimizer state, 2 also
the gradients, 3 also the weights (2 and 3 with layered accumulation, replicas of one stage each)."""
LAYERED_ZERO_STAGES = (2, 3)
"""Stages whose replicas run their micro-batches layer by layer (docs/cost-model.md, eq. 16-18)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceShare:
    """One device's part of a stage."""

    id: str
    """Cluster device id ('<node>:<index>')."""
    units: int
    """Tensor-parallel units of every layer of the stage this device holds (at least one)."""
    recompute: tuple[str, ...] = ()
    """Operators whose activations this device drops in the forward pass and recomputes in backward."""
    shard_ratio: float | None = None
    """With ``zero_stage`` >= 1: this device's weight in the split of the optimizer state of every peer set
    it belongs to (the part it owns is its ratio over the sum of the set's ratios; 0 owns nothing). None:
    equal parts. For replicas of one shape, the ratios at each position add up to 1."""
    offload: tuple[str, ...] = ()
    """Tensors of every layer (``baton.memory.tensor_roles``) this device holds from the forward to the backward
    pass in host memory instead of its own (docs/cost-model.md, eq. 3o); each must be held under ``recompute``."""
    offload_optimizer: bool = False
    """The device's optimizer state (Adam moments, fp32 master weights) lives in host memory and its Adam step runs
    on the host (docs/cost-model.md eq. 7h/10h): gradients go device to host, updated weights host to device. With
    ``zero_stage`` 0 or 1 only (at 1, the owned shard)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """A pipeline stage: a tensor-parallel group and the layers it holds."""

    first_layer: int
    """Index of the first transformer layer held (0-based)."""
    num_layers: int
    """Layers held; may be 0 only for a stage that holds the embedding or head alone."""
    units_per_layer: int
    """Partition granularity U: each layer is cut into U units; divides the head count and FFN width."""
    devices: tuple[DeviceShare, ...]
    """The group, in tensor-parallel rank order; their units add up to U."""

    @property
    def device_ids(self) -> list[str]:
        return [d.id for d in self.devices]

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """One data-parallel replica: stages in pipeline order."""

    stages: tuple[Stage, ...]
    """First stage holds the embedding, last the final LayerNorm, LM head and loss."""
    micro_batch_size: int | None = None
    """Samples per micro-batch of this replica; None: the plan's ``micro_batch_size``."""
    num_microbatches: int | None = None
    """Micro-batches this replica runs per iteration; None: the plan's ``num_microbatches``."""
    chunks: int = 1
    """Chunks of layers per device group (interleaved 1F1B, docs/schedules.md): ``stages`` then lists the p v
    virtual stages in model order, and virtual stage k runs on the devices of stage k mod p; 1: plain 1F1B."""

    @property
    def device_stages(self) -> tuple[Stage, ...]:
        """The stages that place devices: all of them, or interleaved the first p (the others repeat them)."""
        return self.stages[:len(self.stages) // self.chunks]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything ``baton evaluate`` and ``baton train`` need to know about how to run one iteration."""

    model: ModelSpec
    """The model being trained (embedded in full so a plan file stands alone)."""
    cluster: str
    """Name of the cluster spec the device ids refer to."""
    micro_batch_size: int
    """Samples per micro-batch of every replica that does not give its own."""
    num_microbatches: int
    """Micro-batches per iteration (gradient accumulation steps) of every replica that does not give its own."""
    pipelines: tuple[Pipeline, ...]
    """Data-parallel replicas; they may differ in devices, stages, layers and units."""
    info: dict = field(default_factory=dict)
    """Free-form provenance (solver, objective, gap); ignored by validation."""
    zero_stage: int = 0
    """Sharding of the training state across devices holding the same parameters, by ``shard_ratio``: 0 none,
    1 the optimizer state (fp32 master weights and Adam moments), 2 also the gradients, 3 also the weights
    (2 and 3: every replica one stage, its micro-batches run layer by layer)."""

    def batch(self, replica: int) -> tuple[int, int]:
        """(micro-batch size, micro-batches) of one replica."""
        pipe = self.pipelines[replica]
        return (pipe.micro_batch_size or self.micro_batch_size, pipe.num_microbatches or self.num_microbatches)

    def samples(self, replica: int) -> int:
        """Samples one replica trains on per iteration."""
        b, m = self.batch(replica)
        return b * m

    @property
    def uniform_batches(self) -> bool:
        """Every replica runs the plan's micro-batch size and count."""
        return all(self.batch(i) == (self.micro_batch_size, self.num_microbatches) for i in range(len(self.pipelines)))

    @property
    def global_batch(self) -> int:
        return sum(self.samples(i) for i in range(len(self.pipelines)))

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0].stages)

    def device_ids(self) -> list[str]:
        """Every device in rank order: pipeline by pipeline, stage by stage, TP rank by rank."""
        return [d.id for p in self.pipelines for s in p.device_stages for d in s.devices]

    def to_dict(self) -> dict:
        data = {
            "format": INTERLEAVED_FORMAT if any(p.chunks > 1 for p in self.pipelines) else FORMAT,
            "model": self.model.to_dict(),
            "cluster": self.cluster,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "zero_stage": self.zero_stage,
            "pipelines": [self._pipeline_dict(i) for i in range(len(self.pipelines))],
            "info": self.info,
        }
        return data

    def _pipeline_dict(self, i: int) -> dict:
        p = self.pipelines[i]
        out = {}
        if self.batch(i) != (self.micro_batch_size, self.num_microbatches):
            out["micro_batch_size"], out["num_microbatches"] = self.batch(i)
        if p.chunks > 1:
            out["chunks"] = p.chunks
        groups = len(p.device_stages)
        out["stages"] = [
            {"first_layer": s.first_layer, "num_layers": s.num_layers} if k >= groups else
            {"first_layer": s.first_layer, "num_layers": s.num_layers, "units_per_layer": s.units_per_layer,
             "devices": [{"id": d.id, "units": d.units, "recompute": list(d.recompute),
                          **({"offload": list(d.offload)} if d.offload else {}),
                          **({"offload_optimizer": True} if d.offload_optimizer else {}),
                          **({"shard_ratio": d.shard_ratio} if d.shard_ratio is not None else {})} for d in s.devices]}
            for k, s in enumerate(p.stages)]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def with_info(self, **info) -> "Plan":
        return replace(self, info={**self.info, **info})


FIELDS = {"format", "model", "cluster", "micro_batch_size", "num_microbatches", "zero_stage", "pipelines", "info"}
"""The top-level fields of a plan file."""


def from_dict(data, *, source: str = "<plan>") -> Plan:
    """Parse a plan mapping (as written by ``Plan.to_dict``) and validate it."""
    top = Fields(data, source=source)
    top.check_known(FIELDS, what="a plan")
    fmt = top.string("format", default=FORMAT)
    if fmt not in READABLE_FORMATS:
        raise top.error("format", f"unsupported plan format {excerpt(fmt)} (expected one of {', '.join(READABLE_FORMATS)})")
    model = model_from_mapping(top.raw("model"), source=f"{source}: model")
    pipelines = []
    for pi, raw_p in enumerate(top.sequence("pipelines")):
        pf = Fields(raw_p, source=source, prefix=f"pipelines[{pi}]")
        pf.check_known({"stages", "micro_batch_size", "num_microbatches", "chunks"}, what="a pipeline")
        own_b = pf.integer("micro_batch_size", maximum=MAX_GLOBAL_BATCH, default=None)
        own_m = pf.integer("num_microbatches", maximum=MAX_MICROBATCHES, default=None)
        chunks = pf.integer("chunks", maximum=model.num_layers, default=1)
        raw_stages = pf.sequence("stages")
        groups = len(raw_stages) // chunks if chunks > 1 else len(raw_stages)
        stages = []
        for si, raw_s in enumerate(raw_stages):
            sf = Fields(raw_s, source=source, prefix=f"{pf.prefix}.stages[{si}]")
            sf.check_known({"first_layer", "num_layers", "units_per_layer", "devices"}, what="a stage")
            if si >= groups > 0 and not (isinstance(raw_s, dict) and "devices" in raw_s):
                # A later virtual stage of an interleaved pipeline runs on the group of stage si mod p.
                group = stages[si % groups]
                stages.append(Stage(first_layer=sf.integer("first_layer", minimum=0, maximum=model.num_layers),
                                    num_layers=sf.integer("num_layers", minimum=0, maximum=model.num_layers),
                                    units_per_layer=group.units_per_layer, devices=group.devices))
                continue
            devices = []
            for di, raw_d in enumerate(sf.sequence("devices")):
                df = Fields(raw_d, source=source, prefix=f"{sf.prefix}.devices[{di}]")
                df.check_known({"id", "units", "recompute", "offload", "offload_optimizer", "shard_ratio"}, what="a stage device")
                recompute = df.raw("recompute", default=[])
                if not isinstance(recompute, list) or not all(isinstance(x, str) for x in recompute):
                    raise df.error("recompute", "expected a list of operator names")
                offload = df.raw("offload", default=[])
                if not isinstance(offload, list) or not all(isinstance(x, str) for x in offload):
                    raise df.error("offload", "expected a list of tensor names")
                devices.append(DeviceShare(id=df.string("id"), units=df.integer("units", maximum=1024), recompute=tuple(recompute),
                                           offload=tuple(offload),
                                           offload_optimizer=df.boolean("offload_optimizer", default=False),
                                           shard_ratio=df.number("shard_ratio", allow_zero=True, maximum=1.0, default=None)))
            stages.append(Stage(
                first_layer=sf.integer("first_layer", minimum=0, maximum=model.num_layers),
                num_layers=sf.integer("num_layers", minimum=0, maximum=model.num_layers),
                units_per_layer=sf.integer("units_per_layer", maximum=model.num_heads), devices=tuple(devices)))
        pipelines.append(Pipeline(stages=tuple(stages), micro_batch_size=own_b, num_microbatches=own_m, chunks=chunks))
    info = top.raw("info", default={})
    plan = Plan(
        model=model, cluster=top.string("cluster"), micro_batch_size=top.integer("micro_batch_size", maximum=MAX_GLOBAL_BATCH),
        num_microbatches=top.integer("num_microbatches", maximum=MAX_MICROBATCHES), pipelines=tuple(pipelines),
        info=info if isinstance(info, dict) else {}, zero_stage=top.integer("zero_stage", minimum=0, maximum=3, default=0),
    )
    return validate(plan, source=source)


def validate(plan: Plan, *, source: str = "<plan>") -> Plan:
    """Structural checks that need no cluster: coverage, units, recompute names, replica shapes."""
    spec = plan.model
    known_ops = set(operator_names(spec))
    seen: set[str] = set()

    def err(field_path: str, message: str) -> BatonError:
        return BatonError(message, source=source, field=field_path)

    if len(plan.device_ids()) > MAX_DEVICES:
        raise err("pipelines", f"{len(plan.device_ids())} devices, more than the {MAX_DEVICES} a plan may have")
    if plan.global_batch > MAX_GLOBAL_BATCH:
        raise err("micro_batch_size", f"global batch {plan.global_batch} (micro-batch size x micro-batches, summed over "
                                      f"the pipelines) is more than {MAX_GLOBAL_BATCH}")
    for pi, pipe in enumerate(plan.pipelines):
        for name, value in (("micro_batch_size", pipe.micro_batch_size), ("num_microbatches", pipe.num_microbatches)):
            if value is not None and value < 1:
                raise err(f"pipelines[{pi}].{name}", f"must be >= 1, got {value}")
    for pi, pipe in enumerate(plan.pipelines):
        next_layer = 0
        if pipe.chunks > 1 and (len(pipe.stages) % pipe.chunks or len(pipe.stages) < 2 * pipe.chunks):
            raise err(f"pipelines[{pi}].chunks", f"{pipe.chunks} chunks per device group need the stages to be a multiple "
                      f"of {pipe.chunks} virtual stages over at least two groups, got {len(pipe.stages)}")
        groups = len(pipe.device_stages)
        for si, stage in enumerate(pipe.stages):
            where = f"pipelines[{pi}].stages[{si}]"
            if si >= groups:
                group = pipe.stages[si % groups]
                if (stage.units_per_layer, stage.devices) != (group.units_per_layer, group.devices):
                    raise err(f"{where}.devices", f"virtual stage {si} runs on the group of stage {si % groups}: give it "
                              "no devices, or the same devices, units and recomputation")
            if stage.first_layer != next_layer:
                raise err(f"{where}.first_layer",
                          f"expected layer {next_layer} (stages must cover layers 0..{spec.num_layers - 1} once, in order), got {stage.first_layer}")
            if stage.num_layers == 0 and 0 < si < len(pipe.stages) - 1:
                raise err(f"{where}.num_layers", "only the first or last stage may hold no transformer layer")
            next_layer += stage.num_layers
            U = stage.units_per_layer
            if not splits_into(spec, U):
                raise err(f"{where}.units_per_layer",
                          f"{U} units do not divide the {spec.kv_heads} {'KV heads' if spec.llama else 'heads'} and {spec.ffn_dim} FFN columns "
                          "evenly")
            if len(stage.devices) > U:
                raise err(f"{where}.devices", f"{len(stage.devices)} devices but only {U} units per layer (each device needs at least one)")
            total = sum(d.units for d in stage.devices)
            if total != U:
                raise err(f"{where}.devices", f"units add up to {total}, expected units_per_layer = {U}")
            for di, d in enumerate(stage.devices if si < groups else ()):
                if d.id in seen:
                    raise err(f"{where}.devices[{di}].id", f"device {excerpt(d.id)} is used more than once")
                seen.add(d.id)
                for name in d.recompute:
                    if name not in known_ops:
                        raise err(f"{where}.devices[{di}].recompute",
                                  f"unknown operator {excerpt(name)} (known: {', '.join(sorted(known_ops))})")
                problem = offload_problem(spec, frozenset(d.recompute), frozenset(d.offload)) if d.offload else None
                if problem:
                    raise err(f"{where}.devices[{di}].offload", f"offloads {problem}")
                if len(set(d.offload)) != len(d.offload):
                    raise err(f"{where}.devices[{di}].offload", "names a tensor more than once")
        if next_layer != spec.num_layers:
            raise err(f"pipelines[{pi}].stages", f"stages cover {next_layer} layers, the model has {spec.num_layers}")
    if plan.zero_stage not in SUPPORTED_ZERO_STAGES:
        raise err("zero_stage", f"sharding stage {plan.zero_stage} is not supported (supported: "
                                f"{', '.join(map(str, SUPPORTED_ZERO_STAGES))}: 0 replicated, 1 optimizer state sharded, "
                                "2 and gradients, 3 and weights)")
    if plan.zero_stage in LAYERED_ZERO_STAGES:
        # Before the one-stage rule: a plan that offloads the optimizer state at stage 2 or 3 is refused for that.
        offloading = next(((pi, si, di, d.id) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)
                           for di, d in enumerate(s.devices) if d.offload_optimizer), None)
        if offloading is not None:
            pi, si, di, dev = offloading
            raise err(f"pipelines[{pi}].stages[{si}].devices[{di}].offload_optimizer",
                      f"device {excerpt(dev)} offloads its optimizer state, which needs zero_stage 0 or 1 (stage "
                      f"{plan.zero_stage} shards the gradients and steps unit by unit on the device)")
        for pi, pipe in enumerate(plan.pipelines):
            if len(pipe.stages) > 1:
                raise err(f"pipelines[{pi}].stages", f"zero_stage {plan.zero_stage} needs every replica to be one stage "
                          f"(this one has {len(pipe.stages)}): sharded gradients and weights run the micro-batches layer by "
                          "layer, which a pipeline cannot; use zero_stage 0 or 1 with pipelines")
    ratios = {d.id: d.shard_ratio for p in plan.pipelines for s in p.stages for d in s.devices}
    if plan.zero_stage == 0:
        given = next(((pi, si, di) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)
                      for di, d in enumerate(s.devices) if d.shard_ratio is not None), None)
        if given is not None:
            pi, si, di = given
            raise err(f"pipelines[{pi}].stages[{si}].devices[{di}].shard_ratio", "a shard ratio needs zero_stage >= 1")
    else:
        for g in peer_groups(plan):  # the peer sets come from the plan's shapes
            mine = [ratios[h] for h in g.holders]
            if any(r is None for r in mine) and any(r is not None for r in mine):
                raise err("pipelines", f"devices {', '.join(g.holders)} hold the same parameters: give all or none of them a shard_ratio")
            if all(r is not None for r in mine) and sum(mine) <= 0:
                raise err("pipelines", f"devices {', '.join(g.holders)} hold the same parameters and all have shard_ratio 0: "
                                       "one of them must own the optimizer state")
    if spec.seq_len <= 0:
        raise err("model.seq_len", "must be positive")
    return plan


def load_plan(path: str | Path) -> Plan:
    return from_dict(load_json(path), source=str(path))


def save_plan(plan: Plan, path: str | Path) -> None:
    write_atomically(path, plan.to_json() + "\n")


def check_against_cluster(plan: Plan, cluster, *, source: str = "<plan>") -> None:
    """The plan names this cluster, and every device id exists in it. Device ids such as 'node0:1' recur
    from cluster to cluster, so matching ids alone would let a plan be evaluated on the wrong one."""
    if plan.cluster != cluster.name:
        raise BatonError(f"the plan was made for cluster {excerpt(plan.cluster)}, not {excerpt(cluster.name)} "
                         f"({cluster.source}); plan again for this cluster", source=source, field="cluster")
    ids = {d.id for d in cluster.devices}
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            for di, d in enumerate(stage.devices):
                if d.id not in ids:
                    raise BatonError(f"device {excerpt(d.id)} is not in cluster '{cluster.name}' ({cluster.source})",
                                     source=source, field=f"pipelines[{pi}].stages[{si}].devices[{di}].id")


def plan_of_replicas(spec: ModelSpec, batches, zero_stage: int, stages, *, cluster: str = "") -> Plan:
    """A plan of replicas, ``stages[rho]`` the stages of replica rho and ``batches[rho]`` its (micro-batch
    size, count); a batch is stated per replica only where the replicas' batches differ (not validated: the
    planners check their plans by evaluating them)."""
    uniform = len(set(batches)) == 1
    pipelines = tuple(Pipeline(stages=tuple(st), micro_batch_size=None if uniform else b,
                               num_microbatches=None if uniform else m) for st, (b, m) in zip(stages, batches))
    return Plan(model=spec, cluster=cluster, micro_batch_size=batches[0][0], num_microbatches=batches[0][1],
                pipelines=pipelines, zero_stage=zero_stage)


def interleaved_pipeline(pipe: Pipeline, layers) -> Pipeline:
    """``pipe``'s stages as the device groups of an interleaved pipeline (docs/schedules.md): virtual stage k holds
    ``layers[k]`` layers (in model order, a multiple of the groups) and runs on group k mod p."""
    p, first, stages = len(pipe.stages), 0, []
    for k, n in enumerate(layers):
        stages.append(replace(pipe.stages[k % p], first_layer=first, num_layers=n))
        first += n
    return replace(pipe, stages=tuple(stages), chunks=len(layers) // p)


def simple_plan(spec: ModelSpec, *, cluster: str, stages: list[list[tuple[str, int]]], layers: list[int],
                units_per_layer: list[int] | int, micro_batch_size: int = 1, num_microbatches: int = 1,
                recompute: dict[str, list[str]] | None = None) -> Plan:
    """Build a one-pipeline plan from short lists: ``stages[i]`` is [(device id, units), ...]."""
    recompute = recompute or {}
    U = units_per_layer if isinstance(units_per_layer, list) else [units_per_layer] * len(stages)
    first = 0
    built = []
    for i, group in enumerate(stages):
        built.append(Stage(first_layer=first, num_layers=layers[i], units_per_layer=U[i], devices=tuple(
            DeviceShare(id=d, units=u, recompute=tuple(recompute.get(d, ()))) for d, u in group)))
        first += layers[i]
    return validate(Plan(model=spec, cluster=cluster, micro_batch_size=micro_batch_size,
                         num_microbatches=num_microbatches, pipelines=(Pipeline(stages=tuple(built)),)))
