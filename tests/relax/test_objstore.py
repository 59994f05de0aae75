"""URL helpers and atomic writes shared by the data and transfer layers."""

from __future__ import annotations

import numpy as np
import pytest

from relax import objstore


@pytest.mark.parametrize("sizes", [[0], [10], [3 << 20], [5, 4096, 2 << 20, 7, 1 << 20, 100]])
def test_parts_are_written_in_order_on_every_store(any_url, sizes):
    # parts below, at and above the 1 MiB write chunk must come back as one exact byte string
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    url = objstore.join(any_url, "dir", "obj.bin")
    objstore.write_bytes(url, [memoryview(p) for p in parts], fsync=False)
    assert objstore.read_bytes(url) == b"".join(p.tobytes() for p in parts)


def test_relative_and_remote_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert objstore.absolute_url("file://./.relax") == f"file://{tmp_path}/.relax"
    assert objstore.absolute_url("sub/x") == f"file://{tmp_path}/sub/x"
    assert objstore.absolute_url("memory://bucket/a") == "memory:///bucket/a"


def test_listing_delete_and_no_temp_files_left(tmp_path):
    base = f"file://{tmp_path}"
    objstore.write_bytes(objstore.join(base, "a", "x"), b"1")
    objstore.write_bytes(objstore.join(base, "a", "y"), b"2")
    assert objstore.list_dir(objstore.join(base, "a")) == ["x", "y"]  # no .tmp-* leftovers
    objstore.delete(objstore.join(base, "a", "x"))
    objstore.delete(objstore.join(base, "a", "missing"))  # deleting nothing is fine
    assert objstore.list_dir(objstore.join(base, "a")) == ["y"]
    assert objstore.list_dir(objstore.join(base, "nowhere")) == []


def test_a_write_in_flight_or_killed_before_its_rename_is_not_listed(tmp_path):
    # write_bytes writes <name>.tmp-<8 hex> and renames it; a reader listing the folder in
    # between (or after a SIGKILL between the two) must not see the partial file
    base = f"file://{tmp_path}"
    objstore.write_bytes(objstore.join(base, "schema", "a.json"), b"{}")
    (tmp_path / "schema" / "b.json.tmp-0123abcd").write_bytes(b"")  # what a killed writer leaves
    (tmp_path / "schema" / "notes.tmp-draft").write_bytes(b"x")  # not our pattern: a real object
    assert objstore.list_dir(objstore.join(base, "schema")) == ["a.json", "notes.tmp-draft"]


def test_read_many_keeps_the_order_and_gives_none_for_a_missing_object(any_url):
    for name, body in (("b", b"2"), ("a", b"1"), ("c", b"")):
        objstore.write_bytes(objstore.join(any_url, "d", name), body)
    got = objstore.read_many(objstore.join(any_url, "d"), ["c", "missing", "a", "b"])
    assert got == [b"", None, b"1", b"2"]
    assert objstore.read_many(objstore.join(any_url, "d"), []) == []


# A second process that writes into a folder this process has already listed and read from: the
# restarted-role case (issue 63). The writer is a child process, so no cache of this process knows.
_WRITER = """
import sys
from relax import objstore
from relax.transfer.writers import RecordLog
log = RecordLog(objstore.join(sys.argv[1], "log", sys.argv[2]))
log.next_seq = int(sys.argv[3])
log.append({"seq": int(sys.argv[3])})
"""


def _write_from_another_process(url: str, key: str, seq: int) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _WRITER, url, key, str(seq)], check=True, timeout=60)


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), "gcs"])  # the GCS emulator is quick: no marker
def bucket_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


def test_a_reader_sees_records_another_process_wrote_after_it_listed_the_folder(bucket_url):
    from relax.transfer.writers import read_records

    log_url = objstore.join(bucket_url, "log", "w.1")
    _write_from_another_process(bucket_url, "w.1", 0)
    # everything a reader does to a log: list the logs, list one log (the gap check), probe records
    assert objstore.list_dir(objstore.join(bucket_url, "log")) == ["w.1"]
    assert objstore.list_dir(log_url) == ["00000000.json"]
    assert not objstore.exists(objstore.join(log_url, "00000001.json"))
    assert objstore.read_many(log_url, ["00000001.json"]) == [None]
    assert objstore.list_dir(log_url) == ["00000000.json"]  # the gap check's listing comes last
    _write_from_another_process(bucket_url, "w.1", 1)
    _write_from_another_process(bucket_url, "w.2", 0)
    assert [s for s, _ in read_records(log_url)] == [0, 1]  # was [0] for ever: s3fs answered from its listing
    assert objstore.read_many(log_url, ["00000001.json"])[0] is not None
    assert objstore.exists(objstore.join(log_url, "00000001.json"))
    assert objstore.list_dir(log_url) == ["00000000.json", "00000001.json"]
    assert objstore.list_dir(objstore.join(bucket_url, "log")) == ["w.1", "w.2"]
    fs, _ = objstore.open_fs(bucket_url)
    assert len(fs.dircache) == 0, "a listing was cached: a later read could trust it"


def test_object_store_filesystems_keep_no_listing_cache_and_local_ones_are_untouched(tmp_path):
    fs, _ = objstore.open_fs("s3://some-bucket/x")  # gs: checked against the emulator above
    assert fs.dircache.use_listings_cache is False
    local, path = objstore.open_fs(str(tmp_path))
    assert objstore._is_local(local) and path == str(tmp_path)


def test_only_objstore_opens_filesystems_on_the_data_path():
    # a filesystem opened anywhere else would bring back the listing cache (issue 63); reading a user's
    # data file or config (fsspec.open) is not the data path: nothing else writes it while it is read
    from pathlib import Path

    root = Path(objstore.__file__).parent
    allowed = {"objstore.py", "config/loader.py", "data/readers.py"}
    users = {str(p.relative_to(root)) for p in root.rglob("*.py") if "import fsspec" in p.read_text()}
    assert users <= allowed, f"{sorted(users - allowed)} open fsspec filesystems: go through relax.objstore"
    for name in ("url_to_fs(", "fsspec.filesystem("):
        found = {str(p.relative_to(root)) for p in root.rglob("*.py") if name in p.read_text()}
        assert found <= {"objstore.py"}, (name, found)
