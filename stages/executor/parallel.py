"""Tensor parallelism across executor ranks (Megatron-style), over torch.distributed: gloo on
the CPU, NCCL on CUDA. Runs in each executor process of a `--tensor-parallel-size K` run.

Each rank holds 1/K of every layer and loads only that: the layers own their sharding
(sharding.py; model.load_model is the one load path for every K). The query and key/value
heads and the MLP's intermediate rows of the column-parallel projections (qkv, gate/up), the
matching input columns of the row-parallel ones (o, down), after which one all-reduce per
attention block and one per MLP block sums the ranks' parts; 1/K of the vocabulary of the
embedding and of the output layer (the logits are gathered on rank 0, which samples). Norms
and RoPE tables are small and replicated, but for q/k norms over the whole projections (OLMo,
OLMoE), split with the heads, their sums of squares all-reduced (blocks.Attention); each
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

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank that died: the others fail, not hang


@dataclasses.dataclass
class TensorParallel:
    rank: int
    size: int
    vocab_size: int  # the model's, before padding to a multiple of size

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
        return cls(rank, size, vocab_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

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
