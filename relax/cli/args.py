"""How every ``relax`` sub-command reads its config from the command line: at most one preset or
config file, then ``key=value`` overrides."""

from __future__ import annotations

from collections.abc import Sequence

from relax.config import ConfigError, RelaxConfig, load_config


class CommandError(Exception):
    """A command's arguments name nothing it can work on (a root with no runs); ``relax`` prints one line."""


def split_overrides(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``key=value`` overrides from positional arguments."""
    overrides = [t for t in tokens if "=" in t and not t.startswith(("/", ".", "s3:", "file:"))]
    positional = [t for t in tokens if t not in overrides]
    return positional, overrides


def config_from_args(tokens: Sequence[str]) -> RelaxConfig:
    """``[preset or config file] [key=value ...]`` -> the config; ConfigError on two positionals."""
    positional, overrides = split_overrides(tokens)
    if len(positional) > 1:
        raise ConfigError(f"expected at most one preset or config file, got {positional}; overrides look like "
                          f"key=value")
    return load_config(positional[0] if positional else None, overrides)
