"""The one comparison the hand-derived algorithm tests use."""

from __future__ import annotations

import torch


def assert_close_to(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    """``actual`` equals the hand-derived ``expected`` within ``atol`` (absolute; no relative slack)."""
    torch.testing.assert_close(actual.detach(), torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)
