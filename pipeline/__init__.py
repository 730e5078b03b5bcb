"""The pipeline's user side, in three sub-packages: `runtime` (launcher, client), `server` (the
HTTP front end) and `tools` (benchmarks, datasets, random models, the default model), plus the
command line (`cli`). The names most programs need are importable from here:

    from pipeline import LLM, SamplingParams  # the offline API (pipeline/offline.py)
    from pipeline import ModelInfo, Pipeline, PipelineConfig  # the pipeline itself
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Pipeline": "pipeline.runtime.launcher",
    "PipelineClient": "pipeline.runtime.client",
    "PipelineConfig": "ipc.config",
    "ModelInfo": "ipc.model_info",
    "SchedulerConfig": "ipc.config",
    "ExecutorConfig": "ipc.config",
    "LLM": "pipeline.offline",
    "LoRARequest": "pipeline.offline",
    "SamplingParams": "ipc.messages",
    "StructuredOutputs": "ipc.messages",
    "ChatMessage": "ipc.messages",
}


def _version() -> str:
    """The installed distribution's version, or the checkout's pyproject.toml's."""
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("llm-pipeline")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        for line in pyproject.read_text().splitlines():
            if line.startswith("version ="):
                return line.split("=", 1)[1].strip().strip('"')
        return "unknown"


def __getattr__(name: str) -> Any:
    """Imported on first use, so `python -m pipeline.tools.x` does not load the launcher."""
    if name == "__version__":
        return _version()
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
