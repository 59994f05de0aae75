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
