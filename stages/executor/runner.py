"""The executor core: model, paged KV cache and per-slot device state. No sockets.

Owns, on the device: the KV cache, the block table of every slot, each slot's last sampled
token (the placeholder value) and sampling parameters. `execute()` runs one step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import StepPlan
from stages.executor.attention import build_step_tensors
from stages.executor.model import PagedLlama, load_model
from stages.executor.sampler import sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerShape:
    max_num_seqs: int
    block_size: int
    max_model_len: int
    kv_cache_memory: int


def kv_bytes_per_block(model: PagedLlama, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * itemsize


class ModelRunner:
    def __init__(self, model: PagedLlama, shape: RunnerShape, device: torch.device) -> None:
        self.model, self.shape, self.device = model, shape, device
        dtype = model.lm_head.weight.dtype
        per_block = kv_bytes_per_block(model, shape.block_size, dtype)
        self.num_blocks = shape.kv_cache_memory // per_block
        max_blocks_per_seq = -(-shape.max_model_len // shape.block_size)
        if self.num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {shape.kv_cache_memory} bytes holds no KV block "
                             f"({per_block} bytes each)")
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = torch.zeros(model.num_layers, 2, self.num_blocks, shape.block_size,
                                     model.num_kv_heads, model.head_dim, dtype=dtype, device=device)
        self.block_table = torch.zeros(shape.max_num_seqs, max_blocks_per_seq, dtype=torch.int32,
                                       device=device)
        self.last_sampled = torch.zeros(shape.max_num_seqs, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(shape.max_num_seqs, dtype=torch.float32, device=device)
        self._host_temperature = np.zeros(shape.max_num_seqs, dtype=np.float32)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks,
                    shape.block_size, self.num_blocks * per_block / 2**20)

    @classmethod
    def from_dir(cls, model_dir: str, dtype: torch.dtype, device: torch.device,
                 shape: RunnerShape) -> ModelRunner:
        return cls(load_model(model_dir, dtype, device, shape.max_model_len), shape, device)

    def _apply_plan_state(self, plan: StepPlan, inputs: dict[str, np.ndarray]) -> None:
        for init in plan.new_slots:
            self._host_temperature[init.slot] = init.temperature
            self.temperature[init.slot] = init.temperature
        n = plan.num_block_updates
        if n:
            rows = torch.from_numpy(inputs["bt_slot"][:n].astype(np.int64)).to(self.device)
            cols = torch.from_numpy(inputs["bt_index"][:n].astype(np.int64)).to(self.device)
            blocks = torch.from_numpy(inputs["bt_block"][:n].copy()).to(self.device)
            self.block_table[rows, cols] = blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan, inputs: dict[str, np.ndarray]) -> torch.Tensor:
        """Run step `plan` on the ring slot `inputs`; returns sampled ids [num_sampled]."""
        self._apply_plan_state(plan, inputs)
        s, t = plan.num_seqs, plan.num_tokens
        seq_slot = inputs["seq_slot"][:s].copy()
        do_sample = inputs["do_sample"][:s].copy()
        step = build_step_tensors(inputs["query_len"][:s].copy(), inputs["context_len"][:s].copy(),
                                  seq_slot, do_sample, self.block_table, self.shape.block_size,
                                  self.device)
        ids = torch.from_numpy(inputs["input_ids"][:t].copy()).to(self.device)
        ids = torch.where(ids < 0, self.last_sampled[step.token_slots], ids)
        logits = self.model(ids, step.positions, self.kv_caches, step.meta, step.logits_indices)
        all_greedy = not self._host_temperature[seq_slot[do_sample]].any()
        tokens = sample(logits, self.temperature[step.sample_slots], bool(all_greedy))
        self.last_sampled[step.sample_slots] = tokens
        return tokens
