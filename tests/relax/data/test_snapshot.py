"""Dataset snapshots: determinism, change detection, media handling, nothing half-written."""

from __future__ import annotations

import json

import pytest

from relax import objstore
from relax.config import ConfigError, DataConfig
from relax.data.errors import DataError
from relax.data.readers import write_jsonl
from relax.data.samples import MediaRef, Message, Sample
from relax.data.snapshot import Snapshot, list_snapshots, plan_snapshot, write_snapshot
from relax.data.sources import held_out, snapshot_from_config
from tests.media_files import png_bytes, wav_bytes

PNG = png_bytes(2, 1, (255, 0, 0))
WAV = wav_bytes(0.01, tone=False)


def make_dataset(folder, png=PNG, answer="red"):
    """A jsonl file plus one image file on disk and one inline audio clip."""
    objstore.write_bytes(objstore.join(folder, "img", "a.png"), png)
    rows = [
        Sample(id="t1", messages=(Message("user", "1+2?"),), answer="3", task="arithmetic"),
        Sample(id="i1", messages=(Message("user", "<image> colour?"),), answer=answer, task="shapes",
               images=(MediaRef(path="img/a.png"),)),
        Sample(id="a1", messages=(Message("user", "<audio> beeps?"),), answer="2", task="tones",
               audios=(MediaRef(data=WAV),)),
        Sample(id="i2", messages=(Message("user", "<image> again?"),), answer="red", task="shapes",
               images=(MediaRef(path="img/a.png"),)),
    ]
    write_jsonl(objstore.join(folder, "train.jsonl"), rows)
    held = [Sample(id="e1", messages=(Message("user", "2+2?"),), answer="4", task="arithmetic")]
    write_jsonl(objstore.join(folder, "eval.jsonl"), held)
    return DataConfig(train_url=objstore.join(folder, "train.jsonl"), eval_url=objstore.join(folder, "eval.jsonl"))


def test_same_input_same_id_and_reuse(any_url):
    data = make_dataset(objstore.join(any_url, "src"))
    root = objstore.join(any_url, "root")
    first = snapshot_from_config(data, root)
    again = snapshot_from_config(data, root)
    assert first.created and not again.created
    assert first.id == again.id and first.id.startswith("ds-")
    assert first.rows == {"train": 4, "eval": 1}
    assert first.media_files == 2  # the same image twice is stored once
    assert first.media_bytes == len(PNG) + len(WAV)
    assert list_snapshots(root) == [first.id]


def test_id_independent_of_location(tmp_path):
    a = snapshot_from_config(make_dataset(str(tmp_path / "a")), str(tmp_path / "r1"))
    b = snapshot_from_config(make_dataset(str(tmp_path / "b")), str(tmp_path / "r2"))
    assert a.id == b.id


def test_any_change_gives_a_new_id(tmp_path):
    base = snapshot_from_config(make_dataset(str(tmp_path / "a")), str(tmp_path / "r")).id
    one_byte = png_bytes(2, 1, colour=(254, 0, 0))  # one channel of the pixels differs by one
    assert snapshot_from_config(make_dataset(str(tmp_path / "b"), png=one_byte), str(tmp_path / "r")).id != base
    assert snapshot_from_config(make_dataset(str(tmp_path / "c"), answer="blue"), str(tmp_path / "r")).id != base
    assert len(list_snapshots(str(tmp_path / "r"))) == 3


def test_read_back_with_checked_media(any_url):
    info = snapshot_from_config(make_dataset(objstore.join(any_url, "src")), objstore.join(any_url, "root"))
    snap = Snapshot(info.url)
    rows = {s.id: s for s in snap.samples("train")}
    assert set(rows) == {"t1", "i1", "a1", "i2"}
    assert snap.load_media(rows["i1"].images[0]) == PNG
    assert snap.load_media(rows["a1"].audios[0]) == WAV
    assert rows["i1"].images[0].path.endswith(".png") and rows["a1"].audios[0].path.endswith(".wav")
    assert snap.manifest["tasks"]["train"] == {"arithmetic": 1, "shapes": 2, "tones": 1}
    assert snap.manifest["modalities"]["train"] == {"audio": 1, "image": 2, "text": 1}
    assert snap.manifest["source"]["kind"] == "files"


def test_corruption_is_reported(tmp_path):
    info = snapshot_from_config(make_dataset(str(tmp_path / "src")), str(tmp_path / "root"))
    snap = Snapshot(info.url)
    ref = next(s for s in snap.samples("train") if s.id == "i1").images[0]
    objstore.write_bytes(ref.path, b"tampered")
    with pytest.raises(DataError, match="fails its checksum"):
        snap.load_media(ref)
    objstore.write_bytes(objstore.join(info.url, "rows", "eval.jsonl"), b"{}\n")
    with pytest.raises(DataError, match="rows/eval.jsonl fails its checksum"):
        list(snap.samples("eval"))


def test_missing_media_names_row_and_path_and_writes_nothing(tmp_path):
    data = make_dataset(str(tmp_path / "src"))
    (tmp_path / "src" / "img" / "a.png").unlink()
    root = tmp_path / "root"
    with pytest.raises(DataError) as err:
        snapshot_from_config(data, str(root))
    assert "row 'i1' images[0]" in str(err.value)
    assert str(tmp_path / "src" / "img" / "a.png") in str(err.value)
    assert not root.exists()


def test_malformed_row_writes_nothing(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text('{"id": "a", "messages": "q", "answer": "1"}\n{"id": "b", "messages": "q", "answer": \n')
    with pytest.raises(DataError, match=r"train.jsonl:2: malformed JSON"):
        snapshot_from_config(DataConfig(train_url=str(src)), str(tmp_path / "root"))
    assert not (tmp_path / "root").exists()


def test_duplicate_ids_and_empty_split_are_rejected():
    s = Sample(id="x", messages=(Message("user", "q"),), answer="a")
    with pytest.raises(DataError, match="row id 'x' appears twice"):
        plan_snapshot({"train": [s], "eval": [s]})
    with pytest.raises(DataError, match="split 'eval' has no rows"):
        plan_snapshot({"train": [s], "eval": []})


def test_declared_sha256_is_checked():
    s = Sample(id="x", messages=(Message("user", "<image>"),), answer="a",
               images=(MediaRef(data=PNG, sha256="0" * 64),))
    with pytest.raises(DataError, match="does not match its sha256"):
        plan_snapshot({"train": [s]})


def test_manifest_is_written_last(tmp_path, monkeypatch):
    # Simulate a crash while writing rows: no manifest, so no snapshot is visible, and a rerun completes it.
    data = make_dataset(str(tmp_path / "src"))
    root = str(tmp_path / "root")
    real_write = objstore.write_bytes

    def crash_on_rows(url, blob):
        if "/rows/" in url:
            raise OSError("disk gone")
        real_write(url, blob)

    monkeypatch.setattr(objstore, "write_bytes", crash_on_rows)
    with pytest.raises(ConfigError, match=r"cannot write the snapshot under root .*\(OSError: disk gone\)"):
        snapshot_from_config(data, root)
    monkeypatch.setattr(objstore, "write_bytes", real_write)
    assert list_snapshots(root) == []
    info = snapshot_from_config(data, root)
    assert info.created and list_snapshots(root) == [info.id]
    assert json.loads(objstore.read_bytes(objstore.join(info.url, "manifest.json")))["id"] == info.id


def test_eval_split_by_row_id_is_stable(tmp_path):
    rows = [Sample(id=f"r{i}", messages=(Message("user", f"q{i}"),), answer=str(i)) for i in range(200)]
    write_jsonl(str(tmp_path / "all.jsonl"), rows)
    info = snapshot_from_config(DataConfig(train_url=str(tmp_path / "all.jsonl"), eval_fraction=0.25),
                                str(tmp_path / "root"))
    expected_eval = sum(held_out(r.id, 0.25) for r in rows)
    assert info.rows == {"train": 200 - expected_eval, "eval": expected_eval}
    assert 25 <= expected_eval <= 75  # a hash split lands near 25% of 200


def test_open_missing_snapshot(tmp_path):
    with pytest.raises(DataError, match="no dataset snapshot at"):
        Snapshot.open(str(tmp_path), "ds-0000")
    info = snapshot_from_config(make_dataset(str(tmp_path / "src")), str(tmp_path / "root"))
    with pytest.raises(DataError, match="has no split 'test'"):
        list(Snapshot(info.url).samples("test"))


def test_write_plan_twice_in_one_root_is_idempotent(tmp_path):
    s = Sample(id="x", messages=(Message("user", "q"),), answer="a")
    plan = plan_snapshot({"train": [s]})
    assert write_snapshot(plan, str(tmp_path)).created
    assert not write_snapshot(plan, str(tmp_path)).created


def test_hash_split_that_leaves_eval_empty_says_how_to_fix(tmp_path):
    write_jsonl(str(tmp_path / "one.jsonl"), [Sample(id="only", messages=(Message("user", "q"),), answer="a")])
    with pytest.raises(DataError, match="left the eval split empty; change data.eval_fraction or pass"):
        snapshot_from_config(DataConfig(train_url=str(tmp_path / "one.jsonl")), str(tmp_path / "root"))
