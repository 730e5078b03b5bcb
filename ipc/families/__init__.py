"""The model registry, torch-free: each `model_type` the engine runs, the module of
ipc/families/ that reads its config into an ArchSpec, and the executor module that builds it
(stages/executor/models/). The launcher refuses a model before any stage starts by reading
this table; the executor builds from it. Adding a family is a spec reader here, a module
there (both built from the shared parts), a line in FAMILIES and its test against
transformers (docs/ARCHITECTURE.md, "Adding a model family")."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ipc.arch import ArchSpec, UnsupportedModel


@dataclass(frozen=True)
class Family:
    reader: str  # "ipc.families.<module>:<function>": the config's spec
    builder: str  # "stages.executor.models.<module>:<class>": the model (imports torch)

    def spec(self, cfg: dict, source: str) -> ArchSpec:
        module, name = self.reader.split(":")
        read: Callable[[dict, str], ArchSpec] = getattr(importlib.import_module(module), name)
        return read(cfg, source)


_LLAMA = Family("ipc.families.llama:llama_spec", "stages.executor.models.llama:Llama")
_GEMMA = "stages.executor.models.gemma:Gemma"
_OLMO = Family("ipc.families.olmo:olmo_spec", "stages.executor.models.olmo:Olmo")
_MOE = "stages.executor.models.moe:MoECausalLM"

FAMILIES: dict[str, Family] = {
    # dense
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "phi3": _LLAMA,
    "smollm3": _LLAMA,
    "olmo2": _OLMO,
    "olmo3": _OLMO,
    "gemma": Family("ipc.families.gemma:gemma_spec", _GEMMA),
    "gemma2": Family("ipc.families.gemma:gemma2_spec", _GEMMA),
    "gemma3_text": Family("ipc.families.gemma:gemma2_spec", _GEMMA),
    # (the multimodal checkpoint: its language model runs, its vision tower is not loaded)
    "gemma3": Family("ipc.families.gemma:gemma2_spec", _GEMMA),
    # mixtures of experts
    "qwen2_moe": Family("ipc.families.moe:qwen_moe_spec", _MOE),
    "qwen3_moe": Family("ipc.families.moe:qwen_moe_spec", _MOE),
    "olmoe": Family("ipc.families.moe:olmoe_spec", _MOE),
    "mixtral": Family("ipc.families.moe:mixtral_spec", "stages.executor.models.moe:Mixtral"),
    "gpt_oss": Family("ipc.families.gpt_oss:gpt_oss_spec",
                      "stages.executor.models.gpt_oss:GptOss"),
}

# Families refused by name, with what they lack (family_of adds what the engine runs instead).
REFUSED: dict[str, str] = {
    "deepseek_v2": "DeepSeek's multi-head latent attention (MLA) is not implemented",
    "deepseek_v3": "DeepSeek's multi-head latent attention (MLA) is not implemented",
    "qwen3_next": "Qwen3-Next's hybrid linear attention (Gated DeltaNet) is not implemented",
    "qwen3_5": "Qwen3.5's hybrid linear attention (Gated DeltaNet) is not implemented",
    "qwen3_5_moe": "Qwen3.5's hybrid linear attention (Gated DeltaNet) is not implemented",
    "llama4": "Llama 4 (chunked attention, interleaved NoPE, a vision tower) is not "
              "implemented",
    "llava": "vision towers are not implemented",
    "qwen2_vl": "vision towers are not implemented",
    "qwen2_5_vl": "vision towers are not implemented",
    "gemma3n": "Gemma 3n (per-layer inputs, AltUp, LAuReL, KV-shared layers, activation "
               "sparsity, audio and vision towers) is not implemented",
    "gemma3n_text": "Gemma 3n (per-layer inputs, AltUp, LAuReL, KV-shared layers, "
                    "activation sparsity) is not implemented",
    "gemma4": "Gemma 4 (per-layer inputs, KV-shared layers, keys as values, global layers "
              "of another head size and KV heads, mixture-of-experts blocks, audio and "
              "vision towers) is not implemented",
    "gemma4_text": "Gemma 4 (per-layer inputs: hidden_size_per_layer_input; KV-shared "
                   "layers: num_kv_shared_layers; keys as values: attention_k_eq_v; global "
                   "layers of another head size and KV heads; enable_moe_block) is not "
                   "implemented",
}


def family_of(cfg: dict, source: str) -> Family:
    """The registered family of a config, or UnsupportedModel naming its model_type."""
    model_type = cfg.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is not None:
        return family
    why = REFUSED.get(model_type, "this family is not implemented")  # type: ignore[arg-type]
    raise UnsupportedModel(f"{source}: model_type = {model_type!r}: {why} (the engine runs "
                           f"{', '.join(sorted(FAMILIES))})")


def arch_spec(cfg: dict, source: str = "config.json") -> ArchSpec:
    """The spec of a config, by its family's reading (ipc/families/), or UnsupportedModel
    naming the field the engine lacks."""
    return family_of(cfg, source).spec(cfg, source)


def read_config(model_dir: str | Path) -> tuple[dict, ArchSpec]:
    """A model folder's config.json and what the engine reads of it (the one reader: the
    launcher's checks, ModelInfo and the executor all come here); refuses what the engine
    does not implement before any weight loads."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    return cfg, arch_spec(cfg, str(path))
