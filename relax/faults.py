"""Deterministic fault injection: make a named role die at a named point, so that every repair
path is tested on purpose rather than reached by chance (docs/runtime.md, "Fault injection").

``RELAX_FAULT`` holds comma-separated specs ``ROLE:POINT[:STEP[:ATTEMPTS]]``:

* ROLE: ``actor``, ``advantage``, ``reference``, ``critic``, ``reward``, ``rollout`` or ``engine``
  (a native engine server);
* POINT: one of :data:`POINTS`;
* STEP: the step (batch for the rollout, weight version for ``publish`` and ``engine`` points)
  at which it fires; ``*`` or nothing = every step;
* ATTEMPTS: it fires only in the role's first ATTEMPTS attempts (0 = the first run, 1 = its
  first restart, ...), so ``actor:recorded:3:1`` kills the actor once and its restart goes on;
  nothing = every attempt (the fault repeats, which is how the restart limit is tested). An
  engine's attempt is its rollout's attempt plus the launches before its own (replacements
  count up), so ``engine:start::1`` kills only the first engines of the first rollout.

A role in a process of its own (``relax role``, an engine server) dies as if SIGKILLed: no
``finally`` runs, nothing is flushed, exactly what an OOM kill or a lost node does. A role that
shares its process with others (colocated, a Ray Serve replica) gets :class:`InjectedFault`
instead, which its supervisor handles like any role failure. No spec, no cost: one dict lookup.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

FAULT_ENV = "RELAX_FAULT"
ATTEMPT_ENV = "RELAX_ROLE_ATTEMPT"  # set by the supervisor for a restarted role process

# where a role can be made to die, in the order a step meets them
POINTS = {
    "start": "the role is built and about to take its first step",
    "recorded": "a consumer recorded step STEP's samples but has not committed (or trained on) them yet",
    "step": "step STEP is done and reported",
    "midway": "half of rollout batch STEP's episodes are closed, the rest still open (external agents only)",
    "publish": "the actor wrote weight version STEP's files but not its manifest",
    "load": "an engine server is loading weight version STEP",
}
ROLES = ("actor", "advantage", "reference", "critic", "reward", "teacher", "rollout", "engine")


class InjectedFault(RuntimeError):
    """A fault ``RELAX_FAULT`` asked for, in a role that shares its process."""


@dataclass(frozen=True)
class FaultSpec:
    role: str
    point: str
    step: int | None  # None: every step
    attempts: int | None  # None: every attempt

    def matches(self, role: str, point: str, step: int | None, attempt: int) -> bool:
        return (self.role == role and self.point == point and (self.step is None or self.step == step)
                and (self.attempts is None or attempt < self.attempts))


def parse_faults(text: str) -> list[FaultSpec]:
    """``RELAX_FAULT``'s value -> specs; a malformed one raises ValueError naming it and the grammar."""
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        grammar = f"write ROLE:POINT[:STEP[:ATTEMPTS]] with ROLE in {ROLES} and POINT in {tuple(POINTS)}"
        if not 2 <= len(parts) <= 4 or parts[0] not in ROLES or parts[1] not in POINTS:
            raise ValueError(f"{FAULT_ENV} spec {item!r} is malformed: {grammar}")
        try:
            step = None if len(parts) < 3 or parts[2] in ("", "*") else int(parts[2])
            attempts = None if len(parts) < 4 or parts[3] == "" else int(parts[3])
        except ValueError:
            raise ValueError(f"{FAULT_ENV} spec {item!r}: STEP and ATTEMPTS are integers ({grammar})") from None
        specs.append(FaultSpec(parts[0], parts[1], step, attempts))
    return specs


class _State:
    own_process = False  # this process runs one role alone: a fault kills it
    attempt = int(os.environ.get(ATTEMPT_ENV, "0") or 0)
    text = ""  # the RELAX_FAULT value ``specs`` was parsed from (it may change, in tests)
    specs: list[FaultSpec] = []


def set_role_process(attempt: int | None = None) -> None:
    """Declare this process a role's own (``relax role``, an engine server): faults kill it."""
    _State.own_process = True
    if attempt is not None:
        _State.attempt = attempt


def current_attempt() -> int:
    """The attempt of the role running in this process (what child processes it starts inherit)."""
    return _State.attempt


def set_attempt(attempt: int) -> None:
    """The attempt of the roles in this process (in-process restarts count it themselves)."""
    _State.attempt = attempt


def fault_point(role: str, point: str, step: int | None = None) -> None:
    """Die here if ``RELAX_FAULT`` names this role, point and step for the current attempt."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    if text != _State.text:
        _State.specs, _State.text = parse_faults(text), text
    if not any(s.matches(role, point, step, _State.attempt) for s in _State.specs):
        return
    where = f"{role}:{point}" + ("" if step is None else f":{step}")
    what = f"injected fault {where} (attempt {_State.attempt}, {FAULT_ENV}={text})"
    if _State.own_process:
        print(what, flush=True)  # stdout: the role's log says why it died; SIGKILL leaves no traceback
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(what)
