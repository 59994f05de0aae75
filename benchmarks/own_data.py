"""Your own data, the documented way: scikit-learn's handwritten digits trained with the omni-cpu preset.

The data is not ours: ``sklearn.datasets.load_digits`` ships 1797 8x8 grey images of the digits
0-9 (the UCI "optical recognition of handwritten digits" set) inside scikit-learn. They go
through docs/quickstart.md, "Train on your own data", as a user would send them:

1. each image upscaled to a ``--size`` PNG and written as the quickstart's example row
   (``<image>`` then "Which digit is this? Put your final answer inside <answer></answer>.",
   the answer the digit), a held-out file of ``--heldout`` rows (balanced over the digits) and a
   train file of the rest;
2. ``relax data snapshot train.jsonl --eval test.jsonl``;
3. ``relax run omni-cpu data.snapshot=<id>``: the preset unchanged (its format warm-start on
   these rows, then RL), only its root and run id set.

    python benchmarks/own_data.py [--quick]

Writes own_data.json to the untracked results folder (``--update-docs``: benchmarks/results/ and
docs/benchmarks.md; see output.py). Last line: one JSON object with ``heldout_before`` (the
warm-started policy's greedy accuracy on the held-out digits), ``heldout_after``, ``chance``
(one over the number of classes) and ``minutes`` (the ``relax run`` wall time).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from output import Output, add_arguments
from PIL import Image

PROMPT = "<image>\nWhich digit is this? Put your final answer inside <answer></answer>."
RELAX = str(Path(sys.executable).with_name("relax"))


def export(folder: Path, size: int, heldout: int, train_rows: int | None) -> dict[str, int]:
    """The digits as train.jsonl and test.jsonl with their PNGs under ``folder``; rows per file."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = list(range(len(digits.target)))
    random.Random(0).shuffle(order)
    per_class = heldout // 10
    held, train = [], []
    for i in order:
        label = int(digits.target[i])
        (held if sum(int(digits.target[j]) == label for j in held) < per_class else train).append(i)
    train = train[:train_rows] if train_rows else train
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for name, indices in (("train", train), ("test", held)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for i in indices:
                # 0..16 ink -> white paper, black ink; nearest-neighbour keeps the 8x8 cells sharp
                pixels = bytes(255 - int(v) * 255 // 16 for v in digits.images[i].reshape(-1))
                image = Image.frombytes("L", (8, 8), pixels).resize((size, size), Image.NEAREST).convert("RGB")
                path = f"img/digit-{i:04d}.png"
                buf = io.BytesIO()
                image.save(buf, format="PNG")
                (folder / path).write_bytes(buf.getvalue())
                row = {"id": f"digit-{i:04d}", "messages": [{"role": "user", "content": PROMPT}], "images": [path],
                       "answer": str(int(digits.target[i]))}
                f.write(json.dumps(row) + "\n")
    return {"train": len(train), "test": len(held)}


def relax(*args: str, cwd: Path) -> str:
    out = subprocess.run([RELAX, *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        raise SystemExit(f"relax {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few hundred rows and steps: checks the script, "
                                                         "not learning")
    ap.add_argument("--size", type=int, default=32, help="side of the upscaled PNGs, in pixels")
    ap.add_argument("--heldout", type=int, default=200, help="held-out rows, balanced over the ten digits")
    ap.add_argument("overrides", nargs="*", help="extra config overrides key=value (the full run uses none)")
    add_arguments(ap)
    args = ap.parse_args()
    overrides = list(args.overrides)
    train_rows = None
    if args.quick:
        args.heldout, train_rows = 50, 200
        overrides += ["trainer.total_steps=20", "trainer.sft_steps=40", "trainer.checkpoint_every=10"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = export(folder, args.size, args.heldout, train_rows)
        snap = relax("data", "snapshot", "train.jsonl", "--eval", "test.jsonl", cwd=folder)
        sid = re.search(r"snapshot (ds-[0-9a-f]{16})", snap).group(1)
        t0 = time.perf_counter()
        out = relax("run", "omni-cpu", f"data.snapshot={sid}", "run_id=digits", *overrides, "--no-progress", "--json",
                    cwd=folder)
        minutes = (time.perf_counter() - t0) / 60
    scores = json.loads(out.strip().splitlines()[-1])
    reward = re.search(r"training reward ([\d.]+) -> ([\d.]+)", out)
    result = {
        "quick": args.quick,
        "dataset": "sklearn.datasets.load_digits (1797 8x8 images, 10 classes)",
        "rows": rows,
        "preset": "omni-cpu",
        "overrides": overrides,
        "steps": scores["steps"],
        "heldout_before": scores["before"]["image"],
        "heldout_after": scores["after"]["image"],
        "chance": 0.1,
        "training_reward_first": float(reward.group(1)),
        "training_reward_last": float(reward.group(2)),
        "minutes": round(minutes, 2),
        "setup": f"{os.cpu_count()}-CPU machine; digits upscaled to {args.size}x{args.size} PNGs; "
                 f"relax run omni-cpu data.snapshot=<id> (wall time of that command: warm start, two "
                 f"evaluations, RL)",
    }
    Output.from_args(args).write_json("own_data_quick" if args.quick else "own_data", result)
    print(json.dumps({k: result[k] for k in ("heldout_before", "heldout_after", "chance", "minutes", "steps",
                                             "quick")}))


if __name__ == "__main__":
    main()
