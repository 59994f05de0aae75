"""The main workflow, run locally by Flyte: through the Python API and through `pyflyte run`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from relax.config_loader import load_config
from relax.data.snapshot import Snapshot

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
SMALL = ["data.train_per_task=4", "data.eval_per_task=2"]


def test_python_api_snapshots_and_caches(tmp_path):
    from workflows.omni_rl import omni_rl

    cfg = load_config(None, [f"root=file://{tmp_path}/root", *SMALL])
    info = omni_rl(cfg=cfg)
    assert info.rows == {"train": 16, "eval": 8}  # 4 tasks x 4 train, 4 tasks x 2 eval
    snap = Snapshot(info.url)
    assert snap.id == info.id
    assert {s.task for s in snap.samples("eval")} == {"arithmetic", "shapes", "tones", "tool_lookup"}
    assert omni_rl(cfg=cfg).id == info.id


def run_pyflyte(cfg_file: Path, home: Path, cwd: Path) -> str:
    env = {**os.environ, "HOME": str(home)}  # a private Flyte local cache (~/.flyte/local-cache)
    out = subprocess.run([PYFLYTE, "run", str(REPO / "workflows" / "omni_rl.py"), "omni_rl", "--cfg", str(cfg_file)],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_pyflyte_run_prints_snapshot_and_reuses_cache(tmp_path):
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": {"train_per_task": 4, "eval_per_task": 2}}))
    first = run_pyflyte(cfg_file, tmp_path / "home", tmp_path)
    match = re.search(r"dataset snapshot (ds-[0-9a-f]{16}) at (\S+)", first)
    assert match, first
    sid, url = match.groups()
    assert url == f"file://{tmp_path}/.relax/datasets/{sid}"  # the default root is ./.relax of the caller
    assert Snapshot(url).id == sid
    second = run_pyflyte(cfg_file, tmp_path / "home", tmp_path)
    assert sid in second and "dataset snapshot" not in second  # the snapshot task was a cache hit
    cfg_file.write_text(yaml.safe_dump({"data": {"train_per_task": 4, "eval_per_task": 2, "difficulty": 2}}))
    third = run_pyflyte(cfg_file, tmp_path / "home", tmp_path)
    new = re.search(r"dataset snapshot (ds-[0-9a-f]{16})", third)
    assert new and new.group(1) != sid  # new content, new id, cache missed


@pytest.mark.slow
def test_same_config_from_another_folder_gets_its_own_snapshot(tmp_path):
    # The default root is relative (./.relax): a cache hit must never hand back another folder's snapshot.
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": {"train_per_task": 3, "eval_per_task": 2}}))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        out = run_pyflyte(cfg_file, tmp_path / "home", tmp_path / name)
        match = re.search(r"url='(file://[^']+)'", out)
        assert match and match.group(1).startswith(f"file://{tmp_path / name}/.relax/datasets/"), out
        assert Snapshot(match.group(1)).info().rows == {"train": 12, "eval": 8}


def test_pyflyte_package_serializes(tmp_path):
    out_file = tmp_path / "flyte-package.tgz"
    out = subprocess.run([PYFLYTE, "--pkgs", "workflows", "package", "--image", "relax:dev", "--output",
                          str(out_file), "--force"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with tarfile.open(out_file) as tar:
        names = tar.getnames()
    assert any("tasks.data.snapshot_dataset" in n for n in names), names
    assert any("workflows.omni_rl.omni_rl" in n for n in names), names
