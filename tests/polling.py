"""Wait for a condition instead of sleeping a fixed time and hoping it holds.

A test that sleeps 0.1 s and then asserts passes on a quiet machine and fails on a busy one.
``wait_until`` polls the condition until it holds or a generous deadline passes, so a fast
machine waits a few milliseconds and a slow one still passes; only a condition that never
comes true costs the full timeout (and fails, naming what was awaited).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

TIMEOUT_S = 60.0  # generous: a busy CI machine, not a bug, is the usual reason a condition is late


def _message(what: str | Callable[[], Any], timeout: float) -> str:
    detail = what() if callable(what) else what
    return f"not true within {timeout:g} s: {detail}"


def poll_until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, interval: float = 0.01) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy or ``timeout`` s
    pass; return its last value (falsy at the deadline). For a caller that reports the outcome
    itself (a helper that returns whether it happened); a test that needs it uses ``wait_until``.

    ``predicate`` may raise to stop at once, e.g. an assert that the process being watched still runs."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, interval: float = 0.01,
               what: str | Callable[[], Any] = "the condition") -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy; return that value.

    Raises ``AssertionError`` after ``timeout`` s naming ``what`` (a string, or a callable called
    then, e.g. to show the state that was being waited on, or a log's tail)."""
    value = poll_until(predicate, timeout, interval)
    if not value:
        raise AssertionError(_message(what, timeout))
    return value


async def async_wait_until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, interval: float = 0.01,
                           what: str | Callable[[], Any] = "the condition") -> T:
    """``wait_until`` for code on an event loop: sleeps with ``asyncio.sleep`` so other tasks run."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_message(what, timeout))
        await asyncio.sleep(interval)
