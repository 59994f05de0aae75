"""Registries match the config's choices; lookup errors; the package stays pure torch."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import relax.algorithms as alg
from relax.config import AlgorithmConfig

PKG = Path(alg.__file__).resolve().parent

# config field -> (registry kind for lookup, registry)
FIELD_REGISTRY = {
    "advantage": alg.ADVANTAGES,
    "policy_loss": alg.POLICY_LOSSES,
    "loss_agg": alg.LOSS_AGG,
    "kl_estimator": alg.KL,
    "off_policy": alg.OFF_POLICY,
}


@pytest.mark.parametrize("field_name", sorted(FIELD_REGISTRY))
def test_registry_keys_are_the_config_choices(field_name):
    choices = {f.name: f.metadata.get("choices") for f in fields(AlgorithmConfig)}[field_name]
    assert set(FIELD_REGISTRY[field_name]) == set(choices)
    for name in choices:
        assert callable(alg.lookup(field_name, name))


def test_brief_registry_names():
    assert set(alg.ADVANTAGES) == {"grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert set(alg.POLICY_LOSSES) == {"ppo", "dual_clip", "gspo", "gspo_token", "cispo"}
    assert set(alg.LOSS_AGG) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
    assert set(alg.KL) == {"k1", "k2", "k3", "abs"}
    assert set(alg.OFF_POLICY) == {"none", "recompute", "decoupled", "tis", "icepop"}


def test_defaults_resolve():
    cfg = AlgorithmConfig()
    assert alg.lookup("advantage", cfg.advantage) is alg.grpo_advantages
    assert alg.lookup("policy_loss", cfg.policy_loss) is alg.ppo_loss
    assert alg.lookup("off_policy", cfg.off_policy) is alg.decoupled_weights


def test_lookup_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"unknown policy_loss 'grpo'; valid: cispo, dual_clip, gspo, gspo_token, ppo"):
        alg.lookup("policy_loss", "grpo")
    with pytest.raises(ValueError, match=r"unknown kl_estimator 'k4'; valid: abs, k1, k2, k3"):
        alg.lookup("kl_estimator", "k4")
    with pytest.raises(ValueError, match=r"unknown algorithm registry 'optimizer'; valid: advantage, kl_estimator"):
        alg.lookup("optimizer", "adam")


_FORBIDDEN = re.compile(r"^\s*(?:import|from)\s+(ray|flytekit|fsspec)\b", re.MULTILINE)
_RELAX_IMPORT = re.compile(r"^\s*(?:import|from)\s+(relax(?:\.[\w.]+)?)", re.MULTILINE)


def test_source_imports_no_ray_flyte_fsspec_or_other_relax():
    sources = sorted(PKG.glob("*.py"))
    assert len(sources) >= 7
    for path in sources:
        text = path.read_text()
        assert not _FORBIDDEN.search(text), f"{path.name} imports {_FORBIDDEN.search(text).group(1)}"
        for module in _RELAX_IMPORT.findall(text):
            assert module.startswith("relax.algorithms"), f"{path.name} imports {module}"


def test_import_loads_no_ray_flyte_fsspec():
    code = (
        "import sys, relax.algorithms\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'flytekit', 'fsspec'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent.parent, timeout=120)
    assert out.stdout.strip() == ""
