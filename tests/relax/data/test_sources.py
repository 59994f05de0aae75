"""A config's dataset: the snapshot data.snapshot names, as written, or one made from the files."""

from __future__ import annotations

import dataclasses

import pytest

from relax.config import DataConfig
from relax.data.errors import DataError
from relax.data.readers import write_jsonl
from relax.data.samples import Message, Sample
from relax.data.sources import plan_from_config, snapshot_from_config


def rows(folder, answers):
    write_jsonl(str(folder / "train.jsonl"), [Sample(id=f"r{i}", messages=(Message("user", "n?"),), answer=a)
                                              for i, a in enumerate(answers)])
    return DataConfig(train_url=str(folder / "train.jsonl"), eval_fraction=0.5)


def test_a_snapshot_by_id_is_the_one_written_whatever_the_files_became(tmp_path):
    data = rows(tmp_path, [str(i) for i in range(20)])
    made = snapshot_from_config(data, str(tmp_path / "root"))
    rows(tmp_path, ["changed"] * 20)  # the file changes after the snapshot
    by_id = snapshot_from_config(DataConfig(snapshot=made.id), str(tmp_path / "root"))
    assert (by_id.id, by_id.url, by_id.rows, by_id.created) == (made.id, made.url, made.rows, False)


def test_a_missing_snapshot_lists_the_ones_there(tmp_path):
    made = snapshot_from_config(rows(tmp_path, [str(i) for i in range(20)]), str(tmp_path / "root"))
    with pytest.raises(DataError, match=f"no such snapshot under root .*snapshots there: {made.id}"):
        snapshot_from_config(DataConfig(snapshot="ds-0000000000000000"), str(tmp_path / "root"))
    with pytest.raises(DataError, match="there are no snapshots there"):
        snapshot_from_config(DataConfig(snapshot="ds-0000000000000000"), str(tmp_path / "empty"))
    with pytest.raises(DataError, match="nothing to plan"):
        plan_from_config(dataclasses.replace(DataConfig(), snapshot=made.id))
