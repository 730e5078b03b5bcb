"""What every stage knows of the model, read from its Hugging Face folder without torch
(`ModelInfo`), and the fingerprint a stage joining from another host must match. Used by the
launcher, every stage, and the tests' in-process engine."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ipc.errors import ConfigError
from ipc.families import read_config


@dataclass(frozen=True)
class ModelInfo:
    """What every stage needs to know of the model, read from its folder without torch."""

    path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    mixture_of_experts: bool = False  # (ArchSpec.moe) the compiled forward lacks it
    # (ArchSpec.kv_windows) each KV group's window: the layers whose blocks are kept apart
    kv_windows: tuple[int | None, ...] = (None,)

    @classmethod
    def from_dir(cls, path: str | Path, max_model_len: int | None = None) -> ModelInfo:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is not a Hugging Face model folder (no config.json)")
        config, spec = read_config(path)  # a model the engine lacks: refused
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # (the spec's: a multimodal config's are its language model's, text_config)
        limit = int(spec.max_positions or 2048)
        if max_model_len is not None and max_model_len > limit:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's {limit}")
        return cls(str(path), max_model_len or limit, spec.vocab_size, eos_ids,
                   spec.moe is not None, spec.kv_windows)


def model_fingerprint(path: str | Path) -> str:
    """What a joining stage's model folder must share with the launcher's: its config and
    its tokenizer (a hash of config.json and tokenizer.json; the weights are not read)."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        file = Path(path) / name
        digest.update(file.read_bytes() if file.is_file() else b"-")
    return digest.hexdigest()[:16]
