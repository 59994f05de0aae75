"""Masked reductions and the three ways a per-token loss becomes one scalar.

Every loss in :mod:`relax.algorithms.losses` returns a per-token loss ``(B, T)`` that is
already zero on non-response tokens; this module decides how those tokens are weighted
against each other, which is a real algorithmic choice (DAPO and Dr.GRPO differ from the
original GRPO only here):

* ``token-mean`` (DAPO, arXiv:2503.14476): every response token in the batch weighs the
  same, so long responses carry more total weight.
* ``seq-mean-token-mean`` (original GRPO, arXiv:2402.03300): mean over each sequence's
  tokens, then mean over sequences, so every sequence weighs the same.
* ``seq-mean-token-sum-norm`` (Dr.GRPO, arXiv:2503.20783): each sequence's token *sum*
  divided by a constant (the max response length), then mean over sequences; removes the
  length bias of per-sequence normalisation.
* ``seq-mean-token-sum`` (verl's mode of that name): each sequence's token sum, then mean
  over sequences; no length divisor, so the loss scale grows with the response length.

Shapes: ``loss`` and ``mask`` are ``(B, T)``; ``mask`` is float or bool with 1 on response
tokens. A row whose mask is all zero (a filtered or padded sample) never produces a NaN.
``denom`` lets a trainer that splits a batch into micro-batches pass the *global* token or
sequence count, so the sum of micro-batch losses equals the full-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "LOSS_AGG",
    "aggregate_loss",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1.

    Formula: sum_i m_i x_i. ``torch.where`` rather than a product so a NaN/inf on a masked
    position (e.g. a log-prob of padding) cannot leak into the result.
    Shapes: x, mask broadcastable, e.g. (B, T); returns a scalar if ``dim`` is None, else
    the reduced shape, e.g. (B,) for ``dim=-1``.
    """
    m = _float_mask(mask, x)
    picked = torch.where(m > 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where there are none.

    Formula: sum_i m_i x_i / max(sum_i m_i, 1). The ``max(., 1)`` only matters for an
    all-zero mask (numerator 0 too), which it turns from 0/0 into 0.
    Shapes: as :func:`masked_sum`.
    """
    m = _float_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Largest ``x`` (values >= 0: importance weights, |per-token loss|) where ``mask`` is 1;
    0 for an empty or all-masked tensor.

    Formula: max_i m_i x_i, the masked positions read as 0 through ``torch.where`` (as in
    :func:`masked_sum`, so a NaN/inf there cannot leak). Shapes: x, mask (B, T) -> scalar.
    """
    picked = torch.where(_float_mask(mask, x) > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.amax() if picked.numel() else x.new_zeros(())


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True,
                  unbiased: bool = False) -> Tensor:
    """Normalise ``x`` to zero mean, unit variance over the masked positions.

    Formula, N masked positions, mu = masked mean:
    population (default): (x - mu) / sqrt(max(var, eps)), var = sum m (x - mu)^2 / N. Batch
    normalisation of advantages treats the batch as the whole population, N - 1 would be
    undefined for a single token, and clamping the variance (not adding eps) keeps a
    constant batch at exactly 0.
    ``unbiased`` (verl's ``masked_whiten``): (x - mu) / sqrt(var' + eps), var' = var * N / (N - 1);
    N = 1 falls back to var' = var (verl raises there).
    Masked positions are 0. Shapes: x, mask (B, T) -> (B, T).
    """
    m = _float_mask(mask, x)
    mu = masked_mean(x, m)
    var = masked_mean((x - mu) ** 2, m)
    centred = x - mu if shift_mean else x
    if unbiased:
        n = m.sum()
        scale = (var * n / (n - 1) if float(n) > 1 else var).add(eps).rsqrt()
    else:
        scale = var.clamp(min=eps).rsqrt()
    return torch.where(m > 0, centred * scale, torch.zeros_like(x))


def token_mean(loss: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Token-level mean over the whole batch (DAPO, arXiv:2503.14476; config ``token-mean``).

    Formula: L = sum_{i,t} m_it l_it / D, D = sum_{i,t} m_it (or ``denom``), D >= 1.
    Shapes: loss, mask (B, T) -> scalar.
    """
    m = _float_mask(mask, loss)
    d = m.sum() if denom is None else torch.as_tensor(denom, dtype=loss.dtype, device=loss.device)
    return masked_sum(loss, m) / d.clamp(min=1.0)


def seq_mean_token_mean(loss: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300; config
    ``seq-mean-token-mean``).

    Formula: L = (1/B) sum_i [ sum_t m_it l_it / |y_i| ], |y_i| = sum_t m_it, B = all rows
    (or ``denom``). An empty row (|y_i| = 0) adds 0 and still counts in B, as in every
    seq-mean mode and in verl's and slime's trainers (they divide by the global batch size).
    Shapes: loss, mask (B, T) -> scalar.
    """
    m = _float_mask(mask, loss)
    per_seq = masked_mean(loss, m, dim=-1)
    rows = loss.shape[0] if loss.dim() > 1 else 1
    n = torch.as_tensor(rows if denom is None else denom, dtype=loss.dtype, device=loss.device)
    return per_seq.sum() / n.clamp(min=1.0)


def seq_mean_token_sum(loss: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Mean over sequences of each sequence's token sum (verl's ``seq-mean-token-sum``; config
    ``seq-mean-token-sum``).

    Formula: L = (1/B) sum_i sum_t m_it l_it, B = all rows (or ``denom``). No length divisor:
    a sequence's weight grows with its length, so the loss scale does too (tune lr for it).
    Shapes: loss, mask (B, T) -> scalar.
    """
    m = _float_mask(mask, loss)
    rows = loss.shape[0] if loss.dim() > 1 else 1
    n = torch.as_tensor(rows if denom is None else denom, dtype=loss.dtype, device=loss.device)
    return masked_sum(loss, m) / n.clamp(min=1.0)


def seq_mean_token_sum_norm(
    loss: Tensor,
    mask: Tensor,
    norm_len: float | None = None,
    denom: float | Tensor | None = None,
) -> Tensor:
    """Mean over sequences of the token sum divided by a constant (Dr.GRPO, "Understanding
    R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783; config
    ``seq-mean-token-sum-norm``).

    Formula: L = (1/B) sum_i [ sum_t m_it l_it / L_norm ]; L_norm = ``norm_len`` (default T,
    the padded length, i.e. the max response length when batches are padded to it), B = all
    rows (or ``denom``). Both normalisers are constants, which is the point: a token's
    gradient does not depend on the length of the response it sits in.
    Shapes: loss, mask (B, T) -> scalar.
    """
    m = _float_mask(mask, loss)
    length = float(loss.shape[-1] if norm_len is None else norm_len)
    if length <= 0:
        raise ValueError(f"norm_len must be > 0, got {norm_len}")
    rows = loss.shape[0] if loss.dim() > 1 else 1
    n = torch.as_tensor(rows if denom is None else denom, dtype=loss.dtype, device=loss.device)
    return masked_sum(loss, m) / length / n.clamp(min=1.0)


#: Config name (``AlgorithmConfig.loss_agg``) -> aggregation; every entry is ``f(loss, mask)``.
LOSS_AGG: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    norm_len: float | None = None,
    denom: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar with the aggregation named ``mode``.

    ``norm_len`` is used by ``seq-mean-token-sum-norm`` only. See the module docstring for
    the formulas. Raises ValueError for an unknown ``mode``.
    """
    if mode not in LOSS_AGG:
        raise ValueError(f"unknown loss_agg {mode!r}; valid: {', '.join(sorted(LOSS_AGG))}")
    if mode == "seq-mean-token-sum-norm":
        return seq_mean_token_sum_norm(loss, mask, norm_len=norm_len, denom=denom)
    return LOSS_AGG[mode](loss, mask, denom=denom)
