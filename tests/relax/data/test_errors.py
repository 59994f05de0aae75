"""Every problem of a dataset in one error (up to a limit), so a user fixes them in one pass."""

from __future__ import annotations

import json

import pytest

from relax.config import DataConfig
from relax.data.errors import MAX_REPORTED, DataError, DataErrors, Problems
from relax.data.sources import held_out, snapshot_from_config
from tests.media_files import png_bytes


def image_row(i: int, **changes) -> dict:
    row = {"id": f"r{i}", "messages": [{"role": "user", "content": "<image>\nWhich digit is this?"}],
           "images": [f"img/{i}.png"], "answer": str(i % 10)}
    return row | changes


def write_rows(folder, rows: list, lines: dict[int, str] | None = None) -> str:
    """``rows`` as jsonl under ``folder`` with an image for each; ``lines`` replaces lines by hand."""
    (folder / "img").mkdir(exist_ok=True)
    for i in range(len(rows)):
        (folder / "img" / f"{i}.png").write_bytes(png_bytes(2, 2, (i, 0, 0)))
    text = [json.dumps(r) for r in rows]
    for n, line in (lines or {}).items():
        text[n] = line
    (folder / "train.jsonl").write_text("\n".join(text) + "\n")
    return str(folder / "train.jsonl")


def test_twenty_rows_report_every_problem_with_the_empty_eval_split(tmp_path):
    rows = [image_row(i) for i in range(20)]
    assert not any(held_out(r["id"], 0.1) for r in rows)  # ids r0..r19: data.eval_fraction=0.1 holds out none
    rows[3]["images"] = ["img/missing.png"]
    rows[7] = {k: v for k, v in rows[7].items() if k != "images"} | {"image": ["img/7.png"]}
    url = write_rows(tmp_path, rows, lines={11: '{"id": "r11", "messages": '})
    with pytest.raises(DataErrors) as err:
        snapshot_from_config(DataConfig(train_url=url), str(tmp_path / "root"))
    message = str(err.value)
    assert message.startswith("4 problems in the data; fix them all, then rerun:")
    assert f"{url}:12: malformed JSON" in message
    assert f"{url}:8: unknown field(s) 'image' (did you mean 'images'?)" in message
    assert f"{url}:4: row 'r3' images[0]: media file" in message and "missing.png not found" in message
    assert "left the eval split empty; change data.eval_fraction" in message
    assert not (tmp_path / "root").exists()  # nothing written


def test_past_the_limit_the_rest_are_counted(tmp_path):
    rows = [image_row(i, answer=None) for i in range(MAX_REPORTED + 5)]
    url = write_rows(tmp_path, rows)
    (tmp_path / "held").mkdir()
    eval_url = write_rows(tmp_path / "held", [image_row(0, id="e0")])
    with pytest.raises(DataErrors) as err:
        snapshot_from_config(DataConfig(train_url=url, eval_url=eval_url), str(tmp_path / "root"))
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{MAX_REPORTED + 6} problems")  # and the train split left with no rows
    assert len(lines) == 1 + MAX_REPORTED + 1 and lines[-1] == "  ... and 6 more"
    assert all("missing required field(s) ['answer']" in line for line in lines[1:-1])


def test_one_problem_reads_as_it_always_did(tmp_path):
    rows = [image_row(i) for i in range(4)]
    rows[2]["images"] = ["img/missing.png"]
    url = write_rows(tmp_path, rows)
    (tmp_path / "held").mkdir()
    eval_url = write_rows(tmp_path / "held", [image_row(0, id="e0")])
    with pytest.raises(DataError) as err:
        snapshot_from_config(DataConfig(train_url=url, eval_url=eval_url), str(tmp_path / "root"))
    assert type(err.value) is DataError and str(err.value).startswith(f"{url}:3: row 'r2' images[0]: media file")


def test_problems_from_another_collection_keep_their_count():
    inner = Problems(limit=2)
    for i in range(5):
        inner.add(f"problem {i}")
    outer = Problems()
    with outer.collect():
        inner.raise_if_any()
    outer.add("one more")
    assert outer.total == 6 and outer.kept == ["problem 0", "problem 1", "one more"]
