"""The rollout section's checks: engine settings the layout would ignore, engine resources."""

from __future__ import annotations

import re

import pytest

from relax.config import (
    ConfigError,
    load_config,
)


@pytest.mark.parametrize(("overrides", "words"), [
    (["rollout.num_engines=2"], "rollout.num_engines=2 sizes SGLang servers"),
    (["rollout.engine_launcher=ray"], "engine_launcher=ray places engine processes"),
    (["rollout.engine_gpus=1"], "need rollout.engine_launcher=ray"),
])
def test_engine_settings_the_layout_would_ignore_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, overrides)
    ok = load_config(None, ["rollout.engine_processes=1", "rollout.engine_launcher=ray", "rollout.engine_gpus=1"])
    assert ok.rollout.engine_gpus == 1.0


def test_engine_resources_are_checked_as_the_config_loads():
    # a custom Ray resource only means something to Ray engine actors; a malformed one fails here, not at launch
    with pytest.raises(ConfigError, match="engine_resources are Ray resources .* need rollout.engine_launcher=ray"):
        load_config("tiny-cpu", ["rollout.engine_resources=rollout_node=1"])
    ray = ["rollout.engine_launcher=ray", "rollout.engine_processes=1"]
    with pytest.raises(ConfigError, match=r"bad resource 'GPU=1' .*set it with rollout.engine_gpus"):
        load_config("tiny-cpu", [*ray, "rollout.engine_resources=GPU=1"])
    assert load_config("tiny-cpu", [*ray, "rollout.engine_resources=rollout_node=1"]).rollout.engine_resources
