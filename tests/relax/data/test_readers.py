"""jsonl and parquet readers on a local folder, memory:// and the moto S3 server."""

from __future__ import annotations

import gzip
import json

import pytest

from relax import objstore
from relax.data.errors import DataError
from relax.data.readers import iter_records, read_samples, write_jsonl, write_parquet
from relax.data.samples import MediaRef, Message, Sample

SAMPLES = [
    Sample(id="t1", messages=(Message("user", "1+2?"),), answer="3", task="arithmetic", metadata={"d": 1}),
    Sample(id="i1", messages=(Message("user", "<image> colour?"),), answer="red", task="shapes",
           images=(MediaRef(path="img/a.png"),)),
    Sample(id="a1", messages=(Message("user", "<audio> beeps?"),), answer="2", task="tones",
           audios=(MediaRef(data=b"RIFF0000WAVE"),)),
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_round_trip_on_every_store(any_url, kind):
    url = objstore.join(any_url, "sub", f"rows.{kind}")
    (write_jsonl if kind == "jsonl" else write_parquet)(url, SAMPLES)
    got = list(read_samples(url))
    assert [s.id for s in got] == ["t1", "i1", "a1"]
    assert got[0] == SAMPLES[0]
    # a relative media path resolves against the data file's folder
    assert got[1].images[0].path == objstore.join(objstore.absolute_url(any_url), "sub", "img/a.png")
    assert got[2].audios[0].data == b"RIFF0000WAVE"


def test_locations_are_reported(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1, "messages": "a", "answer": "b"}\n\n{"id": 2, "messages": "c", "answer": "d"}\n')
    assert [w for _, w in iter_records(str(path))] == [f"{path}:1", f"{path}:3"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "messages": "a", "answer": "b"}\n{"id": 2, "messages": \n')
    with pytest.raises(DataError) as err:
        list(read_samples(str(path)))
    assert f"{path}:2: malformed JSON" in str(err.value)
    assert "line 2 of bad.jsonl" in str(err.value)


def test_non_object_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: each line must be a JSON object"):
        list(iter_records(str(path)))


def test_gzip_jsonl(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(json.dumps({"id": "g", "messages": "q", "answer": "a"}).encode() + b"\n"))
    assert [s.id for s in read_samples(str(path))] == ["g"]


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(iter_records(str(tmp_path / "none.jsonl")))
    other = tmp_path / "d.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match="unknown file type"):
        list(iter_records(str(other)))
    broken = tmp_path / "d.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        list(iter_records(str(broken)))


@pytest.mark.s3
def test_s3_jsonl_written_by_hand(s3_url):
    # rows written by another tool straight to S3, not through relax's writer
    import fsspec

    url = f"{s3_url}/raw/rows.jsonl"
    with fsspec.open(url, "w") as fh:
        fh.write('{"id": "s", "messages": [{"role": "user", "content": "hi"}], "answer": "yo"}\n')
    (sample,) = read_samples(url)
    assert (sample.id, sample.answer) == ("s", "yo")
