"""The progress a topology shows while a run trains: a tqdm bar on a terminal, lines in a log.

When stderr is not a terminal (a log file, CI, a Flyte task) a bar's carriage returns make one
unreadable line, so the run prints a compact line instead (``step k/N  reward r  samples/s x  ETA t``)
each time it passes another tenth of its steps, and at its last step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


def eta_text(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: the time left, to the unit that matters."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Actor steps with reward, staleness and samples/s: a bar on a terminal, else a line per tenth."""

    def __init__(self, total: int, start: int, enabled: bool, stream: TextIO | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.lines = enabled and not self.stream.isatty()
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled or self.lines,
                        dynamic_ncols=True, file=self.stream)
        self.total, self.start, self.done = total, start, start
        self.every = max(1, math.ceil(total / 10))  # a line at least every 10% of the run
        self.reward = float("nan")
        self.t0, self.samples = time.perf_counter(), 0

    def rollout(self, m: dict[str, Any]) -> None:
        self.reward = m.get("reward", self.reward)

    def actor(self, m: dict[str, Any]) -> None:
        self.samples += m.get("samples", 0)
        sps = self.samples / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix(reward=f"{self.reward:.3f}", stale=m.get("staleness_max", 0), sps=f"{sps:.0f}",
                             refresh=False)
        step = m.get("step")  # a restarted actor reports its redone step again: count steps, not records
        before = self.done
        self.done = self.done + 1 if step is None else max(self.done, int(step) + 1)
        self.bar.update(self.done - before)
        if self.lines and self.done > before and (self.done // self.every > before // self.every
                                                  or self.done >= self.total):
            self._line(sps)

    def follow(self, actor: Any, rollout: Any) -> None:
        """Feed the new records of two ``MetricsReader``s (relax.services.report.metrics); the rollout's
        are read only when the actor stepped (the line may move then): one listing less per idle poll."""
        stepped = actor.new()
        if stepped:
            for m in rollout.new():
                self.rollout(m)
        for m in stepped:
            self.actor(m)

    def _line(self, sps: float) -> None:
        elapsed = time.perf_counter() - self.t0
        per_step = elapsed / max(self.done - self.start, 1)
        reward = "?" if math.isnan(self.reward) else f"{self.reward:.3f}"  # no rollout record read yet
        print(f"step {self.done}/{self.total}  reward {reward}  samples/s {sps:.1f}  "
              f"ETA {eta_text(per_step * (self.total - self.done))}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line for the user above the bar (on stderr even when the bar is off: a restart is news)."""
        tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
