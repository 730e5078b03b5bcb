"""LoRA adapters as every process sees them, without torch: the run's adapters
(`--lora-modules name=path`, `--max-loras`, `--max-lora-rank`) and the check of a PEFT
folder (adapter_config.json and the safetensors header of adapter_model.safetensors), so
that what the engine does not run is refused by name before any stage starts. The executor
loads the weights (stages/executor/lora.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipc.errors import ConfigError

# vLLM's gate of the runtime load/unload routes, honoured beside --enable-lora-updating
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target, by the module that holds them in a decoder layer.
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# An entry of adapter_model.safetensors: PEFT's name for a decoder layer's projection's A or B.
ENTRY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                   r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\."
                   r"weight")
# adapter_config.json fields the engine does not implement: refused when set (name: what it is)
_REFUSED = {"use_dora": "DoRA (weight-decomposed LoRA)",
            "modules_to_save": "modules_to_save (whole trained copies of modules)",
            "layers_to_transform": "layers_to_transform", "layers_pattern": "layers_pattern",
            "rank_pattern": "rank_pattern (a rank per module)",
            "alpha_pattern": "alpha_pattern (an alpha per module)",
            "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
            "target_parameters": "target_parameters (LoRA on parameters, not modules)",
            "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
            "lora_bias": "lora_bias (a bias in lora_B)"}


def runtime_updating(flag: bool) -> bool:
    """Whether adapters may be loaded and unloaded at run time: --enable-lora-updating, or
    $VLLM_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true (as vLLM reads it)."""
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules NAME=PATH (argparse's type): the adapter's served name and its folder."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"takes NAME=PATH (a PEFT adapter folder), got {text!r}")
    return name, path


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as the engine runs it: its rank, its scale (lora_alpha / r, or / sqrt(r)
    with rslora) and the projections it targets (TARGETS' names)."""

    name: str
    path: str
    rank: int
    scale: float
    targets: tuple[str, ...]


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (entry -> dtype, shape, offsets): no tensor read."""
    with path.open("rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) != 8:
            raise ConfigError(f"{path}: not a safetensors file")
        (size,) = struct.unpack("<Q", size_bytes)
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(f"{path}: not a safetensors file") from None
    header.pop("__metadata__", None)
    return header  # type: ignore[no-any-return]


def read_adapter(name: str, path: str, max_rank: int, num_layers: int | None = None
                 ) -> AdapterSpec:
    """The adapter `name` in PEFT folder `path`, checked: a LoRA whose every entry is the A or
    B of a decoder layer's q/k/v/o or gate/up/down projection (of a layer under
    `num_layers`), rank at most `max_rank`; anything else raises ConfigError naming it."""
    folder = Path(path)
    subject = f"LoRA adapter {name!r} ({path})"
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{subject}: no {ADAPTER_CONFIG} (a PEFT adapter folder)") from None
    except ValueError as exc:
        raise ConfigError(f"{subject}: {ADAPTER_CONFIG} is not JSON: {exc}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{subject}: peft_type {cfg.get('peft_type')!r}; only LORA runs")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise ConfigError(f"{subject}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{subject}: bias {cfg['bias']!r} is not supported (only 'none')")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ConfigError(f"{subject}: r and lora_alpha must be numbers, got {rank!r}, {alpha!r}")
    if rank > max_rank:
        raise ConfigError(f"{subject}: rank {rank} exceeds --max-lora-rank {max_rank}")
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{subject}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read)")
    targets: set[str] = set()
    for entry, info in _safetensors_header(weights).items():
        match = ENTRY.fullmatch(entry)
        if match is None or TARGETS[match.group(3)] != match.group(2):
            raise ConfigError(f"{subject}: entry {entry}: only the lora_A/lora_B of a decoder "
                              f"layer's {', '.join(TARGETS)} run (no embedding, head or other "
                              "targets)")
        if num_layers is not None and int(match.group(1)) >= num_layers:
            raise ConfigError(f"{subject}: entry {entry}: the model has {num_layers} layers")
        shape = info.get("shape", [])
        if len(shape) != 2 or shape[0 if match.group(4) == "A" else 1] != rank:
            raise ConfigError(f"{subject}: entry {entry} of shape {shape} is not of rank {rank}")
        targets.add(match.group(3))
    if not targets:
        raise ConfigError(f"{subject}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return AdapterSpec(name, path, rank, float(scale), tuple(sorted(targets)))


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The run's adapters: `modules` (served name, PEFT folder; adapter id i + 1, 0 is the
    base model), at most `max_loras` of them in the executor at once (all loaded at start
    where they fit and none loads at run time; else swapped: `swap_slots`); ranks up to
    `max_lora_rank`."""

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter served (--enable-lora-updating,
    # or VLLM_ALLOW_RUNTIME_LORA_UPDATING): every adapter is then swapped (`swap_slots`).
    runtime_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice: {names}")

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.runtime_updating

    @property
    def swap_slots(self) -> int:
        """The executor's adapter slots when adapters are swapped in and out (more of them
        than --max-loras, or loading at run time on: every adapter then loads as its
        requests are admitted, stages/scheduler/adapters.py); 0: every adapter of `modules`
        is loaded at start and stays."""
        swapped = self.runtime_updating or len(self.modules) > self.max_loras
        return self.max_loras if swapped else 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def adapters(self, num_layers: int | None = None) -> list[AdapterSpec]:
        """Every adapter, checked (read_adapter), in adapter-id order."""
        return [read_adapter(name, path, self.max_lora_rank, num_layers)
                for name, path in self.modules]


def adapter_id(names: tuple[str, ...], name: str) -> int | None:
    """The adapter id of the served adapter `name` ("" and absent: 0, the base model), or
    None for a name the run does not serve."""
    if not name:
        return 0
    try:
        return names.index(name) + 1
    except ValueError:
        return None


def lora_limits(lora: LoraConfig | None) -> dict[str, Any]:
    """EngineLimits' LoRA fields for `lora` (the scheduler's view: names, folders, slots)."""
    if lora is None:
        return {}
    return {"lora_names": lora.names, "lora_paths": tuple(p for _, p in lora.modules),
            "lora_slots": lora.swap_slots, "lora_updating": lora.runtime_updating}
