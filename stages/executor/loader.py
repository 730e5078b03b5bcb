"""The one path that loads a checkpoint into the model, for one tensor-parallel rank or many,
in the executor process: every safetensors entry is mapped to the parameter that holds it
(a fused projection's part included) and handed to that layer's `load_weight`, which reads
only its rank's slice (sharding.py); replicated parameters are copied whole. An entry the
model has no place for, or a parameter no entry filled, is an error that names it."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import nn

from stages.executor.sharding import copy_whole

# A checkpoint's separate projections, as parts of the model's fused ones.
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SKIPPED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; the model makes its own


def target_of(name: str) -> tuple[str, int | None]:
    """The model's parameter for checkpoint entry `name`, and which part of it."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in FUSED_PARTS:
        fused, part = FUSED_PARTS[last]
        return f"{parent}.{fused}.{leaf}", part
    return name, None


def load_weights(model: nn.Module, model_dir: str | Path, tied: bool) -> None:
    """Fill `model`'s parameters (allocated, in their dtype) from the folder's safetensors."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    modules = dict(model.named_modules())
    filled: dict[str, set[int | None]] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name.endswith(SKIPPED) or (tied and name == "lm_head.weight"):
                    continue
                target, part = target_of(name)
                module_name, _, leaf = target.rpartition(".")
                module = modules.get(module_name)
                param = getattr(module, leaf, None) if module is not None else None
                if not isinstance(param, nn.Parameter):
                    raise ValueError(f"{path.name}: {name}: the model has no such parameter")
                try:
                    if hasattr(module, "load_weight"):
                        module.load_weight(leaf, f.get_slice(name), part)
                    else:
                        copy_whole(param, f.get_slice(name))
                except ValueError as exc:
                    raise ValueError(f"{path.name}: {name}: {exc}") from None
                filled.setdefault(target, set()).add(part)
    _check_filled(model, modules, filled)


def _check_filled(model: nn.Module, modules: dict[str, nn.Module],
                  filled: dict[str, set[int | None]]) -> None:
    for name, _ in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        parts = filled.get(name, set())
        needed = set(range(len(module.parts))) if hasattr(module, "parts") else {None}
        if None not in parts and not needed <= parts:
            raise ValueError(f"the checkpoint has no {name}"
                             + (f" (parts {sorted(needed - parts)} missing)"
                                if parts else ""))

