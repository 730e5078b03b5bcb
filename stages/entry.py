"""Spawn target of every stage process: imports the stage's module only in the child, so the
launcher's process never loads what only a stage needs (torch, tokenizers)."""

from __future__ import annotations

import gc
import importlib
from typing import Any


def run_stage(target: str, *args: Any) -> None:
    """target is "package.module:function". Its module is imported with the cyclic garbage
    collector paused (the imports, torch's above all, allocate much and free little), and
    whatever lives when the stage ends is frozen out of the collector's sight: the
    interpreter's last collection would otherwise walk torch's objects for ~0.5 s at every
    stop (the memory goes back to the system with the process anyway)."""
    module, _, function = target.partition(":")
    gc.disable()
    try:
        entry = getattr(importlib.import_module(module), function)
    finally:
        gc.enable()
    try:
        entry(*args)
    finally:
        gc.freeze()
