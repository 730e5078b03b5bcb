"""Errors the bottom layer raises and every layer above catches by type (their own module, so
that ipc/config.py and ipc/arch.py, which both raise them, do not import each other)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration a user can fix; the message says how."""
