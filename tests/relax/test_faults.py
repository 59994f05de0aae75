"""RELAX_FAULT: its grammar, which step and attempt it fires at, and how it fires in a shared
process (an exception) and in a role's own process (SIGKILL, nothing after it runs)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from relax import faults
from relax.faults import FaultSpec, InjectedFault, fault_point, parse_faults


def test_specs_parse_with_optional_step_and_attempts():
    assert parse_faults("actor:recorded:3:1, advantage:start,rollout:step:*") == [
        FaultSpec("actor", "recorded", 3, 1), FaultSpec("advantage", "start", None, None),
        FaultSpec("rollout", "step", None, None)]


@pytest.mark.parametrize("bad", ["actor", "actr:start", "actor:nowhere", "actor:step:x", "actor:step:1:2:3"])
def test_a_malformed_spec_is_refused_naming_it_and_the_grammar(bad):
    with pytest.raises(ValueError, match=rf"'{bad}'.*ROLE:POINT\[:STEP\[:ATTEMPTS\]\]"):
        parse_faults(bad)


def test_attempts_limit_which_restarts_see_the_fault():
    spec = FaultSpec("actor", "recorded", 3, 1)
    assert spec.matches("actor", "recorded", 3, attempt=0)
    assert not spec.matches("actor", "recorded", 3, attempt=1)  # the restart goes on
    assert not spec.matches("actor", "recorded", 2, attempt=0)  # another step
    assert not spec.matches("advantage", "recorded", 3, attempt=0)  # another role
    assert FaultSpec("actor", "step", None, None).matches("actor", "step", 7, attempt=5)  # every time


def test_in_a_shared_process_the_fault_is_an_exception(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "advantage:recorded:2:1")
    monkeypatch.setattr(faults._State, "own_process", False)
    faults.set_attempt(0)
    fault_point("advantage", "recorded", 1)  # not this step
    with pytest.raises(InjectedFault, match=r"advantage:recorded:2 \(attempt 0"):
        fault_point("advantage", "recorded", 2)
    faults.set_attempt(1)
    fault_point("advantage", "recorded", 2)  # the restart is spared
    faults.set_attempt(0)
    monkeypatch.setenv(faults.FAULT_ENV, "actor:step:5")  # a new value is read, not the first one kept
    fault_point("advantage", "recorded", 2)
    with pytest.raises(InjectedFault, match="actor:step:5"):
        fault_point("actor", "step", 5)


def test_in_a_role_process_the_fault_is_a_sigkill():
    code = ("import os; os.environ['RELAX_FAULT'] = 'actor:publish:4'\n"
            "from relax.faults import fault_point, set_role_process\n"
            "set_role_process(0); fault_point('actor', 'publish', 3); print('survived 3', flush=True)\n"
            "fault_point('actor', 'publish', 4); print('survived 4', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.splitlines() == ["survived 3", "injected fault actor:publish:4 (attempt 0, "
                                                   "RELAX_FAULT=actor:publish:4)"]
