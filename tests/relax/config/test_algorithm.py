"""The algorithm section's checks: an option the estimator or loss would not read is refused."""

from __future__ import annotations

import pytest

from relax.config import (
    ConfigError,
    load_config,
)


@pytest.mark.parametrize("clash", ["algorithm.kl_coef=0", "algorithm.kl_in_reward=true"])
def test_topk_kl_needs_a_kl_loss_term(clash):
    with pytest.raises(ConfigError, match="algorithm.kl_topk is the actor's KL loss term"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8", clash])
    assert load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8"]).algorithm.kl_topk == 8


def test_topk_weight_needs_the_top_k_term():
    with pytest.raises(ConfigError, match="kl_topk_weight splits the KL"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk_weight=0.5"])
    with pytest.raises(ConfigError, match="kl_topk_weight=0 puts no weight"):
        load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8", "algorithm.kl_topk_weight=0"])
    assert load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl_topk=8",
                              "algorithm.kl_topk_weight=0.25"]).algorithm.kl_topk_weight == 0.25


def test_stuck_group_push_needs_a_group_estimator():
    with pytest.raises(ConfigError, match="stuck_group_push adds to a group estimator"):
        load_config(None, ["algorithm.stuck_group_push=0.2", "algorithm.advantage=reinforce_pp"])
    assert (
        load_config(None, ["algorithm.stuck_group_push=0.2", "algorithm.advantage=rloo"]).algorithm.stuck_group_push
        == 0.2
    )


@pytest.mark.parametrize(("overrides", "name"), [
    (["algorithm.is_level=sequence"], "is_level"),  # default off_policy decoupled has no level
    (["algorithm.std_estimator=unbiased", "algorithm.advantage=rloo"], "std_estimator"),
    (["algorithm.gspo_clamp=10"], "gspo_clamp"),
    (["algorithm.loss_agg_norm=8"], "loss_agg_norm"),
    (["algorithm.overlong_penalty=0.5"], "overlong_penalty"),
    (["algorithm.kl_estimator=k1"], "kl_estimator"),  # kl_coef is 0 by default: no KL is computed
    (["algorithm.kl_clamp=10"], "kl_clamp"),
    (["algorithm.kl_in_reward=true"], "kl_in_reward"),
    (["algorithm.dual_clip_c=5"], "dual_clip_c"),
    (["algorithm.off_policy=none", "algorithm.is_cap=5"], "is_cap"),
    (["algorithm.gamma=0.9"], "gamma"),
    (["algorithm.lam=1.0"], "lam"),
    (["algorithm.value_clip=0.5"], "value_clip"),
])
def test_an_option_the_algorithm_would_not_read_is_refused(overrides, name):
    with pytest.raises(ConfigError, match=rf"algorithm\.{name}=\S+ is read only with"):
        load_config(None, overrides)
