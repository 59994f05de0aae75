"""DAPO dynamic sampling and overlong shaping, values derived by hand."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms.dapo import (
    dynamic_sampling_filter,
    dynamic_sampling_stats,
    overlong_filter,
    overlong_penalty,
)


def test_dynamic_sampling_three_groups():
    # G = 3: [1, 1, 1] all solved (drop), [0, 1, 0] mixed (keep), [0, 0, 0] all failed (drop)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    keep_group, keep_sample = dynamic_sampling_filter(rewards, group_size=3)
    assert keep_group.tolist() == [False, True, False]
    assert keep_sample.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert keep_group.dtype == torch.bool and keep_sample.dtype == torch.bool


def test_dynamic_sampling_tolerance_and_single_sample_groups():
    # spread 0.6 - 0.5 = 0.1: kept with atol 0, dropped with atol 0.2
    rewards = torch.tensor([0.5, 0.6, 0.5])
    assert dynamic_sampling_filter(rewards, 3)[0].tolist() == [True]
    assert dynamic_sampling_filter(rewards, 3, atol=0.2)[0].tolist() == [False]
    # G = 1: nothing to compare against, never kept
    assert dynamic_sampling_filter(rewards, 1)[0].tolist() == [False, False, False]
    with pytest.raises(ValueError, match="group_size"):
        dynamic_sampling_filter(rewards, 2)


def test_dynamic_sampling_stats():
    # groups [1,1,1] (constant at best 1), [0,1,0] (kept), [0,0,0] (constant at worst 0)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    stats = dynamic_sampling_stats(rewards, 3)
    for key in ("kept_frac", "all_max_frac", "all_min_frac"):
        assert stats[key].item() == pytest.approx(1 / 3)


def test_overlong_penalty_hand_values():
    # L_max = 10, buffer L_cache = 4 -> soft zone starts at 6
    # L = 6: 0 (not past the start); L = 8: (6 - 8)/4 = -0.5; L = 10: (6 - 10)/4 = -1; L = 11: -1
    lengths = torch.tensor([6, 8, 10, 11])
    pen = overlong_penalty(lengths, max_length=10, buffer=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5, -1.0, -1.0]))
    # penalty_factor scales: 0.5 * [0, -0.5, -1, -1]
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5),
                               torch.tensor([0.0, -0.25, -0.5, -0.5]))


def test_overlong_penalty_from_mask_lengths():
    # lengths from the mask: [3, 1, 0] with L_max 3, buffer 2 (soft zone from 1):
    # 3 -> (1 - 3)/2 = -1; 1 -> 0; 0 -> 0
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(overlong_penalty(mask.sum(-1), 3, 2), torch.tensor([-1.0, 0.0, 0.0]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=5)


def test_overlong_filter():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = overlong_filter(mask, torch.tensor([True, False, False]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    out_bool = overlong_filter(mask.bool(), torch.tensor([False, True, False]))
    assert out_bool.dtype == torch.bool and out_bool.tolist()[1] == [False, False, False]
