"""The inner MILP: for one (micro-batch, skeleton), choose layers per stage, units per device and
recompute sets per device to minimise the iteration time of docs/cost-model.md exactly.

Each constraint family is one function named for what it says, with the equation it encodes.
Products of an integer (layers) and a continuous time are linearised exactly with the binary expansion
of the layer count and one big-M inequality per bit (McCormick with binaries). Max terms (slowest device
of a block, slowest stage path of 1F1B, slowest optimizer step) are ">=" constraints: every variable
that holds a max only appears with a positive sign in the objective, so at the optimum each one sits on
its largest right-hand side and the objective equals the cost model's value of the chosen decisions.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.solver.common.factory import SolverFactory
from pyomo.contrib.solver.common.results import TerminationCondition

from baton.pipeline import schedule_1f1b
from baton.plan import DeviceShare, Pipeline, Plan, Stage

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
    scheduler is reset whenever the count changes."""
    import highspy

    if _SCHEDULER_THREADS and _SCHEDULER_THREADS[-1] != threads:
        highspy.Highs.resetGlobalScheduler(True)
    _SCHEDULER_THREADS[:] = [threads]
    res = SolverFactory("highs").solve(model, threads=threads, load_solutions=False,
                                       raise_exception_on_nonoptimal_result=False, **opts)
    if res.termination_condition == TerminationCondition.unknown and res.incumbent_objective is None:
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
        self._variables()
        self.one_share_and_recompute_set_per_device()
        self.units_add_up_to_stage_granularity()
        self.layers_cover_the_model()
        self.block_time_is_slowest_device()
        self.stage_time_is_layers_times_layer_time()
        self.memory_fits_every_device()
        self.pipeline_follows_1f1b()
        self.weights_held_per_device()
        self.optimizer_step_is_slowest_device()
        self.data_parallel_sync()
        self.objective_is_iteration_time()
        self.build_s = time.perf_counter() - t0

    # -- variables ------------------------------------------------------------------------------------
    def _variables(self) -> None:
        inst, m = self.inst, self.m
        p = inst.skeleton.num_stages
        self.p = p
        self.R = inst.modelled_replicas
        N = inst.spec.num_layers
        self.nbits = _bits(N)
        m.z = pyo.Var([(s, j) for s in range(p) for j in range(self.nbits)], domain=pyo.Binary)
        m.L = pyo.Var(range(p), domain=pyo.NonNegativeIntegers, bounds=(0, N))
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
        m.TF = pyo.Var([(rho, s, b) for rho, s in rs for b in range(2)], domain=pyo.NonNegativeReals)
        m.TB = pyo.Var([(rho, s, b) for rho, s in rs for b in range(2)], domain=pyo.NonNegativeReals)
        m.F = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.EF = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.EB = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.B = pyo.Var(rs, domain=pyo.NonNegativeReals)
        m.qF = pyo.Var([(rho, s, j) for rho, s in rs for j in range(self.nbits)], domain=pyo.NonNegativeReals)
        m.qB = pyo.Var([(rho, s, j) for rho, s in rs for j in range(self.nbits)], domain=pyo.NonNegativeReals)
        self.passes = [(rho, kind, s, i) for rho in range(self.R) for s in range(p) for kind in "FB"
                       for i in range(inst.num_microbatches)]
        m.fin = pyo.Var(self.passes, domain=pyo.NonNegativeReals)
        m.T = pyo.Var(domain=pyo.NonNegativeReals)
        self.groups = [(rho, s, g) for rho in range(self.R) for s in range(p) for g in range(len(inst.stages[rho][s].groups))]
        m.W = pyo.Var(self.groups, domain=pyo.NonNegativeReals)
        m.OPT = pyo.Var(domain=pyo.NonNegativeReals)
        m.DP = pyo.Var(domain=pyo.NonNegativeReals)

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
        """Stages hold contiguous layer ranges covering the model; middle stages hold at least one layer."""
        inst, m = self.inst, self.m
        m.layers = pyo.ConstraintList()
        for s in range(self.p):
            m.layers.add(m.L[s] == sum(2**j * m.z[s, j] for j in range(self.nbits)))
            m.layers.add(m.L[s] >= inst.min_layers[s])
            m.layers.add(m.L[s] <= inst.max_layers[s])
        m.layers.add(sum(m.L[s] for s in range(self.p)) == inst.spec.num_layers)

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

    def stage_time_is_layers_times_layer_time(self) -> None:
        """Eq. 9: F_s = L_s * (sum_b T_sb + all-reduce) + slowest embedding/head, linearised over the bits of L_s.

        q_sj >= (per-layer time) - M (1 - z_sj) and q_sj >= 0, so q_sj = z_sj * per-layer time at the optimum.
        """
        inst, m = self.inst, self.m
        m.stage = pyo.ConstraintList()
        for rho in range(self.R):
            for s in range(self.p):
                st = inst.stages[rho][s]
                for which, (T, q, Fv, edge) in enumerate(((m.TF, m.qF, m.F, m.EF[rho, s] + st.edge_fwd_comm_ms),
                                                          (m.TB, m.qB, m.B, m.EB[rho, s] + st.edge_bwd_comm_ms))):
                    per_layer = T[rho, s, 0] + T[rho, s, 1] + st.allreduce_ms
                    M = self._layer_time_bound(rho, s, which)
                    for j in range(self.nbits):
                        m.stage.add(q[rho, s, j] >= per_layer - M * (1 - m.z[s, j]))
                    m.stage.add(Fv[rho, s] >= sum(2**j * q[rho, s, j] for j in range(self.nbits)) + edge)

    def memory_fits_every_device(self) -> None:
        """Eq. 8 (with eq. 3, 4, 7): peak memory is linear in L_s for a fixed choice, so it fits iff
        L_s <= the choice's precomputed largest fitting layer count."""
        m = self.m
        m.memory = pyo.ConstraintList()
        for (rho, s, g) in self.groups:
            keys = self.x_by_group.get((rho, s, g), [])
            m.memory.add(m.L[s] <= sum(self._choice(k).max_layers * m.x[k] for k in keys))

    def pipeline_follows_1f1b(self) -> None:
        """Eq. 1: finish(pass) >= finish(previous pass on the stage) + duration, and
        >= finish(its dependency) + link + duration; the last backward of stage 0 ends the pipeline."""
        inst, m = self.inst, self.m
        p, mb = self.p, inst.num_microbatches
        m.flow = pyo.ConstraintList()
        for rho in range(self.R):
            st = inst.stages[rho]
            for s in range(p):
                prev = None
                for kind, i in schedule_1f1b(p, mb, s):
                    dur = m.F[rho, s] if kind == "F" else m.B[rho, s]
                    me = m.fin[rho, kind, s, i]
                    if prev is not None:
                        m.flow.add(me >= prev + dur)
                    if kind == "F":
                        if s > 0:
                            m.flow.add(me >= m.fin[rho, "F", s - 1, i] + st[s - 1].send_fwd_ms + dur)
                        elif prev is None:
                            m.flow.add(me >= dur)
                    else:
                        if s < p - 1:
                            m.flow.add(me >= m.fin[rho, "B", s + 1, i] + st[s].send_bwd_ms + dur)
                        else:
                            m.flow.add(me >= m.fin[rho, "F", s, i] + dur)
                    prev = me
            m.flow.add(m.T >= m.fin[rho, "B", 0, mb - 1])

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
                    m.weights.add(m.W[rho, s, g] >= param * m.L[s] + edge)
                else:
                    m.weights.add(m.W[rho, s, g] >= param * m.L[s] + edge - (param * N + edge) * (1 - m.v[s, grp.rank, o]))

    def optimizer_step_is_slowest_device(self) -> None:
        """Eq. 10: every device runs its Adam step; the iteration waits for the slowest."""
        inst, m = self.inst, self.m
        m.optimizer = pyo.ConstraintList()
        for (rho, s, g) in self.groups:
            for per_gb in inst.stages[rho][s].groups[g].opt_ms_per_gb:
                m.optimizer.add(m.OPT >= per_gb * m.W[rho, s, g])

    def data_parallel_sync(self) -> None:
        """Eq. 5 / eq. 11: replicas all-reduce gradients rank by rank; the slowest all-reduce counts."""
        inst, m = self.inst, self.m
        m.dpsync = pyo.ConstraintList()
        if inst.skeleton.num_replicas == 1:
            return
        for s in range(self.p):
            st = inst.stages[0][s]
            for k in range(len(st.ids)):
                g = 0 if st.tied else k
                alpha, beta = inst.dp_ms_per_gb[s][k]
                m.dpsync.add(m.DP >= alpha * m.W[0, s, g] + beta)

    def objective_is_iteration_time(self) -> None:
        """Eq. 11: pipeline + tied-embedding sync + data-parallel sync + optimizer step."""
        m = self.m
        m.obj = pyo.Objective(expr=m.T + self.inst.embedding_sync_ms + m.DP + m.OPT, sense=pyo.minimize)

    # -- solving --------------------------------------------------------------------------------------
    def solve(self, *, time_limit: float, rel_gap: float, threads: int, cutoff: float | None = None) -> MilpResult:
        m = self.m
        opts = dict(time_limit=max(0.5, time_limit), rel_gap=rel_gap)
        if cutoff is not None and math.isfinite(cutoff):
            opts["solver_options"] = {"objective_bound": cutoff}
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
        for var in (m.z, m.v, m.w, m.x, m.L):
            for k in var:
                var[k].fix(round(var[k].value or 0.0))
                fixed.append(var[k])
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
        p = self.p
        layers = [int(round(pyo.value(m.L[s]))) for s in range(p)]
        share = {}
        for (s, k, o) in self.v_index:
            if pyo.value(m.v[s, k, o]) > 0.5:
                share[s, k] = inst.share_options[s][o]
        chosen = {}
        for key in self.x_index:
            if pyo.value(m.x[key]) > 0.5:
                chosen[key[:3]] = self._choice(key)
        pipelines = []
        for rho, pipe in enumerate(sk.pipelines):
            src = rho if inst.modelled_replicas > 1 else 0
            stages, first = [], 0
            for s, ids in enumerate(pipe):
                st = inst.stages[src][s]
                devs = []
                for k, dev_id in enumerate(ids):
                    g = 0 if st.tied else k
                    c = chosen[(src, s, g)]
                    U, u = (c.units_per_layer, c.units) if st.tied else share[s, k]
                    devs.append(DeviceShare(id=dev_id, units=u, recompute=tuple(o for o in _op_order(inst) if o in c.recompute)))
                U = chosen[(src, s, 0)].units_per_layer
                stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=int(U), devices=tuple(devs)))
                first += layers[s]
            pipelines.append(Pipeline(stages=tuple(stages)))
        return Plan(model=inst.spec, cluster="", micro_batch_size=inst.micro_batch, num_microbatches=inst.num_microbatches,
                    pipelines=tuple(pipelines))


def _op_order(inst: Instance) -> list[str]:
    from baton.operators import operator_names
    return operator_names(inst.spec)
