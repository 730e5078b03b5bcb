"""Tensor parallelism across executor ranks (Megatron-style), over torch.distributed: gloo on
the CPU, NCCL on CUDA. Runs in each executor process of a `--tensor-parallel-size K` run.

Each rank holds 1/K of every layer and loads only that (`load_model_shard`, slice by slice
from the safetensors files): the query and key/value heads and the MLP's intermediate rows
of the column-parallel projections (qkv, gate/up), the matching input columns of the
row-parallel ones (o, down), after which one all-reduce per attention block and one per MLP
block sums the ranks' parts; 1/K of the vocabulary of the embedding (a token outside a
rank's range looks up zeros; an all-reduce sums) and of the output layer (the logits are
gathered on rank 0, which samples). Norms and RoPE tables are small and replicated; each
rank's KV cache holds its own heads.

The scheduler still talks to rank 0 alone and the run-ahead protocol is unchanged: rank 0
forwards each step plan to the other ranks, every rank reads the step's ring slot itself
(one host) and runs the same forward; rank 0 samples and broadcasts the sampled ids, which
the other ranks keep as their slots' last samples (the placeholders of the next steps).
Collectives are issued only by each process's device thread, in step order.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from ipc.arch import ArchSpec
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod, process_weights
from stages.executor.model import PagedLlama, read_config
from stages.executor.preflight import check_divisible

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank that died: the others fail, not hang


@dataclasses.dataclass
class TensorParallel:
    rank: int
    size: int
    vocab_size: int  # the model's, before padding to a multiple of size
    vocab_per_rank: int

    @classmethod
    def init(cls, rank: int, size: int, store_path: str, device: torch.device,
             vocab_size: int) -> TensorParallel:
        """Join the ranks' process group (every rank must call it; the file store is the
        run directory's)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                world_size=size, timeout=COLLECTIVE_TIMEOUT)
        # Every rank has joined once this returns (NCCL would connect only at the first
        # collective, and a follower maps the rings rank 0 made before it joined).
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        logger.info("tensor-parallel rank %d of %d (%s)", rank, size, backend)
        return cls(rank, size, vocab_size, -(-vocab_size // size))

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = self.rank * self.vocab_per_rank
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """A vocab-parallel lookup: this rank's rows for its ids, zeros for the others'."""
        start, end = self.vocab_range
        local = ids - start
        outside = (local < 0) | (local >= end - start)
        x = embedding(torch.where(outside, 0, local))
        return self.all_reduce(x.masked_fill(outside.unsqueeze(1), 0))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits [S, V/K] -> all of them [S, V] on rank 0 (None elsewhere)."""
        parts = ([torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0
                 else None)
        dist.gather(logits.contiguous(), parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :self.vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0)
        return x

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def shard_spec(spec: ArchSpec, size: int) -> ArchSpec:
    return dataclasses.replace(spec, num_heads=spec.num_heads // size,
                               num_kv_heads=spec.num_kv_heads // size,
                               intermediate=spec.intermediate // size,
                               vocab_size=-(-spec.vocab_size // size))


class _Checkpoint:
    """Slices of a safetensors folder's tensors, read without loading the rest."""

    def __init__(self, model_dir: Path) -> None:
        self._files = [safe_open(str(p), "pt") for p in sorted(model_dir.glob("*.safetensors"))]
        if not self._files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
        self._where = {name: f for f in self._files for name in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[start:end]

    def cols(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[:, start:end]

    def full(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def load_model_shard(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                     max_len: int, tp: TensorParallel, backend: AttentionBackend,
                     linear: LinearMethod) -> PagedLlama:
    """Rank tp.rank's part of the model, read slice by slice (no rank holds the whole)."""
    model_dir = Path(model_dir)
    cfg, spec = read_config(model_dir)
    check_divisible(spec, tp.size, str(model_dir / "config.json"))
    local = shard_spec(spec, tp.size)
    with torch.device("meta"):
        model = PagedLlama(cfg, local, backend, linear)
    ckpt, r = _Checkpoint(model_dir), tp.rank
    d, hq, hkv, inter = spec.head_dim, local.num_heads, local.num_kv_heads, local.intermediate
    q_rows = (r * hq * d, (r + 1) * hq * d)
    kv_rows = (r * hkv * d, (r + 1) * hkv * d)
    state: dict[str, torch.Tensor] = {}

    def parts(prefix: str, fused: str, names: tuple[str, ...], sizes: tuple[int, ...],
              ranges: tuple[tuple[int, int], ...], suffix: str) -> torch.Tensor | None:
        """This rank's rows of each part, from the parts' own tensors or a fused one."""
        if f"{prefix}{names[0]}.{suffix}" in ckpt:
            return torch.cat([ckpt.rows(f"{prefix}{n}.{suffix}", a, b)
                              for n, (a, b) in zip(names, ranges, strict=True)])
        if f"{prefix}{fused}.{suffix}" not in ckpt:
            return None
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return torch.cat([ckpt.rows(f"{prefix}{fused}.{suffix}", o + a, o + b)
                          for o, (a, b) in zip(offsets, ranges, strict=True)])

    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            qkv = parts(p + "self_attn.", "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                        (spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d),
                        (q_rows, kv_rows, kv_rows), suffix)
            if qkv is not None:
                state[f"{p}self_attn.qkv_proj.{suffix}"] = qkv
            gate_up = parts(p + "mlp.", "gate_up_proj", ("gate_proj", "up_proj"),
                            (spec.intermediate, spec.intermediate),
                            ((r * inter, (r + 1) * inter),) * 2, suffix)
            if gate_up is not None:
                state[f"{p}mlp.gate_up_proj.{suffix}"] = gate_up
        state[f"{p}self_attn.o_proj.weight"] = ckpt.cols(f"{p}self_attn.o_proj.weight",
                                                         *q_rows)
        state[f"{p}mlp.down_proj.weight"] = ckpt.cols(f"{p}mlp.down_proj.weight",
                                                      r * inter, (r + 1) * inter)
        for row_parallel in ("self_attn.o_proj", "mlp.down_proj"):
            name = f"{p}{row_parallel}.bias"
            if name in ckpt:  # added once: rank 0's, zeros elsewhere (the all-reduce sums)
                bias = ckpt.full(name)
                state[name] = bias if r == 0 else torch.zeros_like(bias)
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                     "self_attn.k_norm"):
            if f"{p}{norm}.weight" in ckpt:
                state[f"{p}{norm}.weight"] = ckpt.full(f"{p}{norm}.weight")
    state["model.norm.weight"] = ckpt.full("model.norm.weight")
    start, end = tp.vocab_range
    embed = ckpt.rows("model.embed_tokens.weight", start, end)
    state["model.embed_tokens.weight"] = _pad_rows(embed, tp.vocab_per_rank)
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = _pad_rows(ckpt.rows("lm_head.weight", start, end),
                                            tp.vocab_per_rank)
    else:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(max_len)
    model.tp = tp
    for layer in model.model.layers:
        layer.self_attn.reduce = tp.all_reduce
        layer.mlp.reduce = tp.all_reduce
    model = model.to(device).eval()
    process_weights(model)
    return model


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows beyond the vocabulary (its last rank's padding) are zeros: logits dropped."""
    if len(t) == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - len(t), *t.shape[1:])])
