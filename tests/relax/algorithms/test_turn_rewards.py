"""Turn-level rewards credited to their turns' tokens (relax.algorithms.turn_rewards), checked by hand."""

from __future__ import annotations

import numpy as np

from relax.algorithms.turn_rewards import turn_advantages, turn_reward_tokens


def test_each_turns_reward_lands_on_its_own_tokens_by_hand():
    # three tokens: turn 0 is token 0, a tool result is token 1 (not trained), turn 1 is token 2;
    # the agent posted turn rewards [0.5, -1] and the episode's advantage is 0.2 on every token
    tokens = turn_reward_tokens(3, [(0, 1), (2, 3)], [0.5, -1.0])
    assert tokens.tolist() == [0.5, 0.0, -1.0]
    adv = turn_advantages(np.full(3, 0.2, np.float32), tokens, np.array([1, 0, 1]), coef=2.0)
    # token 0: 0.2 + 2 * 0.5 = 1.2; token 1: masked, 0.2 unchanged; token 2: 0.2 + 2 * -1 = -1.8
    np.testing.assert_allclose(adv, [1.2, 0.2, -1.8], rtol=1e-6)
    assert adv.dtype == np.float32


def test_a_turn_without_a_reward_gains_nothing():
    assert turn_reward_tokens(3, [(0, 1), (2, 3)], [0.5]).tolist() == [0.5, 0.0, 0.0]
    assert turn_reward_tokens(2, [], []).tolist() == [0.0, 0.0]
