"""Errors raised on bad data. Each message names the file, row or field at fault and how to fix it.

A dataset is checked whole before one of its problems is reported: a user who fixes the first
of twenty bad rows should not have to rerun nineteen times to meet the rest. So the readers and
the snapshot planner add each row's :class:`DataError` to a :class:`Problems` and keep going;
:meth:`Problems.raise_if_any` then raises one error listing the first :data:`MAX_REPORTED` of
them and how many more there were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

MAX_REPORTED = 20  # problems listed in one error; the rest are counted ("... and 37 more")


class DataError(ValueError):
    """Input data is malformed, missing or inconsistent. Nothing has been written when it is raised."""


class DataErrors(DataError):
    """Several problems of one dataset, reported together: ``problems`` (the first few) of ``total``."""

    def __init__(self, problems: list[str], total: int):
        self.problems, self.total = list(problems), total
        lines = [f"{total} problems in the data; fix them all, then rerun:"]
        lines += [f"  {p}" for p in self.problems]
        if total > len(self.problems):
            lines.append(f"  ... and {total - len(self.problems)} more")
        super().__init__("\n".join(lines))


class Problems:
    """The problems met so far while reading one dataset; at most ``limit`` messages are kept."""

    def __init__(self, limit: int = MAX_REPORTED):
        self.limit, self.kept, self.total = limit, [], 0

    def __bool__(self) -> bool:
        return self.total > 0

    def add(self, error: DataError | str) -> None:
        if isinstance(error, DataErrors):
            for message in error.problems:
                self.add(message)
            self.total += error.total - len(error.problems)  # counted there, not listed
            return
        self.total += 1
        if len(self.kept) < self.limit:
            self.kept.append(str(error))

    @contextmanager
    def collect(self) -> Iterator[None]:
        """Record a DataError raised in the block instead of letting it stop the reading."""
        try:
            yield
        except DataError as e:
            self.add(e)

    def raise_if_any(self) -> None:
        """One problem raises as itself; several as one :class:`DataErrors` listing them."""
        if self.total == 1:
            raise DataError(self.kept[0])
        if self.total:
            raise DataErrors(self.kept, self.total)
