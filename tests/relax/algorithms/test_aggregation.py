"""Loss aggregations and masked reductions, values derived by hand."""

from __future__ import annotations

import pytest
import torch
from hand_values import assert_close_to

from relax.algorithms.aggregation import (
    LOSS_AGG,
    aggregate_loss,
    masked_max,
    masked_mean,
    masked_sum,
    masked_whiten,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])




def test_token_mean():
    # response tokens 1, 2, 3 | 4 (7 and 9 are padding): (1 + 2 + 3 + 4) / 4 = 2.5
    assert_close_to(token_mean(LOSS, MASK), 2.5)


def test_seq_mean_token_mean():
    # row means: (1 + 2 + 3)/3 = 2 and 4/1 = 4 -> (2 + 4)/2 = 3
    assert_close_to(seq_mean_token_mean(LOSS, MASK), 3.0)


def test_seq_mean_token_sum_norm():
    # row sums 6 and 4; default norm_len = T = 3: (6/3 + 4/3)/2 = 10/6 = 1.666667
    assert_close_to(seq_mean_token_sum_norm(LOSS, MASK), 10 / 6)
    # norm_len = 5 (max response length): (6/5 + 4/5)/2 = 1.0
    assert_close_to(seq_mean_token_sum_norm(LOSS, MASK, norm_len=5), 1.0)


def test_bool_mask_same_as_float():
    for fn in LOSS_AGG.values():
        assert_close_to(fn(LOSS, MASK.bool()), fn(LOSS, MASK).item())


def test_all_zero_row_never_nan():
    # row 2 has no response tokens (e.g. filtered by DAPO)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert_close_to(token_mean(LOSS, mask), 2.0)  # (1 + 2 + 3)/3
    # the empty row adds 0 and counts in B (verl's trainer divides by the global batch size): (2 + 0)/2
    assert_close_to(seq_mean_token_mean(LOSS, mask), 1.0)
    assert_close_to(seq_mean_token_sum_norm(LOSS, mask), 1.0)  # constant normaliser: (6/3 + 0)/2


@pytest.mark.parametrize("mode", sorted(LOSS_AGG))
def test_all_zero_mask_gives_zero_and_finite_grad(mode):
    loss = LOSS.clone().requires_grad_(True)
    out = aggregate_loss(loss, torch.zeros(2, 3), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", sorted(LOSS_AGG))
def test_nan_on_padding_does_not_leak(mode):
    loss = LOSS.clone()
    loss[1, 1:] = float("nan")
    loss.requires_grad_(True)
    out = aggregate_loss(loss, MASK, mode)
    assert_close_to(out, aggregate_loss(LOSS, MASK, mode).item())
    out.backward()
    assert torch.isfinite(loss.grad).all()


def test_denominator_override_for_micro_batches():
    # two micro-batches of one row each with the global token count 4 sum to the full loss 2.5
    parts = [token_mean(LOSS[i : i + 1], MASK[i : i + 1], denom=4) for i in range(2)]
    assert_close_to(parts[0] + parts[1], 2.5)  # 6/4 + 4/4
    parts = [seq_mean_token_mean(LOSS[i : i + 1], MASK[i : i + 1], denom=2) for i in range(2)]
    assert_close_to(parts[0] + parts[1], 3.0)  # 2/2 + 4/2


def test_masked_reductions():
    # masked_sum per row: [6, 4]; masked_mean per row: [2, 4]; a zero row -> mean 0
    torch.testing.assert_close(masked_sum(LOSS, MASK, dim=-1), torch.tensor([6.0, 4.0]))
    torch.testing.assert_close(masked_mean(LOSS, MASK, dim=-1), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(LOSS, torch.zeros(2, 3), dim=-1), torch.zeros(2))
    # masked_max: 9 and 7 are masked out, so the largest kept value is 4 (row 1's first); an inf
    # on a masked position stays out; all masked or empty -> 0
    assert float(masked_max(LOSS, MASK)) == 4.0
    assert float(masked_max(LOSS.clone().index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(float("inf"))),
                            MASK)) == 4.0
    assert float(masked_max(LOSS, torch.zeros(2, 3))) == 0.0 and float(masked_max(torch.zeros(0, 3), MASK[:0])) == 0.0


def test_masked_whiten():
    # tokens [1, 2, 3 | 4]: mean 2.5, population var (2.25 + 0.25 + 0.25 + 2.25)/4 = 1.25
    # std 1.118034 -> [-1.341641, -0.447214, 0.447214 | 1.341641], padding 0
    out = masked_whiten(LOSS, MASK)
    torch.testing.assert_close(out, torch.tensor([[-1.341641, -0.447214, 0.447214], [1.341641, 0.0, 0.0]]),
                               atol=1e-5, rtol=0)


def test_unknown_mode_and_bad_norm():
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'; valid: seq-mean-token-mean"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="norm_len"):
        seq_mean_token_sum_norm(LOSS, MASK, norm_len=0)
