"""Byte sizes as users write them on the command line ('2GiB', '512MB', '1000000'), read once
where options are parsed (the CLI, the server, the benchmarks)."""

from __future__ import annotations

import re

from ipc.errors import ConfigError

# Suffix (lower case) -> bytes: kb, mb, gb are decimal; k, m, g alone are binary, like kib.
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MiB', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read a size from {text!r} (use e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(size: int) -> str:
    """Bytes as a user would write them, and parse_bytes reads back: 1<<30 -> '1GiB'
    (a default in --help)."""
    for suffix, unit in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
