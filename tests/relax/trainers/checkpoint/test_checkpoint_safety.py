"""Checkpoints read back from a run root that someone else may write: nothing in them runs, every
metadata error names the object, and the package has no other way to unpickle a file."""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from relax.trainers.checkpoint.files import CheckpointError, read_meta
from relax.trainers.checkpoint.trainer_state import load_checkpoint, load_newest_good, save_checkpoint
from tests.relax.trainers.torch.tiny import tiny_qwen2

PACKAGE = Path(__file__).resolve().parents[4] / "relax"


class Payload:
    """Unpickling this runs ``open(marker, 'w')``: what an attacker would plant."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_payload_with_a_matching_sha256_is_refused_and_never_runs(tmp_path):
    url = str(tmp_path / "ckpt")
    save_checkpoint(url, tiny_qwen2())
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"model": {}, "rng": Payload(str(marker))}, buf)
    blob = buf.getvalue()
    (tmp_path / "ckpt" / "trainer.pt").write_bytes(blob)
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    meta["sha256"] = hashlib.sha256(blob).hexdigest()  # whoever writes the file writes its hash too
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"ckpt/trainer.pt holds more than tensors"):
        load_checkpoint(url, tiny_qwen2())
    assert not marker.exists()


def test_a_real_checkpoint_loads_with_weights_only_and_restores_every_rng(tmp_path):
    url = str(tmp_path / "ckpt")
    save_checkpoint(url, tiny_qwen2())
    expected = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # noqa: B018 - scramble all three
    load_checkpoint(url, tiny_qwen2())
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == expected


@pytest.mark.parametrize(("body", "why"), [(b'{"sha256": "ab', "is not valid JSON"),
                                           (b'{"step": 3}', "has no 'sha256' string"),
                                           (b"\xff\xfe", "is not valid JSON")])
def test_unreadable_metadata_names_the_file(tmp_path, body, why):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_bytes(body)
    with pytest.raises(CheckpointError, match=re.escape(f"ckpt/meta.json {why}")):
        read_meta(str(tmp_path / "ckpt"))


def test_resume_skips_a_corrupt_newest_checkpoint_and_says_so(tmp_path, caplog):
    # steps 1 and 3 saved; a flipped byte in 3: the loader warns naming it and takes 1
    model = tiny_qwen2()
    urls = [str(tmp_path / f"step-{s}") for s in (1, 3)]
    for s, url in zip((1, 3), urls, strict=True):
        save_checkpoint(url, model, meta={"step": s})
    pt = tmp_path / "step-3" / "trainer.pt"
    data = bytearray(pt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt.write_bytes(bytes(data))
    found = load_newest_good(urls, lambda url: load_checkpoint(url, tiny_qwen2()))
    assert found is not None and found[0] == 0 and found[1]["step"] == 1
    assert "step-3/trainer.pt fails its sha256 check" in caplog.text
    (tmp_path / "step-1" / "meta.json").write_text("{")  # and when none loads, starting over is refused
    with pytest.raises(CheckpointError, match="none of the run's 2 checkpoints loads"):
        load_newest_good(urls, lambda url: load_checkpoint(url, tiny_qwen2()))
    assert load_newest_good([], lambda url: {}) is None


def test_the_package_unpickles_nothing_but_weights():
    # one reader (checkpoint/files.py safe_load, weights_only=True); no pickle, no weights_only=False anywhere
    loads = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)|pickle\.loads?\(|weights_only\s*=\s*False", text):
            loads.append((path.relative_to(PACKAGE).as_posix(), m.group(0)))
    assert loads and all(f == "trainers/checkpoint/files.py" and "weights_only=True" in call for f, call in loads), (
        loads
    )
