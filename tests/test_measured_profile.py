"""Measured profiling on the CPU: the table's structure, its saved bytes, the calibration, the link fit."""
from __future__ import annotations

import ctypes
import resource

import pandas as pd
import pytest
import torch

from baton.cluster import MAX_REPLICA_TIME_CV, Link, load_cluster
from baton.costmodel import allreduce_ms, optimizer_step_ms, tp_allreduce_ms
from baton.model_spec import PRESETS
from baton.operators import layer_operators, operator_param_count, tensor_sizes
from baton.profile import Profile, calibrate, derive_table, validate_table
from runtime.measure import op_profiler
from runtime.measure.comm_profiler import fit_line, link_fit, measure_links
from runtime.launch.host_memory import keep_freed_memory
from runtime.measure.op_profiler import measure, median_of_tables, profile_table
from tests.conftest import run_cli

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return profile_table(TINY, micro_batches=(1, 2), shares=(0.5, 1.0), warmup=1, reps=2)


def test_measured_table_has_the_schema_and_every_operator(measured):
    validate_table(measured, source="<test>")
    assert set(measured["source"]) == {"measured"}
    prof = Profile(measured)
    prof.check_model(TINY)
    split = [o.name for o in layer_operators(TINY) if o.tp_split]
    for op in split:
        assert set(measured[measured.op == op]["tp_share"]) == {0.5, 1.0}
    assert (measured["fwd_ms"] > 0).all() and (measured["bwd_ms"] >= 0).all()


def test_structure_and_bytes_do_not_depend_on_run_order(measured):
    """Catches state leaking between measurements (inputs, parameters, RNG) into the table."""
    again = profile_table(TINY, micro_batches=(2, 1), shares=(1.0, 0.5), warmup=0, reps=1)
    key = ["op", "micro_batch", "tp_share"]
    a = measured.sort_values(key).reset_index(drop=True)
    b = again.sort_values(key).reset_index(drop=True)
    assert a[key].equals(b[key])
    assert (a["saved_bytes"] == b["saved_bytes"]).all() and (a["output_bytes"] == b["output_bytes"]).all()


def test_measured_saved_bytes_match_the_tensor_model_where_the_runtime_keeps_plain_tensors(measured):
    """LayerNorms keep input + statistics, the MLP matmuls and GELU keep their inputs: exactly the formulas."""
    sizes = tensor_sizes(TINY, 2)
    prof = Profile(measured)
    ops = {o.name: o for o in layer_operators(TINY)}
    for name in ("ln1", "ln2", "fc1", "gelu", "fc2", "out_proj"):
        share = 0.5 if ops[name].tp_split else 1.0
        expect = sum(sizes[t].bytes(share) for t in ops[name].saves)
        assert prof.cost(name, 2, share).saved_bytes == expect, name


def test_calibration_transfers_the_measured_to_derived_ratio(measured):
    derived_cpu = derive_table(TINY, "cpu", micro_batches=(1, 2), shares=(0.5, 1.0))
    target = derive_table(TINY, "t4", micro_batches=(1, 2), shares=(0.5, 1.0))
    cal = calibrate(target, measured, derived_cpu)
    for op in ("fc1", "softmax"):
        m = measured[(measured.op == op) & (measured.micro_batch == 1) & (measured.tp_share == 1.0)].fwd_ms.item()
        d = derived_cpu[(derived_cpu.op == op) & (derived_cpu.micro_batch == 1) & (derived_cpu.tp_share == 1.0)].fwd_ms.item()
        t = target[(target.op == op) & (target.micro_batch == 1) & (target.tp_share == 1.0)].fwd_ms.item()
        c = cal[(cal.op == op) & (cal.micro_batch == 1) & (cal.tp_share == 1.0)].fwd_ms.item()
        ratios = (measured[measured.op == op].set_index(["micro_batch", "tp_share"]).fwd_ms
                  / derived_cpu[derived_cpu.op == op].set_index(["micro_batch", "tp_share"]).fwd_ms)
        assert c == pytest.approx(t * ratios.median())
        assert m > 0 and d > 0


def test_link_fit_recovers_a_known_line():
    pts = [(x, 0.05 + x / 2e6) for x in (1e3, 1e4, 1e5, 1e6, 1e7)]  # 50 us, 2 GB/s
    lat, slope = fit_line(pts)
    assert lat == pytest.approx(0.05) and 1 / (slope * 1e6) == pytest.approx(2.0)


@pytest.mark.long  # two spawned processes; the fits and the cluster block are checked quick on given points around it
def test_link_measurement_over_gloo_between_two_processes(tmp_path):
    fit = measure_links(world_size=2, sizes=(4096, 262144, 4194304), reps=2, timeout_s=120, spec=TINY, micro_batches=(1, 2))
    assert fit.bandwidth_gb_per_s > 0 and fit.latency_us >= 0
    assert fit.allreduce_bandwidth_gb_per_s > 0 and fit.allreduce_latency_us >= 0
    assert len(fit.points["p2p"]) == 3
    # All-reduces at the model's activation sizes were timed inside its tensor-parallel layer.
    act = TINY.seq_len * TINY.hidden_dim * 4
    assert [p[0] for p in fit.points["allreduce_in_layer"]] == [act, 2 * act]
    assert all(p[1] > 0 for p in fit.points["allreduce_in_layer"])
    # The block is a link a cluster YAML takes, all-reduce figures included.
    (tmp_path / "c.yaml").write_text("nodes:\n  - name: n\n    gpus: [{type: cpu, count: 2}]\n" +
                                     "\n".join("    " + line for line in fit.yaml_block().splitlines()) + "\n")
    # The replicas' own spread (eq. 19) was measured too; it goes at the file's top level.
    # How large it is depends on how busy the host is (a cv over eq. 19's limit is written at the limit).
    assert fit.replica_time_cv is not None and fit.replica_time_cv >= 0.0
    cv_line = next(line for line in fit.yaml_block().splitlines() if line.startswith("# replica_time_cv: "))
    text = (tmp_path / "c.yaml").read_text()
    (tmp_path / "c.yaml").write_text(cv_line.removeprefix("# ") + "\n" + text)
    assert load_cluster(tmp_path / "c.yaml").replica_time_cv == pytest.approx(min(fit.replica_time_cv, 0.5), abs=1e-4)
    link = load_cluster(tmp_path / "c.yaml").link("n:0", "n:1")
    assert link.allreduce_bandwidth_gb_per_s == pytest.approx(fit.allreduce_bandwidth_gb_per_s, rel=1e-2)
    assert link.tp_allreduce_bandwidth_gb_per_s == pytest.approx(fit.tp_allreduce_bandwidth_gb_per_s, rel=1e-2)
    assert link.bandwidth_gb_per_s == pytest.approx(fit.bandwidth_gb_per_s, rel=1e-2)


def test_link_fit_keeps_in_layer_all_reduces_apart():
    """Gradient all-reduces (idle ranks) and tensor-parallel ones (inside the layer) get their own ring fit."""
    idle = [(x, 0.2 + x / 1e6) for x in (4096.0, 65536.0, 1048576.0, 16777216.0)]  # 2 x 100 us steps, 1 GB/s
    inside = [(x, 2.0 + x / 2.5e5) for x in (131072.0, 262144.0, 524288.0)]      # 2 x 1 ms steps, 0.25 GB/s
    fit = link_fit("gloo", 2, {"p2p": idle, "allreduce": idle, "allreduce_in_layer": inside})
    assert fit.allreduce_latency_us == pytest.approx(100.0) and fit.allreduce_bandwidth_gb_per_s == pytest.approx(1.0)
    assert fit.tp_allreduce_latency_us == pytest.approx(1000.0) and fit.tp_allreduce_bandwidth_gb_per_s == pytest.approx(0.25)
    link = Link(**{k: v for k, v in fit.link_fields().items()})
    assert tp_allreduce_ms(262144.0, 2, link) == pytest.approx(2.0 + 262144.0 / 2.5e5, rel=1e-3)
    assert allreduce_ms(16777216.0, 2, link) == pytest.approx(0.2 + 16777216.0 / 1e6, rel=1e-3)
    plain = link_fit("gloo", 2, {"p2p": idle, "allreduce": idle})
    assert plain.tp_allreduce_bandwidth_gb_per_s is None and "tp_allreduce" not in plain.yaml_block()


def test_a_noisier_host_than_eq19_holds_is_written_at_the_limit(tmp_path):
    """A busy host can measure a replica-time cv beyond what a cluster file takes: the block still loads."""
    idle = [(x, 0.2 + x / 1e6) for x in (4096.0, 65536.0, 1048576.0)]
    for cv, written in ((0.31, 0.31), (0.93, MAX_REPLICA_TIME_CV)):
        block = link_fit("gloo", 2, {"p2p": idle, "allreduce": idle}, replica_time_cv=cv).yaml_block()
        line = next(x for x in block.splitlines() if x.startswith("# replica_time_cv: "))
        assert ("measured 0.9300" in block) == (cv > MAX_REPLICA_TIME_CV)
        (tmp_path / "c.yaml").write_text(line.removeprefix("# ") + "\nnodes:\n  - name: n\n    gpus: [{type: cpu, count: 2}]\n"
                                         + "\n".join("    " + x for x in block.splitlines()) + "\n")
        assert load_cluster(tmp_path / "c.yaml").replica_time_cv == pytest.approx(written)


def test_measured_table_times_the_optimizer_step_for_eq10(measured):
    """One AdamW step over every layer's weights; eq. 10 scales it to what a device holds."""
    sample = Profile(measured).optimizer_sample()
    layer_bytes = sum(operator_param_count(TINY, o) for o in layer_operators(TINY)) * TINY.dtype_bytes
    assert sample is not None and sample[0] == TINY.num_layers * layer_bytes and sample[1] > 0
    assert optimizer_step_ms(3 * sample[0], TINY, 1.0, sample) == pytest.approx(3 * sample[1])
    # A table without the row (derived) keeps the bandwidth rule: 36 bytes per fp32 parameter at 1 GB/s.
    assert Profile(derive_table(TINY, "t4", micro_batches=(1,))).optimizer_sample() is None
    assert optimizer_step_ms(4e6, TINY, 1.0) == pytest.approx(36.0)


@pytest.mark.long  # two profiler processes; the table's structure and bytes are checked quick in one (tests around it)
def test_concurrent_profilers_measure_the_same_structure(measured):
    both = profile_table(TINY, micro_batches=(1, 2), shares=(0.5, 1.0), warmup=0, reps=1, concurrent=2)
    key = ["op", "micro_batch", "tp_share"]
    a = measured.sort_values(key).reset_index(drop=True)
    b = both.sort_values(key).reset_index(drop=True)
    assert a[key].equals(b[key]) and (a["saved_bytes"] == b["saved_bytes"]).all()
    assert (b["fwd_ms"] > 0).all()


def test_median_of_tables_takes_each_time_from_the_middle_measurement(measured):
    tables = []
    for k in (1.0, 3.0, 2.0):
        t = measured.copy()
        t["fwd_ms"] = measured["fwd_ms"] * k
        t["bwd_ms"] = measured["bwd_ms"] * (4 - k)
        tables.append(t)
    med = median_of_tables(tables).set_index(["op", "micro_batch", "tp_share"])
    ref = measured.set_index(["op", "micro_batch", "tp_share"])
    assert (med["fwd_ms"] - 2 * ref["fwd_ms"]).abs().max() < 1e-9
    assert (med["bwd_ms"] - 2 * ref["bwd_ms"]).abs().max() < 1e-9
    assert (med["saved_bytes"] == ref["saved_bytes"]).all()


@pytest.mark.parametrize("timing", [[], ["--back-to-back"]])
def test_profile_command_measures_on_cpu(tmp_path, timing, monkeypatch):
    asked = []
    real = op_profiler.measure
    monkeypatch.setattr(op_profiler, "measure", lambda *a, **k: asked.append(k.get("back_to_back", False)) or real(*a, **k))
    out = tmp_path / "cpu.csv"
    code, stdout, err = run_cli("profile", "--device", "cpu", "--model", "tiny", "--micro-batch", "1", "--reps", "1",
                                "--warmup", "0", "--threads", "1", "--out", out, *timing)
    assert code == 0, err
    assert set(validate_table(pd.read_csv(out), source="x")["source"]) == {"measured"}
    assert any(asked) == bool(timing)


@pytest.mark.parametrize("args,words", [
    (["--device", "tpu"], "unknown device"),
    (["--device", "cpu", "--tp-shares", "0.3"], "not a whole number of heads"),
    (["--device", "cpu", "--tp-shares", "half"], "comma-separated numbers"),
    (["--device", "cuda"], "CUDA is not available"),
])
def test_profile_command_bad_input(args, words):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli("profile", "--model", "tiny", *args)
    assert code == 2 and words in err and "Traceback" not in err


def test_plain_cuda_profiles_the_current_gpu(monkeypatch):
    """``--device cuda`` (no number) profiles the current GPU. ``torch.cuda.set_device`` refuses a device
    without an index, which stopped the first run of bench/bench_gpu.py on a lent H200; CUDA's calls are
    stood in for here, so no GPU is needed."""
    told = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: told.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some GPU")
    monkeypatch.setattr(op_profiler, "_table", lambda spec, dev, name, *rest: told.append(("table", dev, name)) or "table")
    assert profile_table(PRESETS["tiny"], device="cuda") == "table"
    assert told == [("set_device", torch.device("cuda", 3)), ("table", torch.device("cuda", 3), "some-gpu")]


def test_freed_host_memory_is_reused_without_page_faults():
    """A training step frees its activations and allocates them again in the next one. With glibc's
    defaults the freed top of the heap goes back to the kernel and every page faults in again next
    time (this loop: all 16,384 pages, every cycle); catches the allocator settings the runtime and the
    profiler share (runtime.launch.host_memory) being lost or rejected."""
    if not keep_freed_memory():
        pytest.skip("the C library is not glibc: nothing to set")
    assert keep_freed_memory()  # idempotent
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    block, count = 4 << 20, 16  # blocks the size of a layer's activations, 64 MiB in all, freed together

    def step():
        blocks = [libc.malloc(block) for _ in range(count)]
        for b in blocks:
            ctypes.memset(b, 1, block)
        for b in blocks:
            libc.free(b)

    step()
    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(4):
        step()
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 0.01 * 4 * count * block // 4096


def test_profiler_keeps_freed_host_memory_as_training_does(monkeypatch):
    """The table is measured in the allocator state the engine trains in (runtime.launch.host_memory)."""
    calls = []
    monkeypatch.setattr(op_profiler, "keep_freed_memory", lambda: calls.append(1) or True)
    profile_table(TINY, micro_batches=(1,), shares=(1.0,), warmup=0, reps=1)
    assert calls


def test_layer_in_context_is_timed_as_a_training_step_runs_it(monkeypatch):
    """``as_trained`` runs the forward under the engine's saved-activation meter and the backward into
    gradients that already exist (the engine's gradient buffer), so their cost is in the layer's time;
    without it each backward writes fresh gradients and no meter runs. Catches the whole-layer timing
    drifting from what training does, which no operator row would show."""
    records = []

    class CountingMeter(op_profiler.SavedBytes):
        def record(self, mb):
            records.append(mb)
            return super().record(mb)

    monkeypatch.setattr(op_profiler, "SavedBytes", CountingMeter)
    w = torch.nn.Parameter(torch.randn(4, 4))
    grads_seen = []

    def fn(xs):
        grads_seen.append(w.grad)
        return (xs[0] @ w).tanh()

    inputs = lambda: [torch.randn(3, 4, requires_grad=True)]  # noqa: E731
    for as_trained in (False, True):
        records.clear()
        grads_seen.clear()
        m = measure(fn, inputs, [w], torch.device("cpu"), warmup=1, reps=3, as_trained=as_trained)
        assert m.fwd_ms > 0 and m.bwd_ms > 0 and w.grad is None
        timed = grads_seen[1:]  # the first call only counts saved bytes
        if as_trained:
            assert len(records) == 2 * 4  # every forward of every repetition, timed or not
            assert all(g is timed[0] for g in timed)  # one gradient tensor, accumulated into
        else:
            assert not records
            assert any(g is not timed[1] for g in timed[2:])  # a fresh gradient after every backward


def test_back_to_back_times_pieces_of_repetitions_without_a_sync_between(monkeypatch):
    """With ``back_to_back`` the repetitions after warm-up run in timed pieces (forwards one after another,
    then as many backwards): at most ``reps_at_once``, and at least three pieces; a repetition's time is its
    piece's over its count. Within a piece each repetition keeps its own meter key (as micro-batches in
    flight do) and the meter ends empty; the gradients are fresh or accumulated as in single repetitions.
    A stand-in clock that charges 1 ms per forward and 2 per backward makes the arithmetic exact."""
    clock = {"ms": 0.0, "timed": []}

    class Clock:
        def __init__(self, device):
            pass

        def __call__(self, fn):
            start = clock["ms"]
            fn()
            clock["timed"].append(clock["ms"] - start)
            return clock["ms"] - start

        def both(self, fn):  # device and host, one reading as on a CPU
            t = self(fn)
            return t, t

    meters, keys = [], []

    class KeptMeter(op_profiler.SavedBytes):
        def __init__(self, params):
            super().__init__(params)
            meters.append(self)

        def record(self, mb):
            keys.append(mb)
            return super().record(mb)

    monkeypatch.setattr(op_profiler, "_Timer", Clock)
    monkeypatch.setattr(op_profiler, "SavedBytes", KeptMeter)
    w = torch.nn.Parameter(torch.randn(4, 4))
    grads_seen = []

    class Charged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock["ms"] += 1.0
            ctx.save_for_backward(x)
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            clock["ms"] += 2.0
            grads_seen.append(w.grad)
            return g * 2.0

    fn = lambda xs: Charged.apply(xs[0] @ w)  # noqa: E731
    inputs = lambda: [torch.randn(3, 4, requires_grad=True)]  # noqa: E731
    for at_once, pieces in ((4, [2, 2, 2]), (1, [1] * 6)):
        monkeypatch.setattr(op_profiler, "reps_at_once", lambda device, per_rep_bytes, reps, n=at_once: n)
        for as_trained in (False, True):
            clock["timed"].clear()
            keys.clear()
            grads_seen.clear()
            m = measure(fn, inputs, [w], torch.device("cpu"), warmup=1, reps=6, as_trained=as_trained, back_to_back=True)
            # warm-up: one forward and one backward timed alone; then the pieces, forwards then backwards
            assert clock["timed"] == [1.0, 2.0] + [t * n for n in pieces for t in (1.0, 2.0)]
            assert (m.fwd_ms, m.bwd_ms) == (1.0, 2.0) and w.grad is None
            if as_trained:  # untimed graph forward and warm-up first, then per piece: timed forwards, graph forwards
                assert keys[2:] == [k for n in pieces for k in list(range(n)) * 2]
                assert all(g is grads_seen[0] for g in grads_seen)  # one gradient tensor, accumulated into
            else:
                assert not keys and all(g is None for g in grads_seen)  # each backward writes a fresh gradient
            single = measure(fn, inputs, [w], torch.device("cpu"), warmup=1, reps=6, as_trained=as_trained)
            assert (m.saved_bytes, m.output_bytes) == (single.saved_bytes, single.output_bytes)
    assert meters and all(not meter.live for meter in meters)  # every repetition's saved tensors released


def test_back_to_back_keeps_a_bounded_number_of_graphs():
    """A piece holds its graphs until its backwards run: at most a quarter of a GPU's free memory (a fixed
    budget on a CPU), never fewer than one repetition, never more than asked."""
    cpu = torch.device("cpu")
    assert op_profiler.reps_at_once(cpu, 1 << 20, 10) == 10
    assert op_profiler.reps_at_once(cpu, op_profiler.BACK_TO_BACK_CPU_BYTES // 3, 10) == 3
    assert op_profiler.reps_at_once(cpu, 4 * op_profiler.BACK_TO_BACK_CPU_BYTES, 10) == 1


def test_back_to_back_table_has_the_same_structure_and_bytes(measured):
    """A table timed back to back differs from the default in times only."""
    torch.set_num_threads(1)
    b2b = profile_table(TINY, micro_batches=(1, 2), shares=(0.5, 1.0), warmup=1, reps=2, back_to_back=True)
    key = ["op", "micro_batch", "tp_share"]
    a, b = measured.set_index(key).sort_index(), b2b.set_index(key).sort_index()
    assert a.index.equals(b.index)
    for col in ("saved_bytes", "output_bytes", "param_bytes"):
        assert (a[col] == b[col]).all(), col
    assert (b["fwd_ms"] > 0).all() and (b["bwd_ms"] >= 0).all()
