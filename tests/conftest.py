"""Shared fixtures: the tiny offline model, the default model (when it can be set up)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/tiny_model.py

from tiny_model import build_tiny_llama


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Compiled graphs go to one cache of the test session (its stages inherit it), never to
    the user's: the first compile of each shape is cold, later ones in the session warm."""
    import os

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels() -> None:
    """The CPU kernels are built (first use on a machine: ~10-20 s) before any test, so that
    no pipeline's start-up in a timed test pays for the compile."""
    from stages.executor import kernels

    kernels.load()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pipeline.tools.model_cache import ModelSetupError, ensure_default_model

    try:
        return ensure_default_model()
    except ModelSetupError as exc:
        pytest.skip(f"default model unavailable: {exc}")
