"""How long a waiter sleeps between polls of the store.

Roles in different processes learn about each other's commits only by polling the object
store (a listing per poll; on S3 each one is a request). Doubling backoff keeps the request
count low but makes a waiter late by up to the last delay: in a synchronous hand-off
(max_staleness 0) where each side waits ~0.3 s for the other, a waiter that has slept
0.05 + 0.1 + 0.2 s next sleeps 0.4 s, and a disaggregated step measured ~0.35 s of such
lateness on ~0.5 s of compute. Here the delay grows with the time already waited instead,
so lateness stays a fixed fraction of the wait, while a long wait still polls at most once
per ``maximum`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from relax import liveness


class Backoff:
    """Poll delays for one wait: ``max(first, ratio * waited)``, capped at ``maximum``.

    A waiter is then late by at most ``max(first, ratio * waited)`` after the event it waits
    for; the number of polls grows with the log of the wait (base ``1 + ratio``).
    """

    def __init__(self, first: float, maximum: float, ratio: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        if first <= 0 or maximum < first or ratio <= 0:
            raise ValueError(f"Backoff needs 0 < first <= maximum and ratio > 0, got {first}, {maximum}, {ratio}")
        self.first, self.maximum, self.ratio = first, maximum, ratio
        self.clock = clock
        self.start = clock()

    def next(self) -> float:
        """The delay before the next poll; a poll is progress (relax.liveness: waiting is not hung)."""
        liveness.mark(liveness.WAITING)
        waited = self.clock() - self.start
        return min(self.maximum, max(self.first, self.ratio * waited))
