"""The zigzag split of context parallelism (relax.trainers.megatron.context_parallel), on hand-worked sequences.
The two-rank forward, step and loop checks are test_actor_cp2_cpu.py and test_actor_ranks.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

from relax.trainers.megatron.context_parallel import padded_length, rank_order, zigzag_positions  # noqa: E402


def test_padded_length_is_the_next_multiple_of_twice_cp() -> None:
    # cp=2 cuts into 4 chunks: 5 tokens -> 8, 8 -> 8, 1 -> 4; cp=3 cuts into 6: 7 -> 12
    assert [padded_length(s, 2) for s in (5, 8, 1)] == [8, 8, 4]
    assert padded_length(7, 3) == 12 and padded_length(6, 1) == 6


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    # seq=6, cp=3: chunks of 1; rank r holds chunks r and 5-r
    assert [zigzag_positions(6, 3, r).tolist() for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    # seq=8, cp=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # every position exactly once, and each rank has as many causal keys to attend to: 0+1+6+7 == 2+3+4+5
    held = torch.cat([zigzag_positions(8, 2, r) for r in range(2)])
    assert sorted(held.tolist()) == list(range(8))
    assert int(zigzag_positions(8, 2, 0).sum()) == int(zigzag_positions(8, 2, 1).sum())


def test_rank_order_puts_gathered_shares_back_in_sequence_order() -> None:
    # seq=6, cp=3: the all-gather returns [0, 5 | 1, 4 | 2, 3]; position p is at index [0, 2, 4, 5, 3, 1][p]
    order = rank_order(6, 3)
    assert order.tolist() == [0, 2, 4, 5, 3, 1]
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    gathered = torch.cat([tokens[zigzag_positions(6, 3, r)] for r in range(3)])  # [10, 15, 11, 14, 12, 13]
    assert gathered.index_select(0, order).tolist() == tokens.tolist()
    assert rank_order(4, 1).tolist() == [0, 1, 2, 3]  # cp=1: nothing moves
