"""Progress marks: how a watchdog tells a role that waits for input from one that is stuck.

A role's main thread calls :func:`mark` wherever it demonstrably moves: after each step, and
on every poll of every wait (the queue's, a consumer group's, the weight store's: all go
through ``relax.transfer.polling.Backoff``). A role waiting for input therefore keeps marking,
several times a second at first and at least once per ``max_poll_interval_s``; a role frozen
(SIGSTOP), deadlocked (a collective that never completes) or blocked in a call that never
returns (a stuck NFS or S3 request) stops marking. ``relax.services.heartbeat`` publishes the
last mark to the run root, where the supervisor reads it.

Process-wide on purpose: a disaggregated role and a Ray Serve replica each run one role per
process. Marking is two attribute writes, cheap enough for every poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

WAITING = "waiting for input"
WORKING = "working"
STARTING = "starting"


@dataclass
class Mark:
    at: float  # wall-clock time of the last progress (time.time(): the reader may be on another host)
    state: str  # STARTING, WAITING or WORKING
    step: int | None  # the last step done, when the role reported one
    max_gap_s: float  # the longest time between two marks since the role started: what a timeout must exceed


_last = Mark(time.time(), STARTING, None, 0.0)


def mark(state: str = WORKING, step: int | None = None) -> None:
    """Record progress now; ``step`` (after a step) is kept until the next step replaces it."""
    global _last
    now = time.time()
    _last = Mark(now, state, step if step is not None else _last.step, max(_last.max_gap_s, now - _last.at))


def reset() -> None:
    """A role (re)starts in this process: progress counts from now, and no step is done yet."""
    global _last
    _last = Mark(time.time(), STARTING, None, 0.0)


def last() -> Mark:
    return _last
