"""Documented config fields: what every dataclass field of the config tree is declared with.

A field's ``help`` (and its ``choices`` or numeric ``range``, where it has one) sits in the
dataclass field metadata: ``relax.config_checks`` validates against it and ``relax config docs``
renders it as docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


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
