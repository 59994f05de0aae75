"""Poll delays grow with the time already waited, so a waiter is late by a bounded fraction."""

from __future__ import annotations

import pytest

from relax.transfer.polling import Backoff


def test_delay_is_a_quarter_of_the_wait_between_first_and_maximum():
    now = [100.0]
    b = Backoff(first=0.05, maximum=1.0, ratio=0.25, clock=lambda: now[0])
    # waited 0 s -> max(0.05, 0) = 0.05; 0.4 s -> 0.1; 2 s -> 0.5; 10 s -> 2.5, capped at 1.0
    for waited, expected in ((0.0, 0.05), (0.4, 0.1), (2.0, 0.5), (10.0, 1.0)):
        now[0] = 100.0 + waited
        assert b.next() == pytest.approx(expected)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="first <= maximum"):
        Backoff(first=1.0, maximum=0.5)
