"""``relax genrm train-judge``: a judge folder a run can grade with, and a task it cannot train on refused."""

from __future__ import annotations

import json

from relax.cli.main import main
from relax.config import load_config


def test_train_judge_writes_a_folder_the_genrm_section_accepts(tmp_path, capsys):
    out = tmp_path / "judge"
    assert main(["genrm", "train-judge", "--task", "arithmetic", "--out", str(out), "--steps", "2",
                 "--eval-questions", "4"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert printed["task"] == "arithmetic" and printed["steps"] == 2
    assert printed["held_out"]["pairs"] == 8  # each held-out question answered right and wrong
    cfg = load_config("tiny-cpu", ["data.reward_role=true", *printed["overrides"]])
    assert cfg.genrm.name_or_path == str(out) and cfg.genrm.verdict == "boxed"


def test_train_judge_refuses_a_task_without_a_text_verifier(tmp_path, capsys):
    assert main(["genrm", "train-judge", "--task", "shapes", "--out", str(tmp_path / "j")]) == 2
    assert "not a built-in single-turn text task" in capsys.readouterr().err
    assert not (tmp_path / "j").exists()
