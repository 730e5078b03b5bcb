"""The roofline of a one-sequence decode (`scripts/bench throughput`'s batch-1 rows): the bytes
of weights a token's forward reads, as loaded (packed, quantized blocks with their scales;
each sparse layer's routed experts only, the embedding's one row), divided by the host's read
bandwidth, measured in the same run just before the row (a CPU's bandwidth drifts ~20% an
hour). A forward at batch 1 is bound by that read; its tokens per second over the roofline's
say how far from the bound it runs. Runs in the bench's process."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

SAMPLE_BYTES = 1 << 30  # larger than any cache, so every read comes from memory
REPEATS = 5


@dataclass(frozen=True)
class Roofline:
    read_gb_s: float  # the host's read bandwidth, the best of REPEATS sums
    bytes_per_token: float  # weights a token's forward reads, as loaded

    @property
    def tok_s(self) -> float:
        return self.read_gb_s * 1e9 / self.bytes_per_token

    def as_dict(self) -> dict[str, float]:
        return {"read_gb_s": self.read_gb_s, "bytes_per_token": self.bytes_per_token,
                "tok_s": self.tok_s}


def read_bandwidth() -> float:
    """GB/s of a sum over SAMPLE_BYTES of float32 on every thread torch has (the forward's
    threads), the best of REPEATS."""
    import torch

    x = torch.ones(SAMPLE_BYTES // 4)
    x.sum()  # (faulted in)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return SAMPLE_BYTES / best / 1e9


def bytes_per_token(model: Any) -> float:
    """The bytes of tensors a one-token forward of `model` (a loaded CausalLM) reads: every
    tensor the modules hold (parameters, buffers and the weight formats' own: packed panels,
    quantized codes and scales), the embedding's one row of its table, and top_k / experts of
    each mixture's expert weights. Shared tensors (a tied head) count once, at their largest
    share. The KV cache and the rope tables are left out (a short context reads little)."""
    import torch

    spec = model.spec
    shares: dict[int, tuple[float, int]] = {}  # data_ptr -> (share, bytes)
    embed = model.model.embed_tokens
    for name, module in model.named_modules():
        share = 1.0
        if module is embed:
            share = 1 / embed.weight.shape[0]
        elif ".experts." in f"{name}." and spec.moe is not None:
            share = spec.moe.top_k / spec.moe.num_experts
        tensors = [t for t in (*module.parameters(recurse=False),
                               *module.buffers(recurse=False), *vars(module).values())
                   if isinstance(t, torch.Tensor) and t.numel()]
        for t in tensors:
            try:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # (oneDNN's packed: opaque)
                key, size = id(t), t.numel() * t.element_size()
            if t is getattr(module, "mkl_weight", None):
                # MKL's packed buffer is the size MKL picks for its panels (on an Intel Xeon
                # 7.9 MB for a 64 x 96 weight): a product reads the float32 weight's panels
                size = module.in_features * module.out_features * 4
            before = shares.get(key, (0.0, 0))[0]
            shares[key] = (max(before, share), size)
    return sum(share * size for share, size in shares.values())


def roofline(model: Any) -> Roofline:
    return Roofline(read_bandwidth(), bytes_per_token(model))
