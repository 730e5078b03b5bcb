"""A lean Llama-family decoder over a paged KV cache. Runs in the executor process.

Parameter names match Hugging Face's except where projections are fused: q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` per layer (one matrix product each instead of
three and two); `fuse_projections` builds them from a HF state dict, so a local HF folder
(Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) loads as it is. One forward takes a flattened
batch mixing prefill chunks and decode tokens of different sequences; attention reads and
writes the paged cache through the model's attention backend (backends/base.py), which also
supplies the ops of a layer's elementwise work; each projection's weight format is its
linear method (linear/). Both are chosen before the model is built (backends/select.py,
linear/base.py) and never changed on it.

What sets the families apart is read from config.json in one place (`arch_spec`): biases,
Qwen3's q/k norms, a sliding window, a tied head. The forward has no per-family branches,
only modules that are there or not; a config field the engine does not implement is refused
before anything loads, by name (`UnsupportedModel`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ipc.arch import ArchSpec, arch_spec
from stages.executor.backends.base import TORCH_OPS, AttentionBackend, ForwardOps
from stages.executor.linear.base import Linear, LinearMethod, process_weights


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ForwardOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(spec.hidden, self.q_size + 2 * self.kv_size, spec.qkv_bias, linear)
        self.o_proj = Linear(self.q_size, spec.hidden, spec.o_bias, linear)
        # Qwen3's norms of each head's query and key ([T, heads, D]: PyTorch's ops)
        self.q_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.layer_idx, self.backend = layer_idx, backend
        self.scale = self.head_dim**-0.5
        # Tensor parallel (parallel.py): o_proj is row-parallel, its output summed over ranks.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.attend(q, k, v, kv_cache, meta, self.scale)  # ropes q and k
        out = self.o_proj(out.reshape(num_tokens, -1))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, ops: ForwardOps,
                 linear: LinearMethod) -> None:
        super().__init__()
        self.intermediate, self.ops = intermediate, ops
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, linear)
        self.down_proj = Linear(intermediate, hidden, bias, linear)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod) -> None:
        super().__init__()
        ops = backend.ops
        self.self_attn = Attention(spec, layer_idx, backend, linear)
        self.mlp = MLP(spec.hidden, spec.intermediate, spec.mlp_bias, ops, linear)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), kv_cache, meta)
        norm = self.post_attention_layernorm
        x, h = self.ops.add_rms_norm(x, h, norm.weight, norm.eps)  # (fused where it can be)
        return self.ops.add(x, self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, spec: ArchSpec, backend: AttentionBackend, linear: LinearMethod) -> None:
        super().__init__()
        # Built on the meta device and loaded with assign=True: no initial values. (An
        # Embedding that initialises itself on meta goes through torch._refs, which
        # imports torch._dynamo: 1.5 s of every executor's start.)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden))
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend, linear)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps, backend.ops)


class PagedLlama(nn.Module):
    """forward(input_ids [T], kv_caches (one per layer), meta (the backend's metadata of the
    step), logits_indices [S]) -> [S, V]. `compile_layers` compiles each decoder layer (one
    graph serves every layer, one per padded step size) and leaves the rest eager."""

    def __init__(self, cfg: dict, spec: ArchSpec, backend: AttentionBackend,
                 linear: LinearMethod) -> None:
        super().__init__()
        self.cfg, self.spec, self.backend = cfg, spec, backend
        self.model = Backbone(spec, backend, linear)
        self.lm_head = Linear(spec.hidden, spec.vocab_size, False, linear)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn: Attention = self.model.layers[0].self_attn  # type: ignore[assignment]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.tp: Any = None  # a parallel.TensorParallel: this model is one rank's shard

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def init_rope(self, max_len: int) -> None:
        """The rope tables of every position (rope_tables), in the model's dtype."""
        cos, sin = rope_tables(self.cfg, self.head_dim, max_len)
        device = self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = cos.to(device, self.dtype), sin.to(device, self.dtype)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits; with tensor parallelism, on rank 0 (None on the others)."""
        if self.tp is None:
            x = self.model.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = self.tp.embed(self.model.embed_tokens, input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, meta)
        x = self.model.norm(x[logits_indices])  # [S, hidden]
        logits = self.lm_head(x).float()  # [S, vocab]
        return logits if self.tp is None else self.tp.gather_logits(logits)


def rope_tables(cfg: dict, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of cos/sin [max_len, head_dim] per position, computed as Hugging Face's
    LlamaRotaryEmbedding does (in float32). The plain rope of a config that names its theta
    is computed here (compute_default_rope_parameters' formula); scaled ropes go through
    transformers' rope functions. (Importing transformers' model code costs ~2.5 s of every
    executor's start, and modeling_llama imports torch._dynamo too.)"""
    params, scaled = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    if params.get("rope_type", "default") == "default" and not scaled and theta is not None:
        inv_freq, scaling = 1.0 / (float(theta) ** exponents), 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_cfg = AutoConfig.for_model(**cfg)
        rope_type = hf_cfg.rope_parameters["rope_type"]
        if rope_type == "default":  # (the theta came from the config class's default)
            inv_freq, scaling = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg)
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HF state dict with each layer's q/k/v (weights and biases) and gate/up weights
    concatenated, in that order, under the fused names."""
    out = dict(state)
    for name in state:
        for fused, parts in FUSED.items():
            suffix = f".{parts[0]}."
            if suffix not in name:
                continue
            prefix, tail = name.split(suffix)
            out[f"{prefix}.{fused}.{tail}"] = torch.cat(
                [out.pop(f"{prefix}.{part}.{tail}") for part in parts], dim=0)
    return out


def read_config(model_dir: str | Path) -> tuple[dict, ArchSpec]:
    """config.json and what the engine reads of it; refuses what it does not implement
    before any weight loads."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    return cfg, arch_spec(cfg, str(path))


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int, backend: AttentionBackend, linear: LinearMethod) -> PagedLlama:
    model_dir = Path(model_dir)
    cfg, spec = read_config(model_dir)
    with torch.device("meta"):
        model = PagedLlama(cfg, spec, backend, linear)
    state: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        state.update(load_file(str(path)))
    if spec.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v.to(dtype) for k, v in state.items() if "rotary_emb" not in k}
    model.load_state_dict(fuse_projections(state), strict=True, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(max_len)
    model = model.to(device).eval()
    process_weights(model)
    return model

