"""How a step's batch is split over data-parallel ranks (``data_parallel_share``), and how the
optimizer state travels by parameter name (``optimizer_state`` / ``load_optimizer_state``)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_batch, tiny_qwen2

from relax.config import load_config
from relax.trainers.checkpoint.optim_state import load_optimizer_state, optimizer_state
from relax.trainers.torch.actor import Actor
from relax.trainers.torch.batch import data_parallel_share


def test_shares_balance_tokens_longest_first():
    # lengths (5, 3, 4) over 2 ranks: 5 -> rank 0 (both empty, lower rank); 4 -> rank 1 (0 < 5);
    # 3 -> rank 1 (4 < 5): rank 0 holds 5 tokens, rank 1 holds 7
    assert data_parallel_share([5, 3, 4], 0, 2) == [0]
    assert data_parallel_share([5, 3, 4], 1, 2) == [1, 2]
    # equal lengths alternate by rank, in batch order within a share
    assert data_parallel_share([2, 2, 2], 0, 2) == [0, 2]
    assert data_parallel_share([2, 2, 2], 1, 2) == [1]


def test_every_sample_lands_on_exactly_one_rank():
    lengths = [7, 1, 9, 3, 3, 12, 5, 2]
    shares = [data_parallel_share(lengths, r, 3) for r in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)


def test_a_batch_smaller_than_the_ranks_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="raise rollout.prompts_per_step or lower trainer.data_parallel"):
        data_parallel_share([4], 0, 2)
    with pytest.raises(ValueError, match="rank 2 is not in a data-parallel world of 2"):
        data_parallel_share([4, 4], 2, 2)


def test_optimizer_state_by_name_resumes_bit_for_bit_and_loads_the_positional_form():
    cfg = load_config(None, ["trainer.warmup_steps=0", "rollout.max_new_tokens=16", "algorithm.off_policy=none"])
    a = Actor(tiny_qwen2(), cfg)
    a.train_step(tiny_batch())
    saved = optimizer_state(a.model, a.trainer.optimizer)
    assert saved["format"] == "by-name" and "model.embed_tokens.weight" in saved["state"]
    for positional in (False, True):
        b = Actor(copy.deepcopy(a.model), cfg)
        load_optimizer_state(b.model, b.trainer.optimizer, a.trainer.optimizer.state_dict() if positional else saved)
        a2 = copy.deepcopy(a)
        a2.train_step(tiny_batch(seed=2))
        b.train_step(tiny_batch(seed=2))
        assert all(
            torch.equal(x, y)
            for x, y in zip(a2.model.state_dict().values(), b.model.state_dict().values(), strict=True)
        )
        # every parameter counts its own steps (a shared counter would advance once per parameter)
        steps = {float(st["step"]) for st in b.trainer.optimizer.state.values()}
        assert steps == {2.0}
