"""Property test: every policy loss's value and gradient w.r.t. the new log-probs equal those
of a naive re-implementation written out per token with Python scalars and if/else.

The naive versions share no code with relax.algorithms (no masked helpers, no clamp, no
torch.where/maximum); they follow the papers' formulas literally. float64, atol 1e-6.
Hypothesis runs derandomized and without an example database so the test is reproducible
and writes nothing into the repository.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.losses import cispo_loss, dual_clip_loss, gspo_loss, gspo_token_loss, ppo_loss
from relax.algorithms.off_policy import decoupled_ppo_loss

F64 = torch.float64
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@dataclass
class Batch:
    lp: list[list[float]]
    old: list[list[float]]
    behav: list[list[float]]
    adv: list[list[float]]
    mask: list[list[bool]]
    w: list[list[float]] | None
    clip_low: float
    clip_high: float
    c: float
    seq_clamp: float


@st.composite
def batches(draw) -> Batch:
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 4))

    def grid(lo: float, hi: float):
        return draw(st.lists(st.lists(st.floats(lo, hi, allow_nan=False), min_size=t, max_size=t),
                             min_size=b, max_size=b))

    mask = draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b))
    return Batch(
        lp=grid(-3.0, 0.0), old=grid(-3.0, 0.0), behav=grid(-3.0, 0.0), adv=grid(-2.0, 2.0), mask=mask,
        w=grid(0.0, 3.0) if draw(st.booleans()) else None,
        clip_low=draw(st.floats(0.05, 0.4)), clip_high=draw(st.floats(0.05, 0.5)), c=draw(st.floats(1.5, 5.0)),
        seq_clamp=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),  # algorithm.gspo_clamp; 0 = no bound
    )


def clip_value(x, lo: float, hi: float):
    """clip(x, lo, hi) spelled as branches; inside the range x itself (keeps its gradient)."""
    if x < lo:
        return torch.tensor(lo, dtype=F64)
    if x > hi:
        return torch.tensor(hi, dtype=F64)
    return x


def pessimistic(ratio, clipped_ratio, a: float):
    """-min(r A, clip(r) A) by comparison."""
    s1, s2 = ratio * a, clipped_ratio * a
    return -(s1 if s1 <= s2 else s2)


def naive_token_loss(bt: Batch, lp: torch.Tensor, per_token: Callable) -> torch.Tensor:
    rows = []
    for i in range(len(bt.lp)):
        row = []
        for j in range(len(bt.lp[0])):
            if not bt.mask[i][j]:
                row.append(torch.tensor(0.0, dtype=F64))
                continue
            weight = 1.0 if bt.w is None else bt.w[i][j]
            row.append(per_token(i, j, lp[i, j]) * weight)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def naive_ppo(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    def token(i, j, x):
        r = torch.exp(x - bt.old[i][j])
        return pessimistic(r, clip_value(r, 1 - bt.clip_low, 1 + bt.clip_high), bt.adv[i][j])
    return naive_token_loss(bt, lp, token)


def naive_dual_clip(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    def token(i, j, x):
        r = torch.exp(x - bt.old[i][j])
        loss = pessimistic(r, clip_value(r, 1 - bt.clip_low, 1 + bt.clip_high), bt.adv[i][j])
        bound = -bt.c * bt.adv[i][j]
        if bt.adv[i][j] < 0 and bound < loss:
            return torch.tensor(bound, dtype=F64)
        return loss
    return naive_token_loss(bt, lp, token)


def _sequence_stats(bt: Batch, lp: torch.Tensor, i: int):
    idx = [j for j in range(len(bt.lp[0])) if bt.mask[i][j]]
    if not idx:
        return None, 0.0
    log_s = sum(lp[i, j] - bt.old[i][j] for j in idx) / len(idx)
    return log_s, sum(bt.adv[i][j] for j in idx) / len(idx)


def upper(log_ratio, bound: float):
    """log_ratio, or the constant ``bound`` above it (no gradient there); bound 0 = none."""
    if bound > 0 and log_ratio.item() > bound:
        return torch.tensor(bound, dtype=F64)
    return log_ratio


def naive_gspo(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    def token(i, j, x):
        log_s, a = _sequence_stats(bt, lp, i)
        s = torch.exp(upper(log_s, bt.seq_clamp))
        return pessimistic(s, clip_value(s, 1 - bt.clip_low, 1 + bt.clip_high), a)
    return naive_token_loss(bt, lp, token)


def naive_gspo_token(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    def token(i, j, x):
        log_s, _ = _sequence_stats(bt, lp, i)
        s_it = torch.exp(upper(log_s.item() + x - x.item(), bt.seq_clamp))  # sg[s_i] * pi / sg[pi]
        return pessimistic(s_it, clip_value(s_it, 1 - bt.clip_low, 1 + bt.clip_high), bt.adv[i][j])
    return naive_token_loss(bt, lp, token)


def naive_cispo(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    def token(i, j, x):
        r = math.exp(x.item() - bt.old[i][j])
        weight = min(max(r, 1 - bt.clip_low), 1 + bt.clip_high)  # a plain float: stop-gradient
        return -weight * bt.adv[i][j] * x
    return naive_token_loss(bt, lp, token)


def naive_decoupled(bt: Batch, lp: torch.Tensor) -> torch.Tensor:
    # old = pi_prox (clip centre), behav = pi_behav; weight pi_prox / pi_behav as a float
    def token(i, j, x):
        r = torch.exp(x - bt.old[i][j])
        loss = pessimistic(r, clip_value(r, 1 - bt.clip_low, 1 + bt.clip_high), bt.adv[i][j])
        return loss * math.exp(bt.old[i][j] - bt.behav[i][j])
    return naive_token_loss(Batch(**{**bt.__dict__, "w": None}), lp, token)


def tensors(bt: Batch):
    as_t = lambda x: torch.tensor(x, dtype=F64)  # noqa: E731
    w = None if bt.w is None else as_t(bt.w)
    return as_t(bt.lp).requires_grad_(True), as_t(bt.old), as_t(bt.adv), as_t(bt.mask), w


def check(bt: Batch, fast: Callable, naive: Callable) -> None:
    lp, old, adv, mask, w = tensors(bt)
    loss, metrics = fast(lp, old, adv, mask, w)
    loss.sum().backward()
    lp_naive = torch.tensor(bt.lp, dtype=F64, requires_grad=True)
    expected = naive(bt, lp_naive)
    # + 0 * sum(lp) keeps a graph when every token is masked (the gradient must then be 0)
    (expected.sum() + 0.0 * lp_naive.sum()).backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(lp.grad, lp_naive.grad, atol=1e-6, rtol=0)
    assert all(torch.isfinite(v) for v in metrics.values())


@SETTINGS
@given(batches())
def test_ppo_gradient(bt: Batch):
    check(bt, lambda lp, old, adv, m, w: ppo_loss(
        lp, old, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high, is_weights=w), naive_ppo)


@SETTINGS
@given(batches())
def test_dual_clip_gradient(bt: Batch):
    check(bt, lambda lp, old, adv, m, w: dual_clip_loss(
        lp, old, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high, dual_clip_c=bt.c, is_weights=w),
        naive_dual_clip)


@SETTINGS
@given(batches())
def test_gspo_gradient(bt: Batch):
    check(bt, lambda lp, old, adv, m, w: gspo_loss(
        lp, old, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high, is_weights=w, seq_clamp=bt.seq_clamp),
        naive_gspo)


@SETTINGS
@given(batches())
def test_gspo_token_gradient(bt: Batch):
    check(bt, lambda lp, old, adv, m, w: gspo_token_loss(
        lp, old, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high, is_weights=w, seq_clamp=bt.seq_clamp),
        naive_gspo_token)


@SETTINGS
@given(batches())
def test_cispo_gradient(bt: Batch):
    check(bt, lambda lp, old, adv, m, w: cispo_loss(
        lp, old, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high, is_weights=w), naive_cispo)


@SETTINGS
@given(batches())
def test_decoupled_ppo_gradient(bt: Batch):
    behav = torch.tensor(bt.behav, dtype=F64)
    check(bt, lambda lp, prox, adv, m, w: decoupled_ppo_loss(
        lp, prox, behav, adv, m, clip_low=bt.clip_low, clip_high=bt.clip_high), naive_decoupled)
