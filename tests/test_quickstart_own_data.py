"""docs/quickstart.md, "Train on your own data", followed as written: its example row, its commands.

The commands are read from the section (not copied here), run in the data's folder as a user
would, with only the run's length shortened; ``<id>`` and ``<checkpoint>`` are filled in from
what the previous command printed. Two datasets: pictures of digits in the example row's shape,
and GSM8K-shaped rows (a train and a test file, snapshotted together). Each run must earn a
non-zero reward from its first batches: the format warm-start works on data it has never seen.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"
RELAX = str(Path(sys.executable).with_name("relax"))
# only the run's length changes: the preset's recipe (warm start included) is the documented one
SHORT = ["trainer.total_steps=3", "trainer.checkpoint_every=1"]


def section() -> str:
    text = DOC.read_text()
    start = text.index("## Train on your own data")
    return text[start:text.index("\n## ", start + 1)]


def example_row() -> dict:
    return json.loads(re.search(r"```json\n(.*?)\n```", section(), re.S).group(1))


def commands() -> list[list[str]]:
    """Every `relax` command of the section's first bash block, comments dropped."""
    block = re.search(r"```bash\n(.*?)\n```", section(), re.S).group(1)
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.startswith(".venv/bin/relax")]


def relax(argv: list[str], cwd: Path, **fill: str) -> subprocess.CompletedProcess:
    assert argv[0] == ".venv/bin/relax"
    args = [a.replace("<id>", fill.get("id", "<id>")).replace("<checkpoint>", fill.get("checkpoint", "<checkpoint>"))
            for a in argv[1:]]
    return subprocess.run([RELAX, *args], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def digit_rows(folder: Path, split: str, n: int) -> None:
    """The example row, once per picture: a digit drawn at a random place, the answer its value."""
    template, rng = example_row(), random.Random(split)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as f:
        for i in range(n):
            digit = str(i % 10)
            image = Image.new("RGB", (32, 32), "white")
            ImageDraw.Draw(image).text((rng.randrange(4, 20), rng.randrange(4, 16)), digit, fill="black")
            path = f"img/{split}-{i:04d}.png"
            image.save(folder / path)
            f.write(json.dumps({**template, "id": f"{split}-{i:04d}", "images": [path], "answer": digit}) + "\n")


def gsm8k_rows(folder: Path, split: str, n: int) -> None:
    """GSM8K's shape: a question, and a worked answer ending in '#### N'."""
    rng = random.Random(split)
    with open(folder / f"{split}.jsonl", "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"question": f"Ali has {a} pens and buys {b} more. How many pens does Ali have?",
                                "answer": f"Ali has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b}"}) + "\n")


def follow(folder: Path, gsm8k: bool) -> tuple[float, str]:
    """The section's snapshot (the GSM8K one or the other), run and eval commands in ``folder``;
    returns the run's first training reward and what ``relax eval --show`` printed."""
    snap, run, evaluate = ([c for c in commands() if c[1:3] == ["data", "snapshot"] and ("gsm8k" in c) == gsm8k]
                           + [c for c in commands() if c[1] in ("run", "eval")])
    out = relax(snap, folder)
    assert out.returncode == 0, out.stderr
    sid = re.search(r"snapshot (ds-[0-9a-f]{16})", out.stdout).group(1)
    assert f"data.snapshot={sid}" in out.stdout  # the snapshot command says how to train on it

    out = relax(run + SHORT + ["--no-progress"], folder, id=sid)
    assert out.returncode == 0, out.stderr
    assert f"on data {sid}" in out.stdout  # trained on the snapshot by id, not a new one
    first, _ = map(float, re.search(r"training reward ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    checkpoint = re.search(r"^checkpoint: (\S+)", out.stdout, re.M).group(1)

    out = relax(evaluate, folder, id=sid, checkpoint=checkpoint)
    assert out.returncode == 0, out.stderr
    return first, out.stdout


def test_the_example_row_states_the_answer_format():
    assert example_row()["messages"][-1]["content"].endswith("Put your final answer inside <answer></answer>.")
    kinds = [c[1:3] + (["gsm8k"] if "gsm8k" in c else []) for c in commands()]
    assert kinds == [["data", "snapshot"], ["data", "snapshot", "gsm8k"], ["run", "omni-cpu"], ["eval", "omni-cpu"]]


def test_pictures_of_digits_train_from_the_first_steps(tmp_path):
    digit_rows(tmp_path, "train", 60)
    digit_rows(tmp_path, "test", 10)
    first_reward, shown = follow(tmp_path, gsm8k=False)
    assert first_reward > 0.0  # the warm start taught the format: some first answers were right
    assert "<answer>" in shown  # the samples shown: responses in the format the warm start taught


def test_gsm8k_train_and_test_files_train_from_the_first_steps(tmp_path):
    gsm8k_rows(tmp_path, "train", 60)
    gsm8k_rows(tmp_path, "test", 10)
    first_reward, shown = follow(tmp_path, gsm8k=True)
    assert first_reward > 0.0
    assert "<answer>" in shown
