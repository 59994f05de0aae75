"""Exact weight deltas: every encoding reproduces the new tensor bit for bit, and undo restores the old."""

from __future__ import annotations

import pytest
import torch

from relax.transfer import weight_delta


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def changed(old: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    where = (torch.rand(old.numel(), generator=g) < fraction).nonzero().squeeze(1)
    new.view(-1)[where] = torch.randn(where.numel(), generator=g).to(old.dtype)
    return new


@pytest.mark.parametrize(("fraction", "kind"), [(0.002, "gap16"), (0.3, "mask"), (1.0, "full")])
def test_each_encoding_is_exact_and_undoable(fraction, kind):
    old = torch.randn(300, 257).bfloat16()
    new = changed(old, fraction, 1)
    d = weight_delta.diff(old, new)
    assert d.kind == kind
    assert d.nbytes <= new.numel() * new.element_size()
    target = old.clone()
    saved = weight_delta.apply_(target, d)
    assert torch.equal(bits(target), bits(new))
    weight_delta.undo_(target, d, saved)
    assert torch.equal(bits(target), bits(old))


def test_long_gaps_take_32_bits():
    old = torch.zeros(200_000)
    new = old.clone()
    new[[3, 150_000]] = 1.0
    d = weight_delta.diff(old, new)
    assert d.kind == "gap32"
    target = old.clone()
    weight_delta.apply_(target, d)
    assert torch.equal(target, new)


def test_bits_not_values_decide():
    old = torch.tensor([0.0, 1.0, float("nan")])
    new = torch.tensor([-0.0, 1.0, float("nan")])  # -0.0 == 0.0, yet the engine must hold the new bits
    d = weight_delta.diff(old, new)
    assert d is not None and weight_delta.indices(d, 3).tolist() == [0]
    assert weight_delta.diff(new, new.clone()) is None


def test_a_delta_that_does_not_fit_is_refused():
    old = torch.randn(64)
    d = weight_delta.diff(old, changed(old, 0.05, 2))
    with pytest.raises(ValueError, match="dtype"):
        weight_delta.apply_(old.bfloat16(), d)
    with pytest.raises(ValueError, match="indices"):
        weight_delta.apply_(torch.randn(3), d)


def test_content_hash_names_content_not_layout():
    a = {"x": torch.arange(6.0).view(2, 3), "y": torch.ones(2, dtype=torch.bfloat16)}
    same = {"y": torch.ones(2, dtype=torch.bfloat16), "x": torch.arange(6.0).view(2, 3).t().contiguous().t()}
    assert weight_delta.content_hash(a) == weight_delta.content_hash(same)
    assert weight_delta.content_hash(a) != weight_delta.content_hash({**a, "x": torch.arange(6.0).view(3, 2)})
    assert weight_delta.content_hash(a) != weight_delta.content_hash({**a, "y": a["y"].float()})
