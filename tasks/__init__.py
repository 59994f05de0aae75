"""Flyte tasks: thin wrappers that declare resources, caching and retries and call one relax function."""
