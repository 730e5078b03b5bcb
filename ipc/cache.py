"""Where the pipeline keeps what it builds once and reuses (the default model, compiled graphs
and kernels, the benchmarks' peers). Read by the launcher's tools and the executor; this is the
one place LLM_PIPELINE_CACHE is read."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LLM_PIPELINE_CACHE"


def cache_dir() -> Path:
    """Root of the pipeline's cache (the default model, compiled graphs, the benchmarks'
    peers): ``$LLM_PIPELINE_CACHE`` or ``~/.cache/llm-pipeline``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "llm-pipeline"
