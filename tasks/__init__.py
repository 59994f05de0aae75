"""Flyte tasks: thin wrappers that declare resources, caching and retries and call one relax function."""

from tasks.config_type import register as _register_config_type

_register_config_type()  # before any task module declares an interface that names RelaxConfig
