"""The pipeline's user side, in three sub-packages: `runtime` (launcher, client), `server` (the
HTTP front end) and `tools` (benchmarks, datasets, random models, the default model), plus the
command line (`cli`). The names most programs need are importable from here:

    from pipeline import ModelInfo, Pipeline, PipelineConfig, SamplingParams
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Pipeline": "pipeline.runtime.launcher",
    "PipelineClient": "pipeline.runtime.client",
    "PipelineConfig": "ipc.config",
    "ModelInfo": "ipc.config",
    "SchedulerConfig": "ipc.config",
    "ExecutorConfig": "ipc.config",
    "SamplingParams": "ipc.messages",
    "ChatMessage": "ipc.messages",
}


def __getattr__(name: str) -> Any:
    """Imported on first use, so `python -m pipeline.tools.x` does not load the launcher."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
