"""Shared builders for transfer tests (imported by path-relative import in each test module)."""

from __future__ import annotations

import numpy as np

from relax.transfer.columns import Field

ROLLOUT_FIELDS = [Field("tokens", "int64", (None,)), Field("logprobs", "float32", (None,)), Field("reward", "float32")]
ADV = Field("advantages", "float32", (None,))


def rollout_group(group: str, size: int = 2, policy_version: int = 0, length: int = 3) -> list[dict]:
    """``size`` samples of one prompt group; sample i has tokens [i, i+1, ...] of ``length``."""
    return [{"id": f"{group}/{i}", "group": group, "group_size": size, "policy_version": policy_version,
             "tokens": np.arange(i, i + length, dtype=np.int64), "logprobs": -np.ones(length, np.float32),
             "reward": float(i)} for i in range(size)]
