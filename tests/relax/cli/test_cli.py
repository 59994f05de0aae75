"""The `relax` command as a user runs it: a real subprocess of the installed entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from relax.cli.main import main
from relax.data.readers import write_jsonl
from relax.data.samples import MediaRef, Message, Sample

RELAX = str(Path(sys.executable).with_name("relax"))


def relax(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([RELAX, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def write_rows(folder: Path) -> None:
    (folder / "img").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (2, 2)).save(folder / "img" / "x.png")  # a real PNG: snapshots read every image header
    write_jsonl(str(folder / "rows.jsonl"), [
        Sample(id=f"r{i}", messages=(Message("user", "<image> n?"),), answer=str(i),
               images=(MediaRef(path="img/x.png"),)) for i in range(40)
    ])


def test_config_show_resolves_overrides(tmp_path):
    out = relax("config", "show", "tiny-cpu", "trainer.lr=0.5", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["trainer"]["lr"] == 0.5
    as_yaml = yaml.safe_load(relax("config", "show", "qwen2.5-vl-3b", cwd=tmp_path).stdout)
    assert as_yaml["model"]["family"] == "qwen2_5_vl"


def test_config_errors_exit_2_with_one_line(tmp_path):
    out = relax("config", "show", "rollout.temprature=0.3", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: unknown config key rollout.temprature; did you mean rollout.temperature?")
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # three `relax` processes, ~6 s each (the CLI imports torch at start-up)
def test_snapshot_twice_prints_the_same_id(tmp_path):
    write_rows(tmp_path)
    first = relax("data", "snapshot", "rows.jsonl", "--root", "store", "--json", cwd=tmp_path)
    second = relax("data", "snapshot", "rows.jsonl", "--root", "store", "--json", cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["id"] == b["id"] and a["created"] and not b["created"]
    assert a["url"] == f"file://{tmp_path}/store/datasets/{a['id']}"
    human = relax("data", "snapshot", "rows.jsonl", "--root", "store", cwd=tmp_path).stdout
    assert f"snapshot {a['id']} (already existed, reused)" in human and f"at    {a['url']}" in human
    # and how to use it: the run and the evaluation on the snapshot by id, with the root it lives under
    assert f"relax run omni-cpu data.snapshot={a['id']} root=store run_id=mine" in human
    assert f"relax eval omni-cpu data.snapshot={a['id']} root=store --checkpoint CHECKPOINT" in human


def test_snapshot_missing_media_fails_cleanly(tmp_path):
    write_rows(tmp_path)
    (tmp_path / "img" / "x.png").unlink()
    out = relax("data", "snapshot", "rows.jsonl", "--root", "store", cwd=tmp_path)
    assert out.returncode == 2
    assert re.search(r"row 'r\d+' images\[0\]: media file \S+/img/x.png not found", out.stderr)
    assert not (tmp_path / "store").exists()


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_snapshot_under_an_unwritable_root_is_one_error_line(tmp_path, capsys):
    write_rows(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    rows = str(tmp_path / "rows.jsonl")
    assert main(["data", "snapshot", rows, "--root", str(tmp_path / "notes.txt" / "store")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{tmp_path}/notes.txt is a file, not a folder; pick a root you can write" in line
    # a root that looks writable, and a write under it that fails anyway (here: `datasets` is a file)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "datasets").write_text("")
    assert main(["data", "snapshot", rows, "--root", str(tmp_path / "store")]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: cannot write the snapshot under root {tmp_path}/store (") and "pick a root" in line


@pytest.mark.slow  # five `relax` processes, ~6 s each
def test_inspect_lists_and_shows(tmp_path):
    write_rows(tmp_path)
    sid = json.loads(relax("data", "snapshot", "rows.jsonl", "--root", "store", "--json", cwd=tmp_path).stdout)["id"]
    listing = relax("data", "inspect", "store", cwd=tmp_path)
    assert listing.returncode == 0 and listing.stdout.startswith(sid)
    shown = relax("data", "inspect", "store", sid, "--rows", "2", cwd=tmp_path)
    assert f"snapshot {sid}" in shown.stdout and shown.stdout.count("\n[r") == 2
    manifest = json.loads(relax("data", "inspect", f"store/datasets/{sid}", "--json", cwd=tmp_path).stdout)
    assert manifest["media"]["files"] == 1 and sum(s["rows"] for s in manifest["splits"].values()) == 40
    empty = relax("data", "inspect", "nowhere", cwd=tmp_path)
    assert empty.returncode == 2 and "no dataset snapshots under" in empty.stderr


def test_config_docs_match_the_committed_reference(tmp_path):
    out = relax("config", "docs", cwd=tmp_path)
    committed = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    assert out.stdout == committed, "docs/configuration.md is stale: run `make docs`"
