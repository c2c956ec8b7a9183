"""The generator of scale clusters (bench/scale_clusters.py): every mix at every size is a cluster file the loader
reads, with the GPU count and types asked for, the same file for the same seed, and some mixes held out. Cheap: no
solve."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from baton.cluster import from_mapping, load_cluster
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import scale_clusters  # noqa: E402
from scale_clusters import MIXES, NODE_KINDS, cluster_mapping, cluster_yaml, type_counts, write_cluster  # noqa: E402

SIZES = (64, 128, 256, 512, 1024)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_mix_and_size_loads_with_the_count_and_types_asked_for(mix):
    m = MIXES[mix]
    assert 2 <= len(m.gpu_types) <= 4 and abs(sum(s for _, s in m.shares) - 1) < 1e-12
    for gpus in SIZES:
        for seed in (0, 1):
            cl = from_mapping(yaml.safe_load(cluster_yaml(gpus, mix, seed)), source=f"{mix}-{gpus}")
            assert len(cl.devices) == gpus
            assert sorted(cl.gpu_types) == sorted(m.gpu_types)
            for d in cl.devices:  # nodes as the kind says: its GPU count, its usable memory
                kind = NODE_KINDS[d.gpu.name]
                assert sum(1 for e in cl.devices if e.node == d.node) == kind.gpus_per_node
                if kind.memory_gib is not None:
                    assert d.memory_bytes == int(kind.memory_gib * 1024**3)
            # every kind talks through its own NIC: a cross-kind collective runs at the slower one
            assert set(cl.nics) == {d.node for d in cl.devices}


def test_shares_follow_the_mix_within_the_jitter_and_a_block():
    for m in MIXES.values():
        for gpus in SIZES:
            for seed in range(5):
                counts = type_counts(gpus, m, seed)
                assert sum(counts.values()) == gpus and all(n % 8 == 0 and n >= 8 for n in counts.values())
                for g, share in m.shares:
                    lo, hi = share * 0.9 / 1.1, share * 1.1 / 0.9  # the jitter moves a share and the total
                    assert gpus * lo - 8 <= counts[g] <= gpus * hi + 8, (m.name, gpus, seed, counts)


def test_the_seed_decides_the_file():
    """The same seed gives the same text in another process (no hash randomisation); other seeds give other
    clusters (shares or node order)."""
    code = "import sys; sys.path.insert(0, 'bench'); import scale_clusters as s; print(s.cluster_yaml(256, 'h100-a100-l4', 3))"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert other == cluster_yaml(256, "h100-a100-l4", 3) + "\n"
    texts = {cluster_yaml(256, "h100-a100-l4", s) for s in range(6)}
    assert len(texts) == 6


def test_some_mixes_are_held_out_and_every_size_of_the_bench_has_both():
    held = {m.name for m in MIXES.values() if m.held_out}
    assert held and held != set(MIXES)
    import bench_solver_scale
    for gpus in {g for g, _ in bench_solver_scale.CASES}:
        kinds = {MIXES[m].held_out for g, m in bench_solver_scale.CASES if g == gpus}
        assert kinds == {True, False}, gpus


def test_bad_sizes_are_refused():
    for gpus in (32, 1032, 100):
        with pytest.raises(ValueError):
            cluster_mapping(gpus, "a100-v100")


def test_cli_writes_the_file_atomically(tmp_path):
    out = tmp_path / "deep" / "c.yaml"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_clusters.py"), "--gpus", "128", "--mix", "a100-v100-t4",
                          "--seed", "2", "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert len(load_cluster(out).devices) == 128
    assert [p.name for p in out.parent.iterdir()] == ["c.yaml"]  # no temporary file left beside it
    assert out.read_text() == cluster_yaml(128, "a100-v100-t4", 2)
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_clusters.py"), "--gpus", "100", "--mix", "a100-v100"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "multiple of 8" in bad.stderr
    listed = subprocess.run([sys.executable, str(ROOT / "bench" / "scale_clusters.py"), "--list"], capture_output=True,
                            text=True, check=True).stdout
    assert all(name in listed for name in MIXES) and "held out" in listed


def test_write_cluster_returns_a_loadable_path(tmp_path):
    path = write_cluster(tmp_path / "x.yaml", 64, "h200-a800-a10g-t4")
    assert load_cluster(path).name == "scale_64_h200-a800-a10g-t4_s0"
    assert scale_clusters.MIN_GPUS == 64 and scale_clusters.MAX_GPUS == 1024
