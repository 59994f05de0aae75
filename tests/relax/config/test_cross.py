"""The checks that span sections."""

from __future__ import annotations

import pytest

from relax.config import (
    ConfigError,
    load_config,
)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="exceed resources.num_gpus"):
        load_config(None, ["resources.rollout_gpus=1"])
    with pytest.raises(ConfigError, match="model.value_head=true"):
        load_config(None, ["algorithm.advantage=gae"])
    assert load_config(None, ["algorithm.advantage=gae", "model.value_head=true"]).algorithm.advantage == "gae"


def test_overlong_buffer_fits_inside_the_length_limit():
    with pytest.raises(ConfigError, match=r"overlong_buffer \(32\) exceeds rollout.max_new_tokens \(16\)"):
        load_config(None, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=32"])
    assert (
        load_config(None, ["rollout.max_new_tokens=16", "algorithm.overlong_buffer=4"]).algorithm.overlong_buffer == 4
    )


def test_near_miss_credit_refuses_a_custom_reward_and_stays_below_one():
    with pytest.raises(ConfigError, match="near_miss_credit shapes the built-in task verifiers"):
        load_config(None, ["algorithm.near_miss_credit=0.5", "data.reward_fn=tests.some:reward"])
    with pytest.raises(ConfigError, match="near_miss_credit"):
        load_config(None, ["algorithm.near_miss_credit=1.0"])  # a near miss worth a hit is no shaping
    assert load_config(None, ["algorithm.near_miss_credit=0.5"]).algorithm.near_miss_credit == 0.5


def test_exact_staleness_refuses_switching_versions_mid_generation():
    with pytest.raises(ConfigError, match="partial_rollout=wait or exact_staleness=false"):
        load_config(None, ["queue.exact_staleness=true", "rollout.partial_rollout=abort"])
    assert load_config(None, ["queue.exact_staleness=true"]).queue.exact_staleness
