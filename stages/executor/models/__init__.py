"""The model of a folder, built by its family's module (the registry: ipc/families/) and
loaded, in the executor process."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ipc.arch import ArchSpec
from ipc.families import family_of, read_config
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod, process_weights
from stages.executor.models.base import CausalLM
from stages.executor.preflight import check_divisible

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ipc.lora import LoraConfig
    from stages.executor.parallel import PipelineParallel, TensorParallel



def model_class(cfg: dict, source: str = "config.json") -> type[CausalLM]:
    """The CausalLM subclass the registry names for the config's family."""
    module, name = family_of(cfg, source).builder.split(":")
    cls: type[CausalLM] = getattr(importlib.import_module(module), name)
    return cls


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_model(cfg: dict, spec: ArchSpec, dtype: torch.dtype, backend: AttentionBackend,
                linear: LinearMethod, tp: TensorParallel | None = None,
                stage: PipelineParallel | None = None) -> CausalLM:
    """The family's model (with `stage`: that pipeline stage's part) with memory for every
    parameter (not yet filled)."""
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(cfg)(cfg, spec, backend, linear, tp, stage)
    # Memory for every parameter and buffer, as model.to_empty(device="cpu") would give but
    # by torch.empty: to_empty's empty_like of a meta tensor goes through torch._refs, which
    # imports sympy (0.4 s of every executor's start).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    embed = model.model.embed_tokens
    if model.lm_head is not None and embed is not None and spec.tie_word_embeddings \
            and not linear.takes_blocks:
        model.lm_head.weight = embed.weight  # (_apply untied them)
    return model


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int, backend: AttentionBackend, linear: LinearMethod,
               tp: TensorParallel | None = None,
               stage: PipelineParallel | None = None,
               lora: LoraConfig | None = None) -> CausalLM:
    """The model (with `tp`: that rank's shard, read slice by slice, no rank holding the
    whole; with `stage`: that pipeline stage's layers only, the others' entries skipped) on
    `device`, its weights in their linear method's format. `lora`: with its adapters loaded
    (stages/executor/lora.py), each projection's format wrapped to add them; a step with
    adapted rows then runs the layers one by one (the fused CPU call takes no adapter)."""
    from stages.executor.fused import FusedLayers
    from stages.executor.loader import load_weights
    from stages.executor.lora import LoraMethod, LoraState, load_adapter

    cfg, spec = read_config(model_dir)
    state = None
    if lora is not None and lora.enabled:
        adapters = lora.adapters(spec.num_layers)  # (checked again: ConfigError by name)
        if tp is not None or stage is not None or spec.moe is not None:
            raise ValueError("LoRA adapters run on one rank of a dense model")
        # (the segmented kernel: float32 and bf16 on the CPU kernels; else torch's products)
        kernel = backend.name == "cpu_kernels" and dtype in (torch.float32, torch.bfloat16)
        pairs = kernel and dtype == torch.bfloat16 and torch.ops.llm_cpu.lora_bf16_pairs()
        state = LoraState(lora.max_loras, lora.max_lora_rank, kernel, pairs)
        linear = LoraMethod(linear, state)
    if tp is not None:
        check_divisible(spec, tp.size, str(Path(model_dir) / "config.json"))
        if linear.takes_blocks:
            raise ValueError("a quantized GGUF file runs on one rank: leave out "
                             "--tensor-parallel-size")
    model = build_model(cfg, spec, dtype, backend, linear, tp, stage)
    load_weights(model, model_dir, spec.tie_word_embeddings)
    model = model.to(device).eval()
    model.init_rope(max_len)
    process_weights(model)
    if state is not None:
        model.lora = state
        for i, adapter in enumerate(adapters if lora is not None and not lora.swap_slots
                                         else ()):
            load_adapter(model.model.layers, state, i + 1, adapter, model.dtype)
        logger.info("LoRA adapters: a step with adapted rows runs the layers one by one (the "
                    "fused CPU call takes no adapter), in %s", "the segmented kernel"
                    if state.kernel else "torch's products")
    model.fused_layers = FusedLayers.build(model)
    model.trim_last_layer = device.type == "cpu"  # (ModelRunner unsets it if it compiles)
    return model
