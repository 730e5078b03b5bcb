"""The one path that loads a checkpoint into the model, for one tensor-parallel rank or many,
in the executor process: every entry (a safetensors folder's, or a GGUF file's through
gguf_loader.py) is mapped to the parameter that holds it (a fused projection's part
included) and handed to that layer's `load_weight`, which reads only its rank's slice
(sharding.py); replicated parameters are copied whole. A layer whose linear method takes
blocks (a GGUF file's) is given them whole, its parts joined. An entry the model has no
place for, or a parameter no entry filled, is an error that names it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn

from ipc.families import read_config
from ipc.gguf_source import gguf_source
from stages.executor.linear.base import Linear
from stages.executor.linear.quantized import (
    QuantizedWeight,
    join_rows,
    quantize_int8,
    set_weight,
)
from stages.executor.sharding import copy_whole

# A checkpoint's separate projections, as parts of the model's fused ones.
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SKIPPED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; the model makes its own
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"

Entry = tuple[str, str, Any]  # (file name, checkpoint name, a sliceable tensor or blocks)


def target_of(name: str) -> tuple[str, int | None]:
    """The model's parameter for checkpoint entry `name`, and which part of it."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in FUSED_PARTS:
        fused, part = FUSED_PARTS[last]
        return f"{parent}.{fused}.{leaf}", part
    return name, None


def checkpoint_entries(model_dir: str | Path,
                       keep: Callable[[str], bool] | None = None) -> Iterator[Entry]:
    """The folder's entries: a GGUF file's tensors if the folder stands for one, else every
    safetensors file's (lazily sliced). keep: which of a GGUF file's tensors (by their
    Hugging Face names) are read into blocks at all (a pipeline stage's)."""
    source = gguf_source(model_dir)
    if source is not None:
        from stages.executor.gguf_loader import gguf_entries

        yield from gguf_entries(source, read_config(model_dir)[1], keep)
        return
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                yield path.name, name, f.get_slice(name)


def load_weights(model: nn.Module, model_dir: str | Path, tied: bool) -> None:
    """Fill `model`'s parameters (allocated, in their dtype) from the folder's checkpoint."""
    modules = dict(model.named_modules())
    head = modules.get(HEAD.rpartition(".")[0])
    head_takes_blocks = isinstance(head, Linear) and head.method.takes_blocks
    filled: dict[str, set[int | None]] = {}
    blocks: dict[str, dict[int | None, QuantizedWeight]] = {}
    tied_head: QuantizedWeight | None = None
    rename = getattr(model, "checkpoint_name", lambda n: n)  # (the family's names)
    on_stage = getattr(model, "on_stage", lambda n: n)  # (a pipeline stage's part of them)
    split = getattr(model, "checkpoint_entries", iter)  # (the family's parts of entries)
    holds = getattr(model, "holds_entry", None)  # (a pipeline stage's: the others not read)
    for where, entry, value in split(checkpoint_entries(model_dir, holds)):
        name = rename(entry)
        if name is None or name.endswith(SKIPPED) or (tied and name == HEAD
                                                      and not head_takes_blocks):
            continue
        if tied and name == EMBEDDING and head_takes_blocks:
            tied_head = _as_blocks(value)  # (unless the file has a head of its own)
        name = on_stage(name)
        if name is None:
            continue
        target, part = target_of(name)
        module_name, _, leaf = target.rpartition(".")
        module = modules.get(module_name)
        if isinstance(module, Linear) and module.method.takes_blocks and leaf == "weight":
            blocks.setdefault(module_name, {})[part] = _as_blocks(value)
            continue
        if isinstance(value, QuantizedWeight):
            value = value.dequantize()
        param = getattr(module, leaf, None) if module is not None else None
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{where}: {entry}: the model has no such parameter")
        try:
            if hasattr(module, "load_weight"):
                module.load_weight(leaf, value, part)
            else:
                copy_whole(param, value)
        except ValueError as exc:
            raise ValueError(f"{where}: {entry}: {exc}") from None
        filled.setdefault(target, set()).add(part)
    if tied_head is not None and HEAD.rpartition(".")[0] in modules:
        blocks.setdefault(HEAD.rpartition(".")[0], {None: tied_head})
    _set_blocks(modules, blocks)
    _check_filled(model, modules, filled)


def _as_blocks(value: Any) -> QuantizedWeight:
    """A layer that takes blocks gets a float entry quantized to 8 bits."""
    return value if isinstance(value, QuantizedWeight) else quantize_int8(value[:].float())


def _set_blocks(modules: dict[str, nn.Module],
                blocks: dict[str, dict[int | None, QuantizedWeight]]) -> None:
    """Each layer that takes blocks gets its entry, or its parts' joined by rows."""
    for name, module in modules.items():
        if not (isinstance(module, Linear) and module.method.takes_blocks):
            continue
        parts = blocks.get(name, {})
        count = len(getattr(module, "parts", (None,)))
        if None in parts:
            weight = parts[None]
        elif count > 1 and set(parts) == set(range(count)):
            weight = join_rows([parts[i] for i in range(count)])
        else:
            raise ValueError(f"the checkpoint has no {name}.weight"
                             + (f" (parts {sorted(set(range(count)) - set(parts))} missing)"
                                if parts else ""))
        set_weight(module, weight)


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
