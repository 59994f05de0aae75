"""Errors raised on bad data. Each message names the file, row or field at fault and how to fix it."""


class DataError(ValueError):
    """Input data is malformed, missing or inconsistent. Nothing has been written when it is raised."""
