"""Lineage records: format, write-once storage on every backend, chains across runs, text and JSON views."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from relax import objstore
from relax.transfer.lineage import (
    LineageError,
    LineageRecord,
    ParentRef,
    chain,
    chain_to_json,
    chain_to_text,
    code_version,
    list_records,
    list_runs,
    read_record,
    record_url,
    write_record,
)

DS_A = "ds-fa203299c7a5dea9"
DS_B = "ds-0b1c2d3e4f5a6b7c"


def rec(run: str, step: int, parent: tuple[str, int] | None = None, ds: str = DS_A,
        samples: dict[int, int] | None = None) -> LineageRecord:
    """A record of ``run`` at ``step``; ``parent`` is (run, step) of the checkpoint it resumed from."""
    return LineageRecord(
        run_id=run, checkpoint=f"step-{step:06d}", step=step,
        parent=None if parent is None else ParentRef(parent[0], f"step-{parent[1]:06d}"),
        dataset_snapshot=ds, config_hash="9f86d081884c7d65", code_version="0.1.0+gabcdef012345",
        manifest_versions={"rollouts": step * 2}, samples_by_policy_version=samples or {step: 8},
        created_at=1714560000.0 + step, extra={"note": "test"})


def two_runs(root: str) -> None:
    """run-a: 10 <- 20; run-b (retraining from run-a's last checkpoint, new dataset): a/20 <- b/5 <- b/10."""
    write_record(root, rec("run-a", 10))
    write_record(root, rec("run-a", 20, parent=("run-a", 10)))
    write_record(root, rec("run-b", 5, parent=("run-a", 20), ds=DS_B))
    write_record(root, rec("run-b", 10, parent=("run-b", 5), ds=DS_B, samples={3: 4, 4: 12}))


def test_round_trip_on_every_backend(any_url):
    later, earlier = rec("run-a", 20, parent=("run-a", 10)), rec("run-a", 10)
    url = write_record(any_url, later)  # written out of step order on purpose
    write_record(any_url, earlier)
    assert url == objstore.join(objstore.absolute_url(any_url), "runs/run-a/lineage/step-000020.json")
    assert read_record(any_url, "run-a", "step-000020") == later
    assert [r.step for r in list_records(any_url, "run-a")] == [10, 20]
    assert list_runs(any_url) == ["run-a"]
    stored = json.loads(objstore.read_bytes(url))
    # JSON object keys are strings: policy version 20 is stored as "20".
    assert stored["samples_by_policy_version"] == {"20": 8}
    assert stored["parent"] == {"run_id": "run-a", "checkpoint": "step-000010"}


def test_json_round_trip_keeps_int_policy_keys():
    r = rec("run-a", 7, samples={0: 3, 1: 5, 4: 8})
    back = LineageRecord.from_json(r.to_json())
    assert back == r and back.samples_by_policy_version == {0: 3, 1: 5, 4: 8}


def test_sample_count_and_policy_range():
    r = rec("run-a", 7, samples={0: 3, 1: 5, 4: 8})
    assert r.sample_count == 16  # 3 + 5 + 8
    assert r.policy_range == (0, 4)
    empty = rec("run-a", 7, samples={2: 0})
    assert empty.sample_count == 0 and empty.policy_range is None


@pytest.mark.parametrize("change, message", [
    ({"step": -1}, "'step' must be a non-negative integer"),
    ({"step": True}, "'step' must be a non-negative integer"),
    ({"run_id": "a/b"}, "'run_id' must be a name"),
    ({"checkpoint": ""}, "'checkpoint' must be a name"),
    ({"dataset_snapshot": " "}, "'dataset_snapshot' must be a non-empty string"),
    ({"samples_by_policy_version": {"x": 1}}, "key 'x' must be a policy version"),
    ({"samples_by_policy_version": {"1": -3}}, "must be a non-negative integer"),
    ({"manifest_versions": {"rollouts": 1.5}}, "must be a non-negative integer"),
    ({"created_at": "yesterday"}, "'created_at' must be a unix time"),
    ({"parent": {"run_id": "run-a"}}, "'parent' must be null or"),
    ({"parent": {"run_id": "run-a", "checkpoint": "step-000007"}}, "names itself as its parent"),
    ({"stpe": 3}, "unknown field(s) 'stpe'"),
    ({"format_version": 99}, "format_version 99 is not supported"),
])
def test_from_json_rejects_bad_records_naming_the_source(change, message):
    data = {**json.loads(rec("run-a", 7).to_json()), **change}
    with pytest.raises(LineageError) as err:
        LineageRecord.from_json(json.dumps(data), source="s3://b/x.json")
    assert str(err.value).startswith("s3://b/x.json: ") and message in str(err.value)


def test_from_json_rejects_missing_fields_and_non_json():
    data = json.loads(rec("run-a", 7).to_json())
    del data["config_hash"]
    with pytest.raises(LineageError, match="missing field\\(s\\) 'config_hash'"):
        LineageRecord.from_json(json.dumps(data))
    with pytest.raises(LineageError, match="where.json: not valid JSON"):
        LineageRecord.from_json("{oops", source="where.json")


def test_unserialisable_extra_is_a_lineage_error():
    r = rec("run-a", 7)
    r.extra = {"when": object()}
    with pytest.raises(LineageError, match="'extra' is not JSON-serialisable"):
        r.to_json()


def test_rewrite_identical_is_noop_and_different_is_refused(any_url):
    original = rec("run-a", 10)
    url = write_record(any_url, original)
    before = objstore.read_bytes(url)
    assert write_record(any_url, rec("run-a", 10)) == url  # equal content: accepted, nothing changes
    changed = rec("run-a", 10, samples={10: 9})
    with pytest.raises(LineageError, match="a different lineage record for run-a/step-000010 already exists"):
        write_record(any_url, changed)
    assert objstore.read_bytes(url) == before


def test_chain_across_two_runs(tmp_path):
    root = str(tmp_path)
    two_runs(root)
    assert [r.key for r in chain(root, "run-b")] == [
        "run-b/step-000010", "run-b/step-000005", "run-a/step-000020", "run-a/step-000010"]
    assert [r.key for r in chain(root, "run-b", "step-000005")] == [
        "run-b/step-000005", "run-a/step-000020", "run-a/step-000010"]
    assert [r.key for r in chain(root, "run-a")] == ["run-a/step-000020", "run-a/step-000010"]
    assert list_runs(root) == ["run-a", "run-b"]


def test_cycle_is_reported(tmp_path):
    root = str(tmp_path)
    write_record(root, rec("run-x", 1, parent=("run-x", 2)))
    write_record(root, rec("run-x", 2, parent=("run-x", 1)))
    with pytest.raises(LineageError, match=re.escape(
            "lineage cycle: run-x/step-000002 -> run-x/step-000001 -> run-x/step-000002")):
        chain(root, "run-x")


def test_missing_parent_names_its_url(any_url):
    write_record(any_url, rec("run-b", 5, parent=("run-a", 20)))
    missing = record_url(any_url, "run-a", "step-000020")
    with pytest.raises(LineageError) as err:
        chain(any_url, "run-b")
    assert "run-b/step-000005 names parent run-a/step-000020" in str(err.value)
    assert f"{missing} does not exist" in str(err.value)


def test_missing_run_or_checkpoint(tmp_path):
    root = str(tmp_path)
    write_record(root, rec("run-a", 10))
    with pytest.raises(LineageError, match="run 'run-z' has no lineage records"):
        chain(root, "run-z")
    with pytest.raises(LineageError, match="no lineage record for run-a/step-000099"):
        chain(root, "run-a", "step-000099")
    assert list_runs(str(tmp_path / "elsewhere")) == []


def test_record_in_the_wrong_place_is_caught(tmp_path):
    root = str(tmp_path)
    src = write_record(root, rec("run-a", 10))
    objstore.write_bytes(record_url(root, "run-a", "step-000011"), objstore.read_bytes(src))
    with pytest.raises(LineageError, match="holds the record of run-a/step-000010, not run-a/step-000011"):
        list_records(root, "run-a")


def test_chain_to_json_nodes_and_edges(tmp_path):
    two_runs(str(tmp_path))
    graph = chain_to_json(chain(str(tmp_path), "run-b"))
    kinds = [n["kind"] for n in graph["nodes"]]
    # 2 datasets (DS_A for run-a, DS_B for run-b) + 4 checkpoints.
    assert kinds == ["dataset", "dataset", "checkpoint", "checkpoint", "checkpoint", "checkpoint"]
    assert graph["head"] == "run-b/step-000010"
    edges = {(e["kind"], e["from"], e["to"]) for e in graph["edges"]}
    # 4 trained_on (one per checkpoint) + 3 parent (every checkpoint but the first).
    assert len(graph["edges"]) == 7
    assert ("parent", "checkpoint:run-b/step-000005", "checkpoint:run-a/step-000020") in edges
    assert ("trained_on", "checkpoint:run-b/step-000010", f"dataset:{DS_B}") in edges
    head = next(n for n in graph["nodes"] if n["id"] == "checkpoint:run-b/step-000010")
    assert head["sample_count"] == 16  # 4 + 12


def test_chain_to_text(tmp_path):
    two_runs(str(tmp_path))
    text = chain_to_text(chain(str(tmp_path), "run-b"))
    lines = text.splitlines()
    assert lines[0] == ("lineage of run-b/step-000010: 4 checkpoints, 2 runs, 2 dataset snapshots "
                        "(newest first)")
    head = lines[1].split()
    # samples {3: 4, 4: 12}: 16 samples from policy versions 3 to 4.
    assert head == ["run-b/step-000010", "step", "10", "samples", "16", "policy", "v3-v4", "dataset", DS_B,
                    "config", "9f86d081884c", "code", "0.1.0+gabcdef012345"]
    assert lines[2] == "  v parent"
    assert lines.count("  v parent (from earlier run run-a)") == 1
    assert lines[-1] == "  (first checkpoint: no parent)"
    assert sum(line.startswith("run-") for line in lines) == 4


def test_a_chain_ends_at_the_format_warm_start_it_began_from(tmp_path):
    root = f"file://{tmp_path}"
    warm = LineageRecord(run_id="warm-start", checkpoint="0123abcd", step=3, parent=None, dataset_snapshot=DS_A,
                         config_hash="0123abcd", code_version="0.1.0", created_at=1714560000.0,
                         extra={"kind": "format_warm_start"})
    write_record(root, warm)
    # shared by every run that starts from it, so it lives beside the warm start, not under runs/
    assert record_url(root, "warm-start", "0123abcd") == f"{root}/warm_start/0123abcd/lineage.json"
    first = rec("run-a", 0)
    write_record(root, LineageRecord(**{**first.__dict__, "parent": ParentRef("warm-start", "0123abcd")}))
    write_record(root, rec("run-a", 1, parent=("run-a", 0)))
    records = chain(root, "run-a")
    assert [r.key for r in records] == ["run-a/step-000001", "run-a/step-000000", "warm-start/0123abcd"]
    lines = chain_to_text(records).splitlines()
    assert lines[-3] == "  v parent (from the format warm start)"
    assert lines[-2].startswith("warm-start/0123abcd  step 3 ")
    assert lines[-1] == "  (format warm start of the base model)"
    assert list_runs(root) == ["run-a"]  # a warm start is no run: latest_checkpoint never picks it


def test_code_version_format():
    version = code_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+(\+g[0-9a-f]{12}(-dirty)?)?", version), version
    repo = Path(__file__).resolve().parents[3]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode == 0:  # the tests run from a git checkout: the commit must be the checkout's
        assert "+g" + head.stdout.strip()[:12] in version


def test_code_version_without_git_is_just_the_version(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert re.fullmatch(r"\d+\.\d+\.\d+", code_version())
