"""The whole tree: its JSON reading and the run id it names a folder with."""

from __future__ import annotations

import json

import pytest

from relax.config import (
    ConfigError,
    RelaxConfig,
    load_config,
)


def test_from_json_is_strict():
    # pyflyte passes --cfg files through RelaxConfig.from_json: a typo must not be dropped silently.
    with pytest.raises(ConfigError, match="did you mean data.train_url"):
        RelaxConfig.from_json(json.dumps({"data": {"train_urll": "x.jsonl"}}))


@pytest.mark.parametrize("run_id", ["..", "../other", "a/b", ".hidden", ""])
def test_run_id_is_a_safe_folder_name(run_id):
    with pytest.raises(ConfigError, match="becomes a folder under <root>/runs/"):
        load_config(None, [f"run_id={run_id}"])
