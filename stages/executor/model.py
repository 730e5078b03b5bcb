"""A lean Llama-family decoder over a paged KV cache. Runs in the executor process.

Parameter names match Hugging Face's except where projections are fused: q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` per layer (one matrix product each instead of
three and two), which the loader fills from the checkpoint's parts (loader.py), so a local HF
folder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM) loads as it is. The layers own their
tensor-parallel sharding (sharding.py): one rank or many, the same model and load path. One
forward takes a flattened batch mixing prefill chunks and decode tokens of different
sequences; attention reads and writes the paged cache through the model's attention backend
(backends/base.py), which also supplies the ops of a layer's elementwise work; each
projection's weight format is its linear method (linear/). Both are chosen before the model
is built (backends/select.py, linear/select.py) and never changed on it.

What sets the families apart is read from config.json in one place (`arch_spec`): biases,
Qwen3's q/k norms, a sliding window, a tied head. The forward has no per-family branches,
only modules that are there or not; a config field the engine does not implement is refused
before anything loads, by name (`UnsupportedModel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ipc.arch import ArchSpec, read_config
from stages.executor.backends.base import TORCH_OPS, AttentionBackend, ForwardOps
from stages.executor.fused import FusedLayers
from stages.executor.linear.base import LinearMethod, process_weights
from stages.executor.loader import load_weights
from stages.executor.preflight import check_divisible
from stages.executor.sharding import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from stages.executor.parallel import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ForwardOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's heads: q/k/v column-parallel by head, o row-parallel."""

    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard) -> None:
        super().__init__()
        d = self.head_dim = spec.head_dim
        self.num_heads, self.num_kv_heads = shard.local(spec.num_heads), shard.local(
            spec.num_kv_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden, (spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d),
            spec.qkv_bias, linear, shard)
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden, spec.o_bias, linear,
                                        shard)
        # Qwen3's norms of each head's query and key ([T, heads, D]: PyTorch's ops)
        self.q_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.eps) if spec.qk_norm else None
        self.layer_idx, self.backend = layer_idx, backend
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's keys and values go into the cache; the output is of every row, or of
        the rows `keep` only (PagedLlama.forward's last layer)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.attend(q, k, v, kv_cache, meta, self.scale)  # ropes q and k
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.flatten(1))  # (summed over the ranks)


class MLP(nn.Module):
    """This rank's intermediate rows: gate/up column-parallel, down row-parallel."""

    def __init__(self, spec: ArchSpec, ops: ForwardOps, linear: LinearMethod,
                 shard: Shard) -> None:
        super().__init__()
        self.ops = ops
        inter = spec.intermediate
        self.gate_up_proj = ColumnParallelLinear(spec.hidden, (inter, inter), spec.mlp_bias,
                                                 linear, shard)
        self.gate_up_proj.gated = True
        self.down_proj = RowParallelLinear(inter, spec.hidden, spec.mlp_bias, linear, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated_forward(x, self.ops.silu_and_mul))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard) -> None:
        super().__init__()
        ops = backend.ops
        self.self_attn = Attention(spec, layer_idx, backend, linear, shard)
        self.mlp = MLP(spec, ops, linear, shard)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], or the rows `keep` [S] of it (their order)."""
        h = self.self_attn(self.input_layernorm(x), kv_cache, meta, keep)
        if keep is not None:
            x = x[keep]
        norm = self.post_attention_layernorm
        x, h = self.ops.add_rms_norm(x, h, norm.weight, norm.eps)  # (fused where it can be)
        return self.ops.add(x, self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, spec: ArchSpec, backend: AttentionBackend, linear: LinearMethod,
                 shard: Shard) -> None:
        super().__init__()
        # Built on the meta device, given memory and filled by the loader: no initial values.
        # (nn.Embedding, initialising itself on meta, would go through torch._refs, which
        # imports torch._dynamo: 1.5 s of every executor's start.)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden, shard)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend, linear, shard)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps, backend.ops)


class PagedLlama(nn.Module):
    """forward(input_ids [T], kv_caches (one per layer), meta (the backend's metadata of the
    step), logits_indices [S]) -> [S, V]. `compile_layers` compiles each decoder layer (one
    graph serves every layer, one per padded step size) and leaves the rest eager.
    With `tp`, this is one rank's shard (sharding.py); without, the whole model."""

    def __init__(self, cfg: dict, spec: ArchSpec, backend: AttentionBackend,
                 linear: LinearMethod, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.spec, self.backend, self.tp = cfg, spec, backend, tp
        shard = Shard(tp.rank, tp.size, tp) if tp is not None else Shard()
        self.model = Backbone(spec, backend, linear, shard)
        self.lm_head = ParallelLMHead(spec.hidden, spec.vocab_size, linear.for_head(), shard)
        if spec.tie_word_embeddings and not linear.takes_blocks:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn: Attention = self.model.layers[0].self_attn  # type: ignore[assignment]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.fused_layers: FusedLayers | None = None  # set once loaded (load_model)
        # Whether the last layer runs past its attention for the logits' rows only (see
        # forward); on the eager CPU forward (load_model), not in a compiled layer or a graph.
        self.trim_last_layer = False
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_kv_caches(self, num_blocks: int, block_size: int,
                      device: torch.device) -> list[torch.Tensor]:
        """Zeroed KV caches, per layer [2, num_blocks, block_size, kv_heads, head_dim], each
        its own tensor (so that every layer's cache looks alike to the compiled layer).
        Written whole now, at the start: memory from calloc (pages the kernel zeroes when a
        block is first written) started 0.2 s sooner for 1 GiB but moved those page faults
        into the first steps that reach each block: a fresh engine's 64 x 128 tokens in bf16
        ran at 811-864 tok/s against 891-944 (in process, interleaved)."""
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device)
                for _ in range(self.num_layers)]

    def init_rope(self, max_len: int) -> None:
        """The rope tables of every position (rope_tables), in the model's dtype."""
        cos, sin = rope_tables(self.cfg, self.head_dim, max_len)
        device = self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = cos.to(device, self.dtype), sin.to(device, self.dtype)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The logits [S, vocab] of the rows `logits_indices`, in the model's dtype (float32
        with tensor parallelism, on rank 0; None on the others)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        # A prompt chunk's rows other than its last feed only the next layers (their keys and
        # values): past the last layer's attention, only the logits' rows are needed. Its
        # output projection and MLP then run on those rows alone (a 128-token prompt's
        # prefill does 1/30 less of the default model's work), the same bits for them where
        # the products compute a row independently of the rows beside it (MKL, AMX, the
        # quantized kernels; docs/ARCHITECTURE.md "The forward: eager or compiled").
        keep = (logits_indices if self.trim_last_layer
                and logits_indices.shape[0] < x.shape[0] else None)
        layers = self.model.layers
        if self.fused_layers is not None:  # the same kernels, in one call (fused.py)
            x = self.fused_layers(x, kv_caches, meta, all_layers=keep is None)
        else:
            for i in range(len(layers) - (keep is not None)):
                x = layers[i](x, kv_caches[i], meta)
        if keep is not None:
            x = self.model.norm(layers[-1](x, kv_caches[-1], meta, keep))  # [S, hidden]
        else:
            x = self.model.norm(x[logits_indices])  # [S, hidden]
        logits = self.lm_head(x)  # [S, vocab], in the model's dtype (the sampler widens)
        return logits if self.tp is None else self.tp.gather_logits(logits.float())


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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_len: int, backend: AttentionBackend, linear: LinearMethod,
               tp: TensorParallel | None = None) -> PagedLlama:
    """The model (with `tp`: that rank's shard, read slice by slice, no rank holding the
    whole) on `device`, its weights in their linear method's format."""
    cfg, spec = read_config(model_dir)
    if tp is not None:
        check_divisible(spec, tp.size, str(Path(model_dir) / "config.json"))
        if linear.takes_blocks:
            raise ValueError("a quantized GGUF file runs on one rank: leave out "
                             "--tensor-parallel-size")
    with torch.device("meta"), _default_dtype(dtype):
        model = PagedLlama(cfg, spec, backend, linear, tp)
    # Memory for every parameter and buffer, as model.to_empty(device="cpu") would give but
    # by torch.empty: to_empty's empty_like of a meta tensor goes through torch._refs, which
    # imports sympy (0.4 s of every executor's start).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    if spec.tie_word_embeddings and not linear.takes_blocks:  # (that untied them)
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, model_dir, spec.tie_word_embeddings)
    model.init_rope(max_len)
    model = model.to(device).eval()
    process_weights(model)
    model.fused_layers = FusedLayers.build(model)
    model.trim_last_layer = device.type == "cpu"  # (ModelRunner unsets it if it compiles)
    return model
