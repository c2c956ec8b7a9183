"""The inner MILP: for one candidate (skeleton, every replica's batch, sharding stage), choose layers per
stage, units per device, recompute sets per device and, at stage 1, each device's owned fraction of its
peer group's optimizer state, to minimise the iteration time of docs/cost-model.md exactly.

Each constraint family is one function named for what it says, with the equation it encodes.
Products of an integer (layers) and a continuous time are linearised exactly with the binary expansion
of the layer count and one big-M inequality per bit (McCormick with binaries). Max terms (slowest device
of a block, slowest stage path of 1F1B, slowest optimizer step) are ">=" constraints: every variable
that holds a max only appears with a positive sign in the objective, so at the optimum each one sits on
its largest right-hand side and the objective equals the cost model's value of the chosen decisions.
Products of a binary (an owned-fraction option, a level of a position's largest ratio) and a continuous
quantity (weights, a peer group's parameters) are linearised the same way: aux >= quantity - M (1 - binary),
aux >= 0, with M the quantity's largest value.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import pyomo.environ as pyo
from pyomo.contrib.solver.common.factory import SolverFactory
from pyomo.contrib.solver.common.results import TerminationCondition

from baton.costmodel import host_optimizer_bytes
from baton.memory import tensor_roles
from baton.schedules import interleaved_one_f_one_b, pass_dependencies
from baton.plan import DeviceShare, Plan, Stage, interleaved_pipeline, plan_of_replicas
from baton.waits import arrival_planes

from solver import stop
from solver.bounds import least_slowest
from solver.instance import GB, Instance


@dataclass(kw_only=True)
class MilpResult:
    status: str
    """'optimal', 'time_limit' (with an incumbent), 'infeasible', 'no_solution'."""
    objective_ms: float | None
    """Iteration time of the returned decisions under the model (re-solved with the decisions fixed)."""
    bound_ms: float
    """Proven lower bound for this candidate."""
    plan: Plan | None
    build_s: float
    solve_s: float
    num_vars: int = 0
    num_constraints: int = 0


_SCHEDULER_THREADS: list[int] = []


def highs_solve(model, *, threads: int, **opts):
    """Solve with HiGHS through Pyomo. HiGHS keeps one global thread scheduler per process and refuses
    (returning 'unknown' with no solution) a later solve that asks for another thread count, so the
    scheduler is reset whenever the count changes, and before this function's first solve: a direct
    ``highspy`` run (eq. 12c's LPs, ``solver.relaxation``) may have started it at its default count."""
    import highspy

    if not _SCHEDULER_THREADS or _SCHEDULER_THREADS[-1] != threads:
        highspy.Highs.resetGlobalScheduler(True)
    _SCHEDULER_THREADS[:] = [threads]
    solver = SolverFactory("highs")
    with stop.solving(solver):  # a stop request (Ctrl-C in `baton solve`) cancels it, as its time limit would
        res = solver.solve(model, threads=threads, load_solutions=False, raise_exception_on_nonoptimal_result=False,
                           **opts)
    if res.termination_condition == TerminationCondition.unknown and res.incumbent_objective is None and not stop.requested():
        raise RuntimeError("HiGHS stopped without a result (termination 'unknown'); run with tee=True to see why")
    return res


def _bits(n: int) -> int:
    return max(1, math.ceil(math.log2(n + 1)))


class InnerModel:
    """Builds the Pyomo model for one Instance, solves it, and reads the plan back."""

    def __init__(self, inst: Instance):
        self.inst = inst
        self.m = pyo.ConcreteModel(name="baton_inner")
        t0 = time.perf_counter()
        self._least_times: dict = {}
        self._variables()
        self.one_share_and_recompute_set_per_device()
        self.units_add_up_to_stage_granularity()
        self.layers_cover_the_model()
        self.block_time_is_slowest_device()
        self.stage_time_is_layers_times_layer_time()
        self.one_owned_fraction_per_device()
        self.largest_ratio_of_each_position()
        self.memory_fits_every_device()
        self.host_memory_fits_every_node()
        self.sync_buffer_fits_every_device()
        self.pipeline_follows_1f1b()
        self.last_replica_arrival()
        self.weights_held_per_device()
        self.parameters_held_per_position()
        self.optimizer_step_is_slowest_device()
        self.data_parallel_sync()
        self.objective_is_iteration_time()
        self.build_s = time.perf_counter() - t0

    # -- variables ------------------------------------------------------------------------------------
    def _variables(self) -> None:
        inst, m = self.inst, self.m
        p = inst.skeleton.num_stages
        self.p = p
        self.K = p * inst.chunks  # virtual stages: group k mod p runs virtual stage k (1F1B: K = p)
        self.R = inst.modelled_replicas
        N = inst.spec.num_layers
        self.nbits = _bits(N)
        m.z = pyo.Var([(k, j) for k in range(self.K) for j in range(self.nbits)], domain=pyo.Binary)
        m.L = pyo.Var(range(self.K), domain=pyo.NonNegativeIntegers, bounds=(0, N))
        # Share options shared by all replicas at (stage, rank); unit counts per stage.
        self.v_index = [(s, k, o) for s in range(p) for k in range(len(inst.skeleton.pipelines[0][s]))
                        for o in range(len(inst.share_options[s]))]
        m.v = pyo.Var(self.v_index, domain=pyo.Binary)
        m.w = pyo.Var([(s, i) for s in range(p) for i in range(len(inst.unit_counts[s]))], domain=pyo.Binary)
        # One binary per (group, share option, recompute choice).
        self.x_index = []
        for rho in range(self.R):
            for s in range(p):
                for g, grp in enumerate(inst.stages[rho][s].groups):
                    for o, opt in enumerate(inst.share_options[s]):
                        for c in range(len(grp.choices.get(opt, []))):
                            self.x_index.append((rho, s, g, o, c))
        m.x = pyo.Var(self.x_index, domain=pyo.Binary)
        self.x_by_group: dict = {}
        for key in self.x_index:
            self.x_by_group.setdefault(key[:3], []).append(key)
        rs = [(rho, s) for rho in range(self.R) for s in range(p)]
        rk = [(rho, k) for rho in range(self.R) for k in range(self.K)]
        m.TF = pyo.Var([(rho, s, b) for rho, s in rs for b in range(2)], domain=pyo.NonNegativeReals)
        m.TB = pyo.Var([(rho, s, b) for rho, s in rs for b in range(2)], domain=pyo.NonNegativeReals)
        m.F = pyo.Var(rk, domain=pyo.NonNegativeReals)
        m.EF = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.EB = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.B = pyo.Var(rk, domain=pyo.NonNegativeReals)
        m.qF = pyo.Var([(rho, k, j) for rho, k in rk for j in range(self.nbits)], domain=pyo.NonNegativeReals)
        m.qB = pyo.Var([(rho, k, j) for rho, k in rk for j in range(self.nbits)], domain=pyo.NonNegativeReals)
        self.passes = [(rho, kind, k, i) for rho in range(self.R) for k in range(self.K) for kind in "FB"
                       for i in range(inst.batch(rho)[1])]
        m.fin = pyo.Var(self.passes, domain=pyo.NonNegativeReals)
        m.T = pyo.Var(domain=pyo.NonNegativeReals)
        self.groups = [(rho, s, g) for rho in range(self.R) for s in range(p) for g in range(len(inst.stages[rho][s].groups))]
        m.W = pyo.Var(self.groups, domain=pyo.NonNegativeReals)
        m.OPT = pyo.Var(domain=pyo.NonNegativeReals)
        m.DP = pyo.Var(domain=pyo.NonNegativeReals)
        # Peer groups (one per position when there are replicas): parameters held, in 1e9.
        self.pos_index = [(s, k) for s in range(p) for k in range(len(inst.skeleton.pipelines[0][s]))]
        self.sharing = inst.skeleton.num_replicas > 1
        m.P = pyo.Var(self.pos_index if self.sharing else [], domain=pyo.NonNegativeReals)
        # Stage 1, replicas one by one: owned-fraction options per device, levels of each position's largest ratio.
        self.choose = inst.ratios.mode == "choose"
        J, levels = len(inst.ratios.values), inst.ratios.levels
        self.y_index = [(rho, s, k, j) for rho in range(self.R) for (s, k) in self.pos_index for j in range(J)] if self.choose else []
        self.u_index = [(s, k, t) for (s, k) in self.pos_index for t in range(len(levels))] if self.choose else []
        m.y = pyo.Var(self.y_index, domain=pyo.Binary)
        m.u = pyo.Var(self.u_index, domain=pyo.Binary)
        m.pi = pyo.Var(self.u_index, domain=pyo.NonNegativeReals)
        m.om = pyo.Var(self.y_index, domain=pyo.NonNegativeReals)

    def group_layers(self, s: int):
        """Layers group ``s`` holds: its stage's, or interleaved the sum over its chunks (virtual stages s, s + p, ...)."""
        return sum(self.m.L[k] for k in range(s, self.K, self.p))

    def _choice(self, key):
        rho, s, g, o, c = key
        opt = self.inst.share_options[s][o]
        return self.inst.stages[rho][s].groups[g].choices[opt][c]

    # -- constraint families ---------------------------------------------------------------------------
    def one_share_and_recompute_set_per_device(self) -> None:
        """Each device picks exactly one (share, recompute set); its share is its rank's share (eq. 2)."""
        inst, m = self.inst, self.m
        m.pick = pyo.ConstraintList()
        for (rho, s, g) in self.groups:
            grp = inst.stages[rho][s].groups[g]
            keys = self.x_by_group.get((rho, s, g), [])
            if grp.rank is None:  # tied group: the stage's single equal-share option
                m.pick.add(sum(m.x[k] for k in keys) == 1)
                continue
            for o in range(len(inst.share_options[s])):
                m.pick.add(sum(m.x[k] for k in keys if k[3] == o) == m.v[s, grp.rank, o])

    def units_add_up_to_stage_granularity(self) -> None:
        """A stage cuts each layer into U units; its ranks hold u_k >= 1 units with sum u_k = U (eq. 2)."""
        inst, m = self.inst, self.m
        m.units = pyo.ConstraintList()
        for s in range(self.p):
            Us = inst.unit_counts[s]
            opts = inst.share_options[s]
            n = len(inst.skeleton.pipelines[0][s])
            m.units.add(sum(m.w[s, i] for i in range(len(Us))) == 1)
            for k in range(n):
                for i, U in enumerate(Us):
                    m.units.add(sum(m.v[s, k, o] for o, (UU, _) in enumerate(opts) if UU == U) == m.w[s, i])
            m.units.add(sum(opts[o][1] * m.v[s, k, o] for k in range(n) for o in range(len(opts)))
                        == sum(U * m.w[s, i] for i, U in enumerate(Us)))

    def layers_cover_the_model(self) -> None:
        """(Virtual) stages hold contiguous layer ranges covering the model; middle ones hold at least one layer."""
        inst, m = self.inst, self.m
        m.layers = pyo.ConstraintList()
        for k in range(self.K):
            m.layers.add(m.L[k] == sum(2**j * m.z[k, j] for j in range(self.nbits)))
            m.layers.add(m.L[k] >= inst.min_layers[k])
            m.layers.add(m.L[k] <= inst.max_layers[k])
        m.layers.add(sum(m.L[k] for k in range(self.K)) == inst.spec.num_layers)

    def block_time_is_slowest_device(self) -> None:
        """Eq. 2 / eq. 9: per layer, a TP group waits for its slowest rank in each block (attn, mlp); the
        embedding/head (vocabulary split by share) waits for its slowest rank too."""
        m = self.m
        m.block = pyo.ConstraintList()
        for (rho, s, g) in self.groups:
            keys = self.x_by_group.get((rho, s, g), [])
            for b in range(2):
                m.block.add(m.TF[rho, s, b] >= sum(self._choice(k).fwd[b] * m.x[k] for k in keys))
                m.block.add(m.TB[rho, s, b] >= sum(self._choice(k).bwd[b] * m.x[k] for k in keys))
            m.block.add(m.EF[rho, s] >= sum(self._choice(k).edge_fwd_ms * m.x[k] for k in keys))
            m.block.add(m.EB[rho, s] >= sum(self._choice(k).edge_bwd_ms * m.x[k] for k in keys))

    def _layer_time_bound(self, rho: int, s: int, which: int) -> float:
        st = self.inst.stages[rho][s]
        total = st.allreduce_ms
        for b in range(2):
            total += max((c.fwd[b] if which == 0 else c.bwd[b]) for g in st.groups for cs in g.choices.values() for c in cs)
        return total

    def _least_layer_times(self, rho: int, s: int, which: int) -> np.ndarray:
        """t[n]: the least per-layer time (forward: which = 0) of stage ``s`` over the decisions that fit n layers in
        memory at the most generous owned fraction (t[0]: any decision): per block, the least over unit counts U
        and shares u_k adding up to U of the slowest rank's fastest choice, + the all-reduce. (Each block's least
        alone: the sum of the leasts is at most the least of the sums.)"""
        key = (rho, s, which)
        if key in self._least_times:
            return self._least_times[key]
        st, N = self.inst.stages[rho][s], self.inst.spec.num_layers

        def fastest(cs, b):  # by n: the fastest of the choices that fit n layers
            best = np.full(N + 1, math.inf)
            for c in cs:
                n = min(max(c.max_layers), N)
                if n >= 0:
                    best[n] = min(best[n], c.fwd[b] if which == 0 else c.bwd[b])
            return np.minimum.accumulate(best[::-1])[::-1]

        total = np.full(N + 1, st.allreduce_ms)
        for b in range(2):
            if st.tied:
                total += np.min([fastest(cs, b) for cs in st.groups[0].choices.values()], axis=0)
                continue
            least = np.full(N + 1, math.inf)
            for U in self.inst.unit_counts[s]:
                per_rank = [{u: fastest(cs, b) for (UU, u), cs in g.choices.items() if UU == U} for g in st.groups]
                rows = np.array([t for r in per_rank for t in r.values()]).reshape(-1, N + 1)
                here = math.inf
                for n in range(N + 1):  # the fastest choices change at a few layer counts only
                    if n == 0 or np.any(rows[:, n] != rows[:, n - 1]):
                        here = least_slowest([{u: t[n] for u, t in r.items()} for r in per_rank], U)
                    least[n] = min(least[n], here)
            total += least
        self._least_times[key] = total
        return total

    def _stage_time_envelope(self, rho: int, s: int, which: int, k: int) -> list[tuple[int, float, float]]:
        """Lines (at n0, value at n0, slope) of the lower convex hull of n * least per-layer time fitting n layers,
        n from the virtual stage's least to its most layers: every one bounds L_k * (per-layer time) from below at
        every integer L_k, memory included, where the bits' big-M alone bound nothing in the LP relaxation.
        Interleaved, a group's memory holds several chunks: the least time of any decision there."""
        lo, hi = self.inst.min_layers[k], self.inst.max_layers[k]
        t = self._least_layer_times(rho, s, which)
        if self.inst.chunks > 1:
            t = np.full_like(t, t[0])
        points = [(n, n * t[n]) for n in range(max(lo, 1), hi + 1) if math.isfinite(t[n])]
        hull: list = []
        for pt in points:
            while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (pt[0] - hull[-2][0])
                                      >= (pt[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                hull.pop()
            hull.append(pt)
        return [(a[0], a[1], (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(hull, hull[1:])]

    def stage_time_is_layers_times_layer_time(self) -> None:
        """Eq. 9 (9i per virtual stage): F_k = L_k * (sum_b T_sb + all-reduce) of its group s = k mod p, + the
        slowest embedding/head on the first and last (virtual) stage, linearised over the bits of L_k.

        q_kj >= (per-layer time) - M (1 - z_kj) and q_kj >= 0, so q_kj = z_kj * per-layer time at the optimum.
        """
        inst, m = self.inst, self.m
        m.stage = pyo.ConstraintList()
        for rho in range(self.R):
            for k in range(self.K):
                s = k % self.p
                st = inst.stages[rho][s]
                ends = k in (0, self.K - 1)  # as ``costmodel.interleaved_timing``: middle stages hold no edge
                for which, (T, q, Fv, edge) in enumerate(((m.TF, m.qF, m.F, m.EF[rho, s] + st.edge_fwd_comm_ms),
                                                          (m.TB, m.qB, m.B, m.EB[rho, s] + st.edge_bwd_comm_ms))):
                    per_layer = T[rho, s, 0] + T[rho, s, 1] + st.allreduce_ms
                    M = self._layer_time_bound(rho, s, which)
                    for j in range(self.nbits):
                        m.stage.add(q[rho, k, j] >= per_layer - M * (1 - m.z[k, j]))
                    m.stage.add(Fv[rho, k] >= sum(2**j * q[rho, k, j] for j in range(self.nbits)) + (edge if ends else 0.0))
                    lo, t_lo = inst.min_layers[k], self._least_layer_times(rho, s, which)[0]
                    if math.isfinite(t_lo):
                        m.stage.add(Fv[rho, k] >= t_lo * m.L[k] + lo * (per_layer - t_lo) + (edge if ends else 0.0))
                    for n0, y0, slope in self._stage_time_envelope(rho, s, which, k):
                        m.stage.add(Fv[rho, k] >= y0 + slope * (m.L[k] - n0) + (edge if ends else 0.0))

    def one_owned_fraction_per_device(self) -> None:
        """Eq. 10, 13, 14 (stage 1, replicas one by one): each device owns one option's fraction of its peer
        group's optimizer state; at each position either every peer owns the equal part 1/r, or the peers own
        multiples of 1/K adding up to 1 (0 allowed)."""
        inst, m = self.inst, self.m
        m.owned = pyo.ConstraintList()
        if not self.choose:
            return
        ratios = inst.ratios
        J = len(ratios.values)
        off_grid = ratios.units[ratios.equal] is None
        for (s, k) in self.pos_index:
            for rho in range(self.R):
                m.owned.add(sum(m.y[rho, s, k, j] for j in range(J)) == 1)
                if off_grid and rho > 0:
                    m.owned.add(m.y[rho, s, k, ratios.equal] == m.y[0, s, k, ratios.equal])
            on_grid = sum(ratios.units[j] * m.y[rho, s, k, j] for rho in range(self.R) for j in range(J) if ratios.units[j])
            m.owned.add(on_grid == ratios.grid * (1 - m.y[0, s, k, ratios.equal] if off_grid else 1))

    def largest_ratio_of_each_position(self) -> None:
        """Eq. 13, 14: u_pt = 1 when some peer of position p owns at least level t (a thermometer: the
        position's largest ratio is sum_t (level_t - level_t-1) u_pt); u only restricts (memory) or costs (sync),
        so at the optimum it is the actual largest ratio."""
        inst, m = self.inst, self.m
        m.largest = pyo.ConstraintList()
        if not self.choose:
            return
        values, levels = inst.ratios.values, inst.ratios.levels
        for (s, k, t) in self.u_index:
            for rho in range(self.R):
                m.largest.add(m.u[s, k, t] >= sum(m.y[rho, s, k, j] for j, v in enumerate(values) if v >= levels[t]))

    def memory_fits_every_device(self) -> None:
        """Eq. 8 (with eq. 3, 4, 7): peak memory is linear in L_s for a fixed choice and owned fraction, so it
        fits iff L_s <= the choice's precomputed largest fitting layer count at that fraction (with the owned-
        fraction options of stage 1: for each option j, L_s <= sum_c maxL_cj x_c + (N + 1)(1 - y_j))."""
        inst, m = self.inst, self.m
        m.memory = pyo.ConstraintList()
        N = inst.spec.num_layers
        if inst.chunks > 1:
            self._interleaved_memory()
            return
        for (rho, s, g) in self.groups:
            keys = self.x_by_group.get((rho, s, g), [])
            if not self.choose:
                m.memory.add(m.L[s] <= sum(self._choice(k).max_layers[0] * m.x[k] for k in keys))
                continue
            for j in range(len(inst.ratios.values)):
                m.memory.add(m.L[s] <= sum(self._choice(k).max_layers[j] * m.x[k] for k in keys) + (N + 1) * (1 - m.y[rho, s, g, j]))

    def host_memory_fits_every_node(self) -> None:
        """Eq. 8o: a node with a host memory cap H_n holds what its devices offload, sum_d in_flight_d L_s H_c x_c
        <= H_n over every device of the node in every replica (twins are not merged when a node has a cap,
        ``build_instance``). The product L_s x_c is h_c >= L_s - N (1 - x_c), h_c >= 0 (h_c only appears on the
        left of a <=, so at any solution it may sit at L_s x_c); in units of H_n with a margin of 1e-6 H_n, so the
        solver's feasibility tolerance cannot admit a plan the evaluator refuses. With eq. 7h the optimizer state of
        the node's devices that keep it on the host adds to the sum."""
        inst, m = self.inst, self.m
        m.host = pyo.ConstraintList()
        if not inst.host_memory or inst.chunks > 1:
            return
        N = inst.spec.num_layers
        terms: dict[str, list] = {}
        used: set = set()
        for rho, pipe in enumerate(inst.skeleton.pipelines):
            src = inst.replica_class[rho]
            for s, ids in enumerate(pipe):
                st = inst.stages[src][s]
                for k, dev in enumerate(ids):
                    node = inst.node_of.get(dev)
                    if node not in inst.host_memory:
                        continue
                    g = 0 if st.tied else k
                    in_flight = st.groups[g].slots[0].in_flight
                    for key in self.x_by_group.get((src, s, g), []):
                        c = self._choice(key)
                        if c.host_bytes > 0:
                            used.add(key)
                            terms.setdefault(node, []).append((in_flight * c.host_bytes / inst.host_memory[node], key))
        m.hL = pyo.Var(sorted(used), domain=pyo.NonNegativeReals)
        for key in sorted(used):
            m.host.add(m.hL[key] >= m.L[key[1]] - N * (1 - m.x[key]))
        # Eq. 7h: a device whose optimizer state is on the host puts it there, linear in its weights W (GB):
        # hW >= W - MW (1 - o), hW >= 0.
        owned = inst.ratios.values[0]
        per_gb = host_optimizer_bytes(GB, inst.spec) * owned
        opt_terms: dict[str, list] = {}
        for (rho, s, g) in self.groups:
            if self.choose or self.host_optimizer(rho, s, g) is None:
                continue
            for dev in inst.stages[rho][s].groups[g].ids:
                node = inst.node_of.get(dev)
                if node in inst.host_memory:
                    opt_terms.setdefault(node, []).append((rho, s, g))
        held = sorted({grp for row in opt_terms.values() for grp in row})
        m.hW = pyo.Var(held, domain=pyo.NonNegativeReals)
        for (rho, s, g) in held:
            m.host.add(m.hW[rho, s, g] >= m.W[rho, s, g] - self._weights_bound(rho, s, g) * (1 - self.host_optimizer(rho, s, g)))
        for node in set(terms) | set(opt_terms):
            m.host.add(sum(a * m.hL[key] for a, key in terms.get(node, []))
                       + sum(per_gb / inst.host_memory[node] * m.hW[grp] for grp in opt_terms.get(node, [])) <= 1.0 - 1e-6)

    def _interleaved_memory(self) -> None:
        """Eq. 8i: a device of an interleaved group fits iff every line of its choice (``costmodel.ChunkMemoryRow``,
        one per moment its schedule may peak at) stays within its capacity C, sum_c a_c L_(c p + s) <= C - fixed
        + M (1 - x), in units of C and with a margin of 1e-6 C so that the solver's feasibility tolerance cannot
        admit a plan the evaluator refuses; and it holds at most ``max_layers[0]`` layers in all (its sync
        buffer, eq. 14)."""
        inst, m = self.inst, self.m
        for (rho, s, g) in self.groups:
            cap = min(slot.memory_bytes for slot in inst.stages[rho][s].groups[g].slots)
            chunks = [m.L[k] for k in range(s, self.K, self.p)]
            for key in self.x_by_group.get((rho, s, g), []):
                c = self._choice(key)
                m.memory.add(self.group_layers(s) <= c.max_layers[0] + inst.spec.num_layers * (1 - m.x[key]))
                for row in c.chunk_rows:
                    coef = [a / cap for a in row.per_layer_bytes]
                    rhs = 1.0 - row.fixed_bytes / cap - 1e-6
                    big = max(0.0, sum(coef) * inst.spec.num_layers - rhs)
                    m.memory.add(sum(a * L for a, L in zip(coef, chunks)) <= rhs + big * (1 - m.x[key]))

    def sync_buffer_fits_every_device(self) -> None:
        """Eq. 14 with eq. 8: after the backward pass a device holds 2 W + O(owned) + the staging buffer of its
        peer group's sharded sync, (r + 1) x largest shard x e. For its share, its owned option j and the
        position's largest-ratio level t this is linear in L_s, so it fits iff L_s <= a precomputed count:
        L_s <= sum_o maxLbuf_ojt v_o + (N + 1)(2 - y_j - u_t) (only where the count can bind). At one owned
        fraction (replicas modelled as one) the count is folded into the choice's max_layers."""
        inst, m = self.inst, self.m
        m.buffer = pyo.ConstraintList()
        if not self.choose:
            return
        N = inst.spec.num_layers
        for (rho, s, g) in self.groups:
            grp = inst.stages[rho][s].groups[g]
            opts = [(o, opt) for o, opt in enumerate(inst.share_options[s]) if opt in grp.buffer_limits]
            for j in range(len(inst.ratios.values)):
                for t in range(len(inst.ratios.levels)):
                    lims = [(o, int(grp.buffer_limits[opt][j, t])) for o, opt in opts]
                    if all(lim >= inst.max_layers[s] for _, lim in lims):
                        continue  # never binding
                    m.buffer.add(m.L[s] <= sum(lim * m.v[s, g, o] for o, lim in lims)
                                 + (N + 1) * (2 - m.y[rho, s, g, j] - m.u[s, g, t]))

    def pipeline_follows_1f1b(self) -> None:
        """Eq. 1 over the schedule as data (``baton.schedules.interleaved_one_f_one_b``, which is ``one_f_one_b`` at one
        chunk: the list the evaluator's recurrence and the runtime's interpreter read), over virtual stages: one
        ``>=`` per pair of ``baton.schedules.pass_dependencies``, finish(pass)
        >= finish(the pass its stage ran before) + duration, and >= finish(the pass whose tensor it receives) +
        link + duration (a first pass: >= duration); the last backward of stage 0 ends the pipeline. Every finish
        only bounds the objective from below, so the optimum sits on the longest path, which is
        ``baton.pipeline.iteration_time`` of the same schedule (tests/test_schedules.py)."""
        inst, m = self.inst, self.m
        p = self.p
        m.flow = pyo.ConstraintList()
        for rho in range(self.R):
            st = inst.stages[rho]
            mb = inst.batch(rho)[1]
            links = {"fwd": [st[k % p].send_fwd_ms for k in range(self.K - 1)],
                     "bwd": [st[k % p].send_bwd_ms for k in range(self.K - 1)]}
            for (kind, s, i), deps in pass_dependencies(interleaved_one_f_one_b(p, inst.chunks, mb)):
                me = m.fin[rho, kind, s, i]
                dur = m.F[rho, s] if kind == "F" else m.B[rho, s]
                for (dk, ds, di), link in deps:
                    m.flow.add(me >= m.fin[rho, dk, ds, di] + (links[link[0]][link[1]] if link else 0.0) + dur)
                if not deps:
                    m.flow.add(me >= dur)
            m.flow.add(m.T >= m.fin[rho, "B", 0, mb - 1])

    def last_replica_arrival(self) -> None:
        """Eq. 19: the sync starts at the last arrival X, at least every plane of ``baton.waits.arrival_planes``.
        The sum of the k largest finishes is linear in a minimisation (its LP dual): S_k = k lam_k +
        sum_c n_c nu_kc, nu_kc >= finish_c - lam_k, nu >= 0, with n_c replicas in class c; the largest is T.
        Every plane has non-negative coefficients, so at the optimum X is the family's maximum exactly."""
        inst, m = self.inst, self.m
        planes = arrival_planes(inst.skeleton.num_replicas, inst.replica_time_cv)
        m.arrival = pyo.ConstraintList()
        if not planes.top_k:
            m.X = pyo.Expression(expr=m.T)
            return
        counts = [inst.replica_class.count(c) for c in range(self.R)]
        finish = [m.fin[c, "B", 0, inst.batch(c)[1] - 1] for c in range(self.R)]
        ks = [k for k, _ in planes.top_k]
        m.X = pyo.Var(domain=pyo.NonNegativeReals)
        m.lam = pyo.Var(ks, domain=pyo.Reals)
        m.nu = pyo.Var([(k, c) for k in ks for c in range(self.R)], domain=pyo.NonNegativeReals)
        top = {}
        for k, a in planes.top_k:
            for c in range(self.R):
                m.arrival.add(m.nu[k, c] >= finish[c] - m.lam[k])
            top[k] = k * m.lam[k] + sum(n * m.nu[k, c] for c, n in enumerate(counts))
            m.arrival.add(m.X >= a * top[k])
        for b, c in planes.pairs:
            m.arrival.add(m.X >= b * top[2] + c * m.T)
        m.arrival.add(m.X >= m.T)

    def weights_held_per_device(self) -> None:
        """Weights (GB) = L_s * per-layer parameters of the chosen share + embedding/head parameters."""
        inst, m = self.inst, self.m
        m.weights = pyo.ConstraintList()
        N = inst.spec.num_layers
        for (rho, s, g) in self.groups:
            grp = inst.stages[rho][s].groups[g]
            for o, opt in enumerate(inst.share_options[s]):
                cs = grp.choices.get(opt)
                if not cs:
                    continue
                param, edge = cs[0].param_bytes / GB, cs[0].edge_param_bytes / GB
                if grp.rank is None:
                    m.weights.add(m.W[rho, s, g] >= param * self.group_layers(s) + edge)
                else:
                    m.weights.add(m.W[rho, s, g] >= param * self.group_layers(s) + edge
                                  - (param * N + edge) * (1 - m.v[s, grp.rank, o]))

    def _weights_bound(self, rho: int, s: int, g: int) -> float:
        """Largest weights (GB) the group can hold: its largest share and every layer."""
        inst = self.inst
        grp = inst.stages[rho][s].groups[g]
        N = inst.spec.num_layers
        return max(cs[0].param_bytes / GB * N + cs[0].edge_param_bytes / GB for cs in grp.choices.values())

    def parameters_held_per_position(self) -> None:
        """Section 9: the peer group of position (s, k) holds P_sk = layer_param_count(share) L_s +
        edge_param_count(share) parameters (1e9), the counts of the evaluator's peer groups (``baton.peers``),
        not the tables' parameter bytes: P_sk >= a_o L_s + c_o - M_o (1 - v_sko)."""
        inst, m = self.inst, self.m
        m.params = pyo.ConstraintList()
        if not self.sharing:
            return
        N = inst.spec.num_layers
        for (s, k) in self.pos_index:
            for o, opt in enumerate(inst.share_options[s]):
                a, c = inst.positions[s][k].params[opt]
                m.params.add(m.P[s, k] >= a * self.group_layers(s) + c - (a * N + c) * (1 - m.v[s, k, o]))

    def _largest_params(self, s: int, k: int) -> float:
        a_c = self.inst.positions[s][k].params.values()
        return max(a * self.inst.spec.num_layers + c for a, c in a_c)

    def optimizer_step_is_slowest_device(self) -> None:
        """Eq. 10: every device runs its Adam step over the weights it owns (all at stage 0, 1/r with the
        replicas modelled as one, its option's fraction otherwise: om_j >= W - M (1 - y_j)); the iteration
        waits for the slowest."""
        inst, m = self.inst, self.m
        m.optimizer = pyo.ConstraintList()
        values = inst.ratios.values
        for (rho, s, g) in self.groups:
            grp = inst.stages[rho][s].groups[g]
            slopes = grp.opt_ms_per_gb
            if not self.choose:
                host = self.host_optimizer(rho, s, g)
                MW = self._weights_bound(rho, s, g)
                for per_gb, slot in zip(slopes, grp.slots):
                    if host is None:
                        m.optimizer.add(m.OPT >= per_gb * values[0] * m.W[rho, s, g])
                        continue
                    # Eq. 10h: on the host with the slope of its host step, on the device with eq. 10's.
                    on_host = slot.host_optimizer_ms_per_byte * GB * values[0]
                    m.optimizer.add(m.OPT >= per_gb * values[0] * (m.W[rho, s, g] - MW * host))
                    m.optimizer.add(m.OPT >= on_host * (m.W[rho, s, g] - MW * (1 - host)))
                continue
            MW = self._weights_bound(rho, s, g)
            for j in range(len(values)):
                m.optimizer.add(m.om[rho, s, g, j] >= m.W[rho, s, g] - MW * (1 - m.y[rho, s, g, j]))
            for per_gb in slopes:
                m.optimizer.add(m.OPT >= per_gb * sum(v * m.om[rho, s, g, j] for j, v in enumerate(values)))

    def host_optimizer(self, rho: int, s: int, g: int):
        """1 when the group's choice keeps its optimizer state in host memory (eq. 7h), as a sum of its choices'
        binaries; None when it has no such choice."""
        keys = [k for k in self.x_by_group.get((rho, s, g), []) if self._choice(k).offload_optimizer]
        return sum(self.m.x[k] for k in keys) if keys else None

    def data_parallel_sync(self) -> None:
        """Eq. 13 / eq. 15: each position's peers sync their group (stage 0: an all-reduce of its P parameters;
        stage 1: reduce-scatter + all-gather padded to the largest shard, largest ratio x P); the groups of
        replicas of one shape are disjoint and run side by side, so the slowest counts. With owned-fraction
        options the largest shard is sum_t (level_t - level_t-1) pi_t, pi_t >= P - M (1 - u_t)."""
        inst, m = self.inst, self.m
        m.dpsync = pyo.ConstraintList()
        if not self.sharing:
            return
        levels = inst.ratios.levels
        for (s, k) in self.pos_index:
            pos = inst.positions[s][k]
            if not self.choose:  # the whole group (stage 0) or the equal shard 1/r (stage 1)
                m.dpsync.add(m.DP >= pos.sync_ms_per_gparam * inst.ratios.values[0] * m.P[s, k] + pos.sync_fixed_ms)
                continue
            Mp = self._largest_params(s, k)
            for t in range(len(levels)):
                m.dpsync.add(m.pi[s, k, t] >= m.P[s, k] - Mp * (1 - m.u[s, k, t]))
            shard = sum((levels[t] - (levels[t - 1] if t else 0.0)) * m.pi[s, k, t] for t in range(len(levels)))
            m.dpsync.add(m.DP >= pos.sync_ms_per_gparam * shard + pos.sync_fixed_ms)

    def objective_is_iteration_time(self) -> None:
        """Eq. 11: the last replica's arrival (eq. 19) + tied-embedding sync + data-parallel sync + optimizer step."""
        m = self.m
        m.obj = pyo.Objective(expr=m.X + self.inst.embedding_sync_ms + m.DP + m.OPT, sense=pyo.minimize)

    # -- solving --------------------------------------------------------------------------------------
    def solve(self, *, time_limit: float, rel_gap: float, threads: int, cutoff: float | None = None) -> MilpResult:
        m = self.m
        opts = dict(time_limit=max(0.5, time_limit), rel_gap=rel_gap)
        if cutoff is not None and math.isfinite(cutoff):
            # With an incumbent to beat, the search needs a proof more than a plan: the neighbourhood heuristics
            # (RINS, RENS) took half of a 256-GPU candidate's solve and found nothing the tree did not.
            opts["solver_options"] = {"objective_bound": cutoff, "mip_heuristic_run_rins": False,
                                      "mip_heuristic_run_rens": False}
        t0 = time.perf_counter()
        res = highs_solve(m, threads=threads, **opts)
        solve_s = time.perf_counter() - t0
        tc = res.termination_condition
        bound = res.objective_bound
        bound = float(bound) if bound is not None and math.isfinite(bound) else 0.0
        nv, nc = m.nvariables(), m.nconstraints()
        has_sol = res.incumbent_objective is not None
        if not has_sol:
            status = "infeasible" if tc in (TerminationCondition.provenInfeasible, TerminationCondition.infeasibleOrUnbounded) else "no_solution"
            if cutoff is not None and status != "no_solution":
                status = "cutoff"
            if status in ("infeasible", "cutoff"):
                bound = max(bound, cutoff if cutoff is not None and status == "cutoff" else math.inf)
            return MilpResult(status=status, objective_ms=None, bound_ms=bound, plan=None, build_s=self.build_s,
                              solve_s=solve_s, num_vars=nv, num_constraints=nc)
        res.solution_loader.load_vars()
        status = "optimal" if tc == TerminationCondition.convergenceCriteriaSatisfied else "time_limit"
        plan = self.read_plan()
        objective = self.fixed_decision_value(threads=threads)
        solve_s = time.perf_counter() - t0
        return MilpResult(status=status, objective_ms=objective, bound_ms=min(bound, objective), plan=plan,
                          build_s=self.build_s, solve_s=solve_s, num_vars=nv, num_constraints=nc)

    def fixed_decision_value(self, *, threads: int) -> float:
        """Fix every discrete decision at its loaded value and re-solve the LP: the exact model value."""
        m = self.m
        fixed = []
        for var in (m.z, m.v, m.w, m.x, m.L, m.y):
            for k in var:
                var[k].fix(round(var[k].value or 0.0))
                fixed.append(var[k])
        if self.choose:  # each position's largest ratio, from the owned fractions chosen
            largest = {}
            for (rho, s, k, j) in self.y_index:
                if m.y[rho, s, k, j].value > 0.5:
                    largest[s, k] = max(largest.get((s, k), 0.0), self.inst.ratios.values[j])
            for (s, k, t) in self.u_index:
                m.u[s, k, t].fix(int(largest.get((s, k), 0.0) >= self.inst.ratios.levels[t]))
                fixed.append(m.u[s, k, t])
        res = highs_solve(m, threads=threads, time_limit=60)
        try:
            if res.termination_condition != TerminationCondition.convergenceCriteriaSatisfied:
                raise RuntimeError(f"re-solving the fixed decisions failed: {res.termination_condition}")
            res.solution_loader.load_vars()
            return float(pyo.value(m.obj))
        finally:
            for var in fixed:
                var.unfix()

    def read_plan(self) -> Plan:
        inst, m = self.inst, self.m
        sk = inst.skeleton
        layers = [int(round(pyo.value(m.L[k]))) for k in range(self.K)]
        share = {}
        for (s, k, o) in self.v_index:
            if pyo.value(m.v[s, k, o]) > 0.5:
                share[s, k] = inst.share_options[s][o]
        chosen = {}
        for key in self.x_index:
            if pyo.value(m.x[key]) > 0.5:
                chosen[key[:3]] = self._choice(key)
        ratio = {}
        for (rho, s, k, j) in self.y_index:
            if pyo.value(m.y[rho, s, k, j]) > 0.5:
                units = inst.ratios.units[j]
                ratio[rho, s, k] = None if units is None else units / inst.ratios.grid
        replicas = []
        for rho, pipe in enumerate(sk.pipelines):
            src = inst.replica_class[rho]
            stages, first = [], 0
            for s, ids in enumerate(pipe):
                st = inst.stages[src][s]
                devs = []
                for k, dev_id in enumerate(ids):
                    g = 0 if st.tied else k
                    c = chosen[(src, s, g)]
                    U, u = (c.units_per_layer, c.units) if st.tied else share[s, k]
                    devs.append(DeviceShare(id=dev_id, units=u, recompute=tuple(o for o in _op_order(inst) if o in c.recompute),
                                            shard_ratio=ratio.get((rho, s, k)), offload=_tensor_order(inst, c.offload),
                                            offload_optimizer=c.offload_optimizer))
                U = chosen[(src, s, 0)].units_per_layer
                stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=int(U), devices=tuple(devs)))
                first += layers[s]
            replicas.append(stages)
        plan = plan_of_replicas(inst.spec, inst.batches, inst.zero_stage, replicas)
        if inst.chunks == 1:
            return plan
        return replace(plan, pipelines=tuple(interleaved_pipeline(pipe, layers) for pipe in plan.pipelines))


def _tensor_order(inst: Instance, tensors: frozenset) -> tuple[str, ...]:
    """``tensors`` in a layer's order (``baton.memory.tensor_roles``), as a plan lists them."""
    return tuple(t for t in tensor_roles(inst.spec) if t in tensors)


def _op_order(inst: Instance) -> list[str]:
    from baton.operators import operator_names
    return operator_names(inst.spec)
