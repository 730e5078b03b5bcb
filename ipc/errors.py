"""Errors the bottom layer raises and every layer above catches by type (their own module, so
that the modules that raise them, ipc/config.py, ipc/arch.py and the small readers beside
them, need not import one another for it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration a user can fix; the message says how."""
