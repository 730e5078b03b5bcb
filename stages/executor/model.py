"""A lean Llama-family decoder over a paged KV cache. Runs in the executor process.

Parameter names match Hugging Face's except where projections are fused: q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` per layer (one matrix product each instead of
three and two); `fuse_projections` builds them from a HF state dict, so a local HF folder
(Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) loads as it is. One forward takes a flattened
batch mixing prefill chunks and decode tokens of different sequences; attention reads and
writes the paged cache.

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
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ipc.arch import ArchSpec, arch_spec
from stages.executor.attention import (
    AttentionMetadata,
    FlexMetadata,
    KernelMetadata,
    flex_paged_attention,
    kernel_paged_attention,
    paged_attention,
)

Metadata = AttentionMetadata | FlexMetadata | KernelMetadata


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = False  # torch.ops.llm_cpu (a 2-D contiguous input); see use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return torch.ops.llm_cpu.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(spec.hidden, self.q_size + 2 * self.kv_size,
                                  bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.layer_idx = layer_idx
        self.scale = self.head_dim**-0.5
        # Tensor parallel (parallel.py): o_proj is row-parallel, its output summed over ranks.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: Metadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(meta, KernelMetadata):  # rope inside the kernel
            out = kernel_paged_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            assert cos is not None and sin is not None
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attend = flex_paged_attention if isinstance(meta, FlexMetadata) else paged_attention
            out = attend(q, k, v, kv_cache, meta, self.scale)  # type: ignore[arg-type]
        out = self.o_proj(out.reshape(num_tokens, -1))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # as Attention's
        self.kernels = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            out = self.down_proj(torch.ops.llm_cpu.silu_and_mul(self.gate_up_proj(x)))
        else:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx)
        self.mlp = MLP(spec.hidden, spec.intermediate, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.kernels = False

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        if self.kernels:  # the residual add fused into the second norm; x updated in place
            h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
            norm = self.post_attention_layernorm
            h = torch.ops.llm_cpu.add_rms_norm(x, h, norm.weight, norm.eps)
            return x.add_(self.mlp(h))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        # Built on the meta device and loaded with assign=True: no initial values. (An
        # Embedding that initialises itself on meta goes through torch._refs, which
        # imports torch._dynamo: 1.5 s of every executor's start.)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden))
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)


class PagedLlama(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches (one per layer), meta,
    logits_indices [S]) -> [S, V]. `compile_layers` compiles each decoder layer (one graph
    serves every layer, one per padded step size) and leaves the rest eager."""

    def __init__(self, cfg: dict, spec: ArchSpec | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec = spec = spec or arch_spec(cfg)
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn: Attention = self.model.layers[0].self_attn  # type: ignore[assignment]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.tp: Any = None  # a parallel.TensorParallel: this model is one rank's shard
        self.kernels = False  # use_cpu_kernels

    def use_cpu_kernels(self) -> None:
        """Run the eager forward through torch.ops.llm_cpu (kernels.py, loaded already):
        attention with rope over the paged cache, the norms (the residual add fused into
        the second of each layer) and SiLU-and-mul. The rope tables keep the values of the
        model's dtype, in float32 for the kernel."""
        self.kernels = True
        self.rope_cos_f32 = self.rope_cos.float().contiguous()
        self.rope_sin_f32 = self.rope_sin.float().contiguous()
        self.model.norm.kernels = True
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.kernels = layer.input_layernorm.kernels = layer.mlp.kernels = True

    def init_rope(self, max_len: int) -> None:
        """Tables of cos/sin per position, computed as Hugging Face's LlamaRotaryEmbedding
        does (in float32). The plain rope of a config that names its theta is computed here
        (compute_default_rope_parameters' formula); scaled ropes go through transformers'
        rope functions. (Importing transformers' model code costs ~2.5 s of every executor's
        start, and modeling_llama imports torch._dynamo too.)"""
        params, scaled = self.cfg.get("rope_parameters") or {}, self.cfg.get("rope_scaling")
        theta = params.get("rope_theta", self.cfg.get("rope_theta"))
        if params.get("rope_type", "default") == "default" and not scaled and theta is not None:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
            inv_freq, scaling = 1.0 / (float(theta) ** exponents), 1.0
        else:
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf_cfg = AutoConfig.for_model(**self.cfg)
            rope_type = hf_cfg.rope_parameters["rope_type"]
            if rope_type == "default":  # (the theta came from the config class's default)
                exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
                inv_freq, scaling = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** exponents), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype, device = self.lm_head.weight.dtype, self.lm_head.weight.device
        self.rope_cos = (emb.cos() * scaling).to(device, dtype)
        self.rope_sin = (emb.sin() * scaling).to(device, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: Metadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits; with tensor parallelism, on rank 0 (None on the others)."""
        if self.tp is None:
            x = self.model.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = self.tp.embed(self.model.embed_tokens, input_ids)
        cos = sin = None  # the kernel ropes from the tables itself
        if not isinstance(meta, KernelMetadata):
            cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
            sin = self.rope_sin[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        x = self.model.norm(x[logits_indices])  # [S, hidden]
        logits = self.lm_head(x).float()  # [S, vocab]
        return logits if self.tp is None else self.tp.gather_logits(logits)


class PackedLinear(nn.Module):
    """nn.Linear with its weight reordered once into oneDNN's blocked layout (CPU): the
    matrix products that are most of a CPU step then skip the per-call repacking of the
    plain [out, in] weight; measured 2-3x faster per product in fp32 at batch 32 on the
    2-core test machine (docs/BENCHMARKS.md, "Packed weights")."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight,
                                                  self.bias, "none", [], "")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype on this CPU: bf16 needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, which an AVX2-only CPU lacks (there F.linear runs it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear below `model` by a PackedLinear; returns how many. (A tied
    lm_head gets a packed copy; the embedding keeps the plain matrix for its lookups.)"""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


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


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int) -> PagedLlama:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    spec = arch_spec(cfg, str(model_dir / "config.json"))  # refuses before any weight loads
    with torch.device("meta"):
        model = PagedLlama(cfg, spec)
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
    return model.to(device).eval()

