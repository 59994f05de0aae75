"""The error every config check raises: a value, key or file is wrong, and the message names it and the fix.

Its own module so that the checks can live in several files (``relax.config_checks``,
``relax.config_mode_checks``) without importing each other in a circle.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value, key or file is wrong. The message names it and the fix."""
