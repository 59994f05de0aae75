"""The data section's checks: a snapshot id that could not be one, or given beside other rows."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config


def test_a_snapshot_id_is_accepted():
    assert load_config("omni-cpu", ["data.snapshot=ds-0123456789abcdef"]).data.snapshot == "ds-0123456789abcdef"


@pytest.mark.parametrize("bad", ["ds-123", "0123456789abcdef", "ds-0123456789ABCDEG", "./.relax/datasets/ds-1"])
def test_a_malformed_snapshot_id_names_the_form(bad):
    with pytest.raises(ConfigError, match="ds- and 16 hex digits"):
        load_config("omni-cpu", [f"data.snapshot={bad}"])


def test_a_snapshot_and_files_exclude_each_other():
    with pytest.raises(ConfigError, match="set data.snapshot or data.train_url, not both"):
        load_config("omni-cpu", ["data.snapshot=ds-0123456789abcdef", "data.train_url=train.jsonl"])
