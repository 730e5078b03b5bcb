"""What `--model` names, as the model folder every stage reads: nothing (the default model,
model_cache.py), a Hugging Face folder (as it is), or a GGUF file (`--model FILE.gguf`).

A GGUF file gets a folder of its own in the cache, made once in the user's process before
anything starts: config.json, generation_config.json and the tokenizer from the file's
metadata (transformers' GGUF reading, as llama.cpp reads them), and gguf.json naming the file
and its tensors' types (ipc/gguf_source.py). No weight is copied: the executor loads them
from the file, quantized ones kept in their blocks (stages/executor/gguf_loader.py). The
folder is keyed by the file's path, size and modification time, and named after the file,
so the served model name is the file's."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ipc.cache import cache_dir
from ipc.errors import ConfigError
from ipc.gguf_source import SOURCE_FILE, GgufSource, check_tensors, is_gguf
from pipeline.tools.gguf_families import OWN_CONFIG, general_fields, read_fields
from pipeline.tools.model_cache import (
    COMPLETE_MARKER,
    ensure_default_model,
    make_readable,
    publish,
    strip_keys,
)

logger = logging.getLogger(__name__)

GGUF_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", SOURCE_FILE)
_STRAY_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "quantization_config")
_STRAY_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file", "name_or_path")


def resolve_model(model: str | Path | None) -> Path:
    """The model folder for `--model` as given (None: the default model)."""
    if model is None:
        return ensure_default_model()
    path = Path(model)
    if is_gguf(path):
        return gguf_model_dir(path)
    if path.is_file():
        raise ConfigError(f"--model {model}: a file that is not GGUF; give a Hugging Face "
                          "model folder or a .gguf file")
    return path


def files_key(files: list[Path]) -> str:
    """A hex key of these files' paths, sizes and modification times: what is made from them
    once is made again when one is rewritten."""
    parts = []
    for file in files:
        stat = file.stat()
        parts.append(f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def gguf_folder_path(file: Path) -> Path:
    """Where the folder for GGUF `file` lies in the cache (made or not), keyed by files_key."""
    file = file.resolve()
    return cache_dir() / "gguf" / files_key([file])[:16] / file.stem


def gguf_model_dir(file: Path) -> Path:
    """The folder that stands for GGUF `file`, made first if need be (seconds, once)."""
    file = file.resolve()
    dest = gguf_folder_path(file)
    if (dest / COMPLETE_MARKER).is_file():
        return dest
    reader = _reader(file)  # (a parse takes seconds for a real vocabulary: once here)
    source = _source(file, reader)  # refused here, before the slow part, if it cannot load
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    started = time.monotonic()
    try:
        logger.info("reading the config and tokenizer of %s (once)", file)
        _write_folder(file, source, _extra_config(reader, source.architecture, file), tmp)
        (tmp / COMPLETE_MARKER).write_text(f"made from {file}\n")
        make_readable(tmp)
        publish(tmp, dest, lambda folder: (folder / COMPLETE_MARKER).is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s ready at %s (%.1fs)", file.name, dest, time.monotonic() - started)
    return dest


def read_source(file: Path) -> GgufSource:
    """The file's architecture and tensor types, or ConfigError naming what cannot load."""
    return _source(file, _reader(file))


def _reader(file: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(file))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--model {file}: not a readable GGUF file ({exc})") from None


def _source(file: Path, reader: Any) -> GgufSource:
    field = reader.fields.get("general.architecture")
    architecture = str(field.contents()) if field is not None else "?"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    check_tensors(str(file), architecture, types)
    return GgufSource(str(file), architecture, types)


# Metadata transformers' GGUF reader leaves out for some architectures, and the config
# fields they are: Qwen3's 128-wide heads of a 1024-wide model, a mixture of experts' widths
# and counts (a "llama" file with experts is Mixtral's). Gemma's and gpt-oss's, which
# llama.cpp partly fixes rather than reads, are gguf_families.py's.
_EXTRA_KEYS = {"attention.key_length": "head_dim",
               "expert_feed_forward_length": "moe_intermediate_size",
               "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
               "expert_count": "num_local_experts",
               "expert_used_count": "num_experts_per_tok"}


def _extra_config(reader: Any, architecture: str, file: Path) -> dict[str, Any]:
    fields = {key: reader.fields.get(f"{architecture}.{key}") for key in _EXTRA_KEYS}
    extra: dict[str, Any] = {_EXTRA_KEYS[key]: int(f.contents())
                             for key, f in fields.items() if f is not None}
    prefix = f"{architecture}."
    meta = {key[len(prefix):]: f.contents() for key, f in reader.fields.items()
            if key.startswith(prefix)}
    if architecture in OWN_CONFIG:  # (all from here: transformers' reading fails)
        tokenizer = {key: f.contents() for key, f in reader.fields.items()
                     if key.startswith("tokenizer.ggml.")}
        tied = all(t.name != "output.weight" for t in reader.tensors)
        extra = general_fields(meta, tokenizer, tied)
    return {**extra, **read_fields(meta, architecture, str(file))}


def _write_folder(file: Path, source: GgufSource, extra: dict[str, Any], out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    if source.architecture in OWN_CONFIG:
        config = AutoConfig.for_model(OWN_CONFIG[source.architecture], **extra)
    else:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    if config.model_type == "llama" and "num_local_experts" in extra:  # (Mixtral's layout)
        config = AutoConfig.for_model("mixtral", **{
            k: v for k, v in config.to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version")})
    for key, value in extra.items():
        setattr(config, key, value)
    reader = AutoTokenizer if source.architecture not in OWN_CONFIG else PreTrainedTokenizerFast
    tokenizer = reader.from_pretrained(str(file.parent), gguf_file=file.name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out, save_jinja_files=False)  # (the template in the config)
    strip_keys(out / "config.json", _STRAY_CONFIG_KEYS)
    strip_keys(out / "tokenizer_config.json", _STRAY_TOKENIZER_KEYS)
    if source.mxfp4_experts:  # (the experts load as a checkpoint's MXFP4 ones: gpt_oss.py)
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / SOURCE_FILE).write_text(source.to_json())
    missing = [name for name in GGUF_FOLDER_FILES if not (out / name).is_file()]
    if missing:
        raise ConfigError(f"{file}: its metadata gave no {', '.join(missing)}")
