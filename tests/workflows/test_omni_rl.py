"""The main workflow, run locally by Flyte: through the Python API and through `pyflyte run`.

Every run is tiny (4 train / 2 eval prompts per task, 2 RL steps of 2x2 samples, 2 SFT steps) on
the omni tiny model, which takes text, images and audio, so every task of the suite is evaluated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from relax import objstore
from relax.config import config_to_dict, load_config
from relax.data.snapshot import Snapshot

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
TASKS = {"arithmetic", "shapes", "tones", "tool_lookup"}
TINY = ["data.train_per_task=4", "data.eval_per_task=2", "trainer.total_steps=2", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "trainer.sft_steps=2",
        "model.name_or_path=tiny-omni", "model.family=qwen2_5_omni"]
TINY_YAML = config_to_dict(load_config(None, TINY))  # a whole config file, as `relax config show` writes
TABLE_HEADER = re.compile(r"^task\s+n\s+before\s+after\s*$", re.M)


def run_state(run_url: str) -> dict[str, bytes]:
    """Every checkpoint, lineage record and metrics file of a run, by path: what training would change."""
    fs, path = objstore.open_fs(run_url)
    out = {}
    for sub in ("checkpoints", "lineage", "metrics"):
        for f in fs.find(f"{path}/{sub}"):
            out[f[len(path):]] = fs.cat_file(f)
    return out


@pytest.mark.ray
def test_python_api_trains_evaluates_registers_and_reuses(tmp_path, ray_session):
    from workflows.omni_rl import omni_rl

    cfg = load_config(None, [f"root=file://{tmp_path}/root", *TINY])
    result = omni_rl(cfg=cfg)

    assert result.snapshot.rows == {"train": 16, "eval": 8}  # 4 tasks x 4 train, 4 tasks x 2 eval
    assert Snapshot(result.snapshot.url).id == result.snapshot.id
    for report in (result.eval_before, result.eval_after):
        assert set(report.accuracy) == TASKS and report.n == {t: 2 for t in TASKS}
        assert set(report.by_modality) == {"text", "image", "audio"}
    # "before" scores the warm-started policy RL starts from, "after" the final checkpoint
    assert result.eval_before.checkpoint.startswith(f"file://{tmp_path}/root/warm_start/")
    assert result.eval_after.checkpoint == result.train.checkpoint
    assert result.train.steps == 2 and result.train.run_id == cfg.run_id
    # the table the run printed, as a file `make check-readme` compares with the README
    written = json.loads(objstore.read_bytes(objstore.join(result.train.report_dir, "accuracy.json")))
    assert written["modalities"]["text"]["after"] == round(result.eval_after.by_modality["text"], 3)
    assert {t: v["before"] for t, v in written["tasks"].items()} == {
        t: round(a, 3) for t, a in result.eval_before.accuracy.items()}

    ckpt = Path(result.checkpoint.path)
    assert f"file://{ckpt}" == result.train.checkpoint and ckpt.is_dir() and any(ckpt.iterdir())
    head = result.lineage.steps[0]
    assert result.lineage.head == f"{cfg.run_id}/{ckpt.name}" == f"{head.run_id}/{head.checkpoint}"
    assert head.dataset_snapshot == result.snapshot.id and head.samples == 8  # 2 steps x 2 prompts x 2
    # the chain ends at the format warm start the run's first checkpoint descends from
    assert result.lineage.steps[-1].parent == "" and result.lineage.steps[-1].run_id == "warm-start"
    assert result.lineage.steps[-2].parent == f"warm-start/{result.lineage.steps[-1].checkpoint}"
    assert result.snapshot.id in result.lineage.chain_text

    before = run_state(result.train.run_url)
    assert {"/lineage/step-000001.json", "/checkpoints/step-000001/meta.json"} <= set(before)
    again = omni_rl(cfg=cfg)
    assert again.train.checkpoint == result.train.checkpoint and again.train.steps == 2
    assert run_state(result.train.run_url) == before  # no step trained, no checkpoint or record written
    assert again.eval_after == result.eval_after


def run_pyflyte(cfg_file: Path, home: Path, cwd: Path, ok: bool = True, ray_address: str = "") -> str:
    # a private HOME: its own Flyte local cache (~/.flyte/local-cache); ray_address: the train task joins
    # that Ray cluster instead of starting one (the session's: a start per run costs seconds)
    env = {**os.environ, "HOME": str(home), **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    out = subprocess.run([PYFLYTE, "run", str(REPO / "workflows" / "omni_rl.py"), "omni_rl", "--cfg", str(cfg_file)],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert (out.returncode == 0) == ok, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def write_cfg(path: Path, **sections) -> Path:
    data = dict(TINY_YAML)
    for name, values in sections.items():
        data[name] = {**data[name], **values} if isinstance(values, dict) else values
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
@pytest.mark.ray
def test_pyflyte_run_prints_table_publishes_deck_and_reuses_cache(tmp_path, ray_session):
    cfg_file = write_cfg(tmp_path / "cfg.yaml")
    ray_address = ray_session.get_runtime_context().gcs_address
    first = run_pyflyte(cfg_file, tmp_path / "home", tmp_path, ray_address=ray_address)
    match = re.search(r"dataset snapshot (ds-[0-9a-f]{16}) at (\S+)", first)
    assert match, first
    sid, url = match.groups()
    assert url == f"file://{tmp_path}/.relax/datasets/{sid}"  # the default root is ./.relax of the caller
    assert Snapshot(url).id == sid
    assert TABLE_HEADER.search(first), first
    for name in TASKS | {"[text]", "[image]", "[audio]"}:
        assert re.search(rf"^{re.escape(name)}\s", first, re.M), name
    # the workflow's result prints as a summary, not as the dataclass repr (pages of confusion counts)
    assert re.search(r"^lineage: [1-9]\d* checkpoints?, newest \S+/step-\d{6}$", first, re.M), first[-3000:]
    assert "by_kind=" not in first and "LineageStep(" not in first
    # a local run writes each task's deck.html under a fresh /tmp/flyte* sandbox; ours names our root
    decks = [p for p in Path(tempfile.gettempdir()).glob("flyte*/**/deck.html") if str(tmp_path) in p.read_text()]
    assert len(decks) == 1, decks
    page = decks[0].read_text()
    assert "Relax run" in page and "data:image/png;base64," in page and "<svg" in page and "tool_lookup" in page

    # the same config from another folder, with the same Flyte cache: the default root is relative
    # (./.relax), so a cache hit must never hand back this folder's snapshot or checkpoint
    (tmp_path / "b").mkdir()
    other = run_pyflyte(cfg_file, tmp_path / "home", tmp_path / "b", ray_address=ray_address)
    match = re.search(r"dataset snapshot ds-[0-9a-f]{16} at (file://\S+)", other)
    assert match and match.group(1).startswith(f"file://{tmp_path / 'b'}/.relax/datasets/"), other
    assert Snapshot(match.group(1)).info().rows == {"train": 16, "eval": 8}
    assert f"checkpoint file://{tmp_path / 'b'}/.relax/runs/tiny-cpu/checkpoints/" in other

    second = run_pyflyte(cfg_file, tmp_path / "home", tmp_path, ray_address=ray_address)
    assert sid in second and "dataset snapshot ds-" not in second  # the snapshot task was a cache hit
    assert TABLE_HEADER.search(second)
    # (new content is a new snapshot: the cached task's key is the content id, which hash_dataset
    # recomputes on every run, and tests/relax/data/test_snapshot.py shows any change gives a new id)


@pytest.mark.slow
@pytest.mark.parametrize("section, bad, named", [
    ({"total_stepz": 2}, "trainer.total_stepz", "trainer.total_steps"),  # a typo names the closest key
])  # (a value of the wrong type fails the same way: tests/relax/config/test_loader.py checks those messages)
def test_bad_config_file_fails_before_any_task(tmp_path, section, bad, named):
    cfg_file = write_cfg(tmp_path / "cfg.yaml", trainer=section)
    out = run_pyflyte(cfg_file, tmp_path / "home", tmp_path, ok=False)
    assert bad in out and named in out, out[-3000:]
    assert "dataset snapshot" not in out and not (tmp_path / ".relax").exists()  # nothing ran, nothing written
