"""Who is who in a run: a plan's devices as ranks, their slices of each layer, their peers and groups.

Ranks follow ``plan.device_ids()``: pipeline by pipeline, stage by stage, tensor-parallel rank by rank.
Replicas may differ in shape (stages, layers, TP splits); each replica's pipeline arithmetic uses its own
stages. Gradients are summed across replicas over ``baton.peers``' peer groups: one process group per
distinct set of holders (``peer_rank_lists``).

Pairing between stages (the cost model assumes exactly this): rank j of stage s+1 receives its input
activation from rank (j mod n_s) of stage s; in backward rank i of stage s receives its input-gradient
from rank (i mod n_{s+1}) of stage s+1. Every rank of a stage holds the full activation, so any pairing
is correct; this one spreads the transfers. An interleaved pipeline (``Pipeline.chunks`` > 1) pairs its
groups the same way and wraps around: the last group's activations go on to the first (the next chunk),
the first group's input-gradients back to the last.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from baton.peers import peer_groups
from baton.plan import Plan, Stage


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    """One rank's place in the plan."""

    rank: int
    """Global rank."""
    pipeline: int
    """Data-parallel replica index."""
    stage: int
    """Pipeline stage index."""
    tp_rank: int
    """Index within the stage's tensor-parallel group."""
    heads: range
    """Attention heads this rank holds in every layer of its stage."""
    ffn_cols: range
    """FFN columns this rank holds in every layer of its stage."""
    recompute: frozenset[str]
    """Operators this rank recomputes."""
    num_stages: int = 1
    """Stages of this rank's pipeline (replicas may have different numbers)."""

    @property
    def first(self) -> bool:
        """Whether this rank is on its pipeline's first stage (it holds the embedding)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank is on its pipeline's last stage (it holds the final LayerNorm, head and loss)."""
        return self.stage == self.num_stages - 1


class Topology:
    """Rank arithmetic for a plan; ``groups`` creates the process groups (call on every rank)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.ranks: list[list[list[int]]] = []
        r = 0
        for pipe in plan.pipelines:
            stages = []
            for stage in pipe.device_stages:
                stages.append(list(range(r, r + len(stage.devices))))
                r += len(stage.devices)
            self.ranks.append(stages)
        self.world_size = r
        self.num_stages = plan.num_stages
        """Stages of pipeline 0 (other replicas may have another number: ``stages_of``)."""
        self.num_replicas = len(plan.pipelines)
        self.rank_of = {d: i for i, d in enumerate(plan.device_ids())}
        """Device id -> global rank."""

    def stages_of(self, pipeline: int) -> int:
        return len(self.ranks[pipeline])

    def stage(self, pos: Position) -> Stage:
        return self.plan.pipelines[pos.pipeline].stages[pos.stage]

    def layers(self, pos: Position) -> tuple[int, ...]:
        """The layers the rank's group holds: its stage's, or interleaved those of all its chunks."""
        pipe = self.plan.pipelines[pos.pipeline]
        return tuple(layer for st in pipe.stages[pos.stage::len(pipe.device_stages)] for layer in st.layers)

    def _wraps(self, pos: Position) -> bool:
        return self.plan.pipelines[pos.pipeline].chunks > 1

    def position(self, rank: int) -> Position:
        spec = self.plan.model
        for pi, stages in enumerate(self.ranks):
            for si, ranks in enumerate(stages):
                if rank in ranks:
                    stage = self.plan.pipelines[pi].stages[si]
                    j = ranks.index(rank)
                    units_before = sum(d.units for d in stage.devices[:j])
                    units = stage.devices[j].units
                    hpu, fpu = spec.num_heads // stage.units_per_layer, spec.ffn_dim // stage.units_per_layer
                    return Position(
                        rank=rank, pipeline=pi, stage=si, tp_rank=j,
                        heads=range(units_before * hpu, (units_before + units) * hpu),
                        ffn_cols=range(units_before * fpu, (units_before + units) * fpu),
                        recompute=frozenset(stage.devices[j].recompute), num_stages=len(stages))
        raise ValueError(f"rank {rank} is not in the plan ({self.world_size} devices)")

    # --- pipeline peers -------------------------------------------------------------------------
    def forward_source(self, pos: Position) -> int | None:
        """Rank of the previous stage that sends this rank its input activation."""
        if pos.stage == 0 and not self._wraps(pos):
            return None
        prev = self.ranks[pos.pipeline][pos.stage - 1]
        return prev[pos.tp_rank % len(prev)]

    def forward_targets(self, pos: Position) -> list[int]:
        """Ranks of the next stage this rank sends its output activation to."""
        if pos.last and not self._wraps(pos):
            return []
        n = len(self.ranks[pos.pipeline][pos.stage])
        return [r for j, r in enumerate(self.ranks[pos.pipeline][(pos.stage + 1) % pos.num_stages]) if j % n == pos.tp_rank]

    def backward_source(self, pos: Position) -> int | None:
        """Rank of the next stage that sends this rank the gradient of its output."""
        if pos.last and not self._wraps(pos):
            return None
        nxt = self.ranks[pos.pipeline][(pos.stage + 1) % pos.num_stages]
        return nxt[pos.tp_rank % len(nxt)]

    def backward_targets(self, pos: Position) -> list[int]:
        """Ranks of the previous stage this rank sends its input-gradient to."""
        if pos.stage == 0 and not self._wraps(pos):
            return []
        n = len(self.ranks[pos.pipeline][pos.stage])
        return [r for i, r in enumerate(self.ranks[pos.pipeline][pos.stage - 1]) if i % n == pos.tp_rank]

    # --- process groups -------------------------------------------------------------------------
    def tp_rank_lists(self) -> list[list[int]]:
        """The ranks of every stage of more than one device."""
        return [ranks for stages in self.ranks for ranks in stages if len(ranks) > 1]

    def peer_rank_lists(self) -> list[list[int]]:
        """The distinct holder sets of two or more ranks among the plan's peer groups (``baton.peers``), in
        the order of their first group: the ranks that sum gradients across replicas (for replicas of one
        shape, the same (stage, TP rank) position in every replica)."""
        out, seen = [], set()
        for g in peer_groups(self.plan):
            ranks = sorted(self.rank_of[h] for h in g.holders)
            if len(ranks) > 1 and tuple(ranks) not in seen:
                seen.add(tuple(ranks))
                out.append(ranks)
        return out

    def dp_rank_lists(self) -> list[list[int]]:
        """Ranks joined by a data-parallel gradient collective: ``peer_rank_lists`` (none for one replica)."""
        return self.peer_rank_lists()

    def tied_rank_lists(self) -> list[list[int]]:
        """First and last stage of each replica of more than one stage, which sum the tied embedding's gradient
        (none when the head is untied)."""
        if not self.plan.model.tie_embeddings:
            return []
        return [stages[0] + stages[-1] for stages in self.ranks if len(stages) > 1]

    def groups(self, pos: Position, *, timeout_s: float | None = None) -> "Groups":
        """Create every group (same order on all ranks, as new_group requires) and keep this rank's.

        ``timeout_s`` bounds every collective of these groups: without it ``new_group`` keeps torch's
        30-minute default whatever the default group was given, so a stopped peer would hang the
        tensor-parallel all-reduces for half an hour."""
        mine: dict = {"peers": {}}
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        for kind, lists in (("tp", self.tp_rank_lists()), ("peers", self.peer_rank_lists()), ("tied", self.tied_rank_lists())):
            for ranks in lists:
                g = dist.new_group(ranks, timeout=timeout)
                if pos.rank in ranks:
                    if kind == "peers":
                        mine["peers"][tuple(ranks)] = g
                    else:
                        mine[kind] = g
        return Groups(**mine)


    def describe(self, rank: int) -> str:
        """'rank 3 (device n1:0)', for messages about a peer."""
        ids = self.plan.device_ids()
        return f"rank {rank} (device {ids[rank]})" if 0 <= rank < len(ids) else f"rank {rank}"

    def recv(self, buf: torch.Tensor, src: int, *, timeout_s: float | None) -> torch.Tensor:
        """Receive ``buf`` from ``src``, waiting at most ``timeout_s`` (None: the default group's
        timeout); a peer that does not send in time is named in the error."""
        return self.wait_recv(self.post_recv(buf, src), timeout_s=timeout_s)

    def post_recv(self, buf: torch.Tensor, src: int, tag: int = 0) -> "PostedRecv":
        """Start receiving ``buf`` from ``src`` (``wait_recv`` finishes it). ``tag`` tells the tensors of one peer
        apart that do not arrive in the order they are taken (an interleaved pipeline of two groups sends each
        group activations and gradients from the same peer)."""
        return PostedRecv(buf=buf, src=src, work=dist.irecv(buf, src, tag=tag))

    def wait_recv(self, posted: "PostedRecv", *, timeout_s: float | None) -> torch.Tensor:
        """The buffer of a posted receive once it has arrived, waiting at most ``timeout_s`` (None: the
        default group's timeout); a peer that does not send in time is named in the error."""
        try:
            if timeout_s is None:
                posted.work.wait()
            else:
                posted.work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                limit = f"{timeout_s:g} s" if timeout_s is not None else "the timeout"
                raise TimeoutError(f"waited more than {limit} for {self.describe(posted.src)} to send "
                                   f"(it is stopped, stuck or much slower than this rank)") from None
            raise
        return posted.buf


@dataclass(frozen=True, slots=True)
class PostedRecv:
    """A receive in flight."""

    buf: torch.Tensor
    """Where the data lands."""
    src: int
    """The sending rank."""
    work: object
    """torch.distributed's handle."""


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's process groups (None where the group would have one member)."""

    tp: object = None
    tied: object = None
    peers: dict = field(default_factory=dict)
    """Sorted holder ranks -> process group, for every peer set of two or more ranks this rank is in."""
