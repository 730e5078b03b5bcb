"""Spawn target of every stage process: imports the stage's module only in the child, so the
launcher's process never loads what only a stage needs (torch, tokenizers)."""

from __future__ import annotations

import importlib
from typing import Any


def run_stage(target: str, *args: Any) -> None:
    """target is "package.module:function"."""
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)
