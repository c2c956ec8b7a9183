"""``baton show FILE`` tells a cluster, a model and a plan apart by their fields, and a misspelt field is
reported against the fields of the file's own kind, with the nearest of them.

Catches: a cluster file with ``node:`` for ``nodes:`` answered with the model file's list of fields (the old
test looked for the word 'nodes'); a typo anywhere in a file reported without what it was likely meant to be.
"""
from __future__ import annotations

import json

import pytest

from baton.errors import BatonError
from baton.file_kinds import kind_of
from baton.model_spec import from_mapping as model_from_mapping
from tests.conftest import ROOT, run_cli

CLUSTER_TEXT = """name: c
node:
  - name: n
    gpus: [{type: t4, count: 2}]
    intra_node_link: {bandwidth_gb_per_s: 10}
"""


@pytest.mark.parametrize("data, kind", [
    ({"name": "c", "nodes": []}, "cluster"),
    ({"name": "c", "node": []}, "cluster"),                                   # misspelt, still a cluster's
    ({"inter_node_link": {}, "nods": []}, "cluster"),
    ({"base": "tiny", "num_layers": 2}, "model"),
    ({"name": "m", "num_layer": 2, "hidden_dim": 64}, "model"),
    ({"format": "baton-plan/2", "pipelines": [], "model": {}}, "plan"),
    ({"name": "x"}, None),                                                    # a name alone: no kind says more
    ({"nodes": [], "num_layers": 2}, None),                                   # as much of two kinds
    ([1, 2], None),
    (None, None),
])
def test_kind_of_reads_the_fields(data, kind):
    assert kind_of(data) == kind


def test_a_cluster_file_with_a_typo_is_reported_as_a_cluster_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER_TEXT)
    code, out, err = run_cli("show", path)
    assert code == 2 and "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {path}: field 'node': unknown field (a cluster file has: ")
    assert "nodes" in lines[0] and "did you mean 'nodes'?" in lines[0] and "num_layers" not in lines[0], lines[0]


def test_typos_deeper_in_a_cluster_name_their_own_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER_TEXT.replace("node:", "nodes:").replace("type: t4", "typ: t4"))
    code, _, err = run_cli("show", path)
    assert code == 2 and "field 'nodes[0].gpus[0].typ': unknown field (a GPU entry has: " in err and "did you mean 'type'?" in err


def test_a_model_file_with_a_typo_is_reported_as_a_model_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("base: tiny\nnum_layer: 3\n")
    code, _, err = run_cli("show", path)
    assert code == 2 and f"{path}: field 'num_layer': unknown field (a model file has: " in err and "did you mean 'num_layers'?" in err
    with pytest.raises(BatonError, match=r"unknown field \(a model file has: [^;]*\)$"):
        model_from_mapping({"base": "tiny", "zzz": 1}, source="m.yaml")  # nothing near: no guess


def test_a_plan_written_as_yaml_is_one_line(tmp_path):
    import yaml

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(json.loads((ROOT / "examples" / "a100x2_t4x2_gpt3-1.3b_hand.json").read_text())))
    code, _, err = run_cli("show", path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{path}: this is a plan" in err and "JSON" in err


def test_good_files_still_show(tmp_path):
    assert "t4:1" in run_cli("show", ROOT / "clusters" / "a100x2_t4x2.yaml")[1]
    model = tmp_path / "m.yaml"
    model.write_text("base: tiny\nname: mine\n")
    code, out, err = run_cli("show", model)
    assert code == 0 and json.loads(out)["name"] == "mine", err
    code, out, _ = run_cli("show", "tiny")
    assert code == 0 and json.loads(out)["name"] == "tiny"
