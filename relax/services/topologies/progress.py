"""The progress bar a topology shows while a run trains."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm


class Progress:
    """A tqdm bar over actor steps: reward, staleness, samples/s."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled,
                        dynamic_ncols=True)
        self.reward = float("nan")
        self.t0, self.samples = time.perf_counter(), 0

    def rollout(self, m: dict[str, Any]) -> None:
        self.reward = m.get("reward", self.reward)

    def actor(self, m: dict[str, Any]) -> None:
        self.samples += m.get("samples", 0)
        self.bar.set_postfix(reward=f"{self.reward:.3f}", stale=m.get("staleness_max", 0),
                             sps=f"{self.samples / max(time.perf_counter() - self.t0, 1e-9):.0f}", refresh=False)
        step = m.get("step")  # a restarted actor reports its redone step again: count steps, not records
        self.bar.update(1 if step is None else max(0, int(step) + 1 - self.bar.n))

    def note(self, text: str) -> None:
        """A line for the user above the bar (on stderr even when the bar is off: a restart is news)."""
        tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
