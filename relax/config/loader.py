"""Load, override, validate and serialise ``RelaxConfig``.

A config is built in three layers: the dataclass defaults (the ``tiny-cpu`` preset), then
a preset name or YAML file, then ``key=value`` overrides (``rollout.temperature=0.7``,
``data.tasks=[arithmetic,shapes]``). Every layer is checked strictly: an unknown key
names the closest valid one, a wrong type or out-of-range value names the field and what
it accepts. Nothing is written anywhere while loading.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
import yaml

from relax.config.fields import ConfigError, build
from relax.config.tree import RelaxConfig, validate

PRESETS_DIR = Path(__file__).parents[1] / "presets"
DEFAULT_PRESET = "tiny-cpu"
# settings an earlier Relax had and this one removed (docs/history/): a run saved with one of them
# at its off value resumes; a run that used one cannot be reproduced by this version
REMOVED_FIELDS = {"data": ("task_repeats",), "rollout": ("explore_answers",), "trainer": ("frozen_params",)}


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_config(source: str | None = None, overrides: Sequence[str] = ()) -> RelaxConfig:
    """``source``: a preset name, a YAML/JSON file (any fsspec URL), or None for ``tiny-cpu``."""
    data = _read_source(source or DEFAULT_PRESET)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=1.5"`` -> ``("a.b", 1.5)``; values are parsed as YAML scalars or lists."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def config_from_dict(data: Mapping[str, Any]) -> RelaxConfig:
    cfg = build(RelaxConfig, data, prefix="")
    validate(cfg)
    return cfg


def saved_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config as a run saved it (run.json) with the removed settings dropped; ConfigError when the
    run used one of them, since this version cannot reproduce it."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for section, names in REMOVED_FIELDS.items():
        for name in names:
            value = out.get(section, {}).pop(name, None)
            if value:
                raise ConfigError(f"the run was made with {section}.{name}={value!r}, a setting this version of Relax "
                                  f"removed (docs/history/README.md); use the Relax version that made the run")
    return out


def config_to_dict(cfg: RelaxConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: RelaxConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_hash(cfg: RelaxConfig) -> str:
    """Stable content hash of a config (lineage records name it). The report section is left out:
    where metrics go changes nothing a run computes, and a rerun may change it."""
    computed = {k: v for k, v in config_to_dict(cfg).items() if k != "report"}
    blob = json.dumps(computed, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _read_source(source: str) -> dict[str, Any]:
    if source in list_presets():
        path = str(PRESETS_DIR / f"{source}.yaml")
    elif source.endswith((".yaml", ".yml", ".json")):
        path = source
    else:
        close = difflib.get_close_matches(source, list_presets(), n=1)
        hint = f"did you mean preset {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{source!r} is neither a preset nor a .yaml/.json file; {hint}presets: {', '.join(list_presets())}"
        )
    try:
        with fsspec.open(path, "r") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {p} is a value, not a section")
        node = child
    node[leaf] = value


