"""Documented, strictly read config fields: how every field of the tree is declared and enforced.

A field's ``help`` (and its ``choices`` or numeric ``range``, where it has one) sits in the
dataclass field metadata (:func:`opt`). :func:`build` turns a (partial) mapping into the dataclass
tree, naming the closest valid key for a typo and the accepted type for a wrong value;
:func:`check_fields` enforces every field's ``choices`` and ``range``. ``relax config docs`` renders
the same metadata as docs/configuration.md. Every config check raises :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config value, key or file is wrong. The message names it and the fix."""


def opt(default: Any, help: str, *, choices: tuple | None = None, range: tuple | None = None) -> Any:
    """A documented config field. ``range`` is ``(low, high)`` inclusive; either end may be None."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if range is not None:
        meta["range"] = range
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


def build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of fields, got {type(data).__name__}: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint} (valid in {where}: {', '.join(fields)})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, prefix + name + ".")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Accept what a YAML file or a command line would naturally give; reject the rest."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list (e.g. {name}=[a,b]), got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{name}: unsupported field type {tp}")  # a bug in relax.config, not user input


def check_fields(cfg: Any, prefix: str = "") -> None:
    """Check every field's choices and range, recursively (the rules that span fields are the sections')."""
    for f in dataclasses.fields(cfg):
        name = prefix + f.name
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, name + ".")
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{name} = {value!r} is not accepted{hint}; choose one of {list(choices)}")
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
            raise ConfigError(f"{name} = {value!r} is not a finite number; give a value in the field's range")
        bounds = f.metadata.get("range")
        if bounds is not None:
            lo, hi = bounds
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ConfigError(f"{name} = {value!r} is out of range; accepted: {lo} <= {name} <= {hi}")
