"""Which modules may run as the rollout's SGLang server: SGLang's entry point, or a declared stand-in."""

from __future__ import annotations

import sys

import pytest

from relax.config.preflight import server_module_problem


@pytest.mark.parametrize(("source", "allowed"), [
    ("RELAX_SGLANG_STAND_IN = True\n", True),
    ("RELAX_SGLANG_STAND_IN = 1\n", False),  # the marker is the constant True, nothing truthy
    ("if True:\n    RELAX_SGLANG_STAND_IN = True\n", False),  # at top level only
    ("x = 1\n", False),
])
def test_a_stand_in_must_declare_itself_and_is_read_not_run(tmp_path, monkeypatch, source, allowed):
    ran = tmp_path / "ran"
    (tmp_path / "standin_mod.py").write_text(f"open({str(ran)!r}, 'w').close()\n{source}")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = server_module_problem("standin_mod")
    assert (why is None) == allowed, why
    assert not ran.exists(), "the check ran the module"
    sys.modules.pop("standin_mod", None)


def test_sglangs_own_entry_point_and_the_test_stand_in_pass():
    assert server_module_problem("sglang.launch_server") is None  # whether or not sglang is installed here
    assert server_module_problem("tests.relax.engines.sglang.stand_in_server") is None
    assert "is neither" in server_module_problem("http.server")
