"""The executor core: model, paged KV cache and per-slot device state. No sockets.

Owns, on the device: the KV cache, the block table of every slot, each slot's last sampled
token (the placeholder value) and sampling parameters. A step is `prepare()` on the host
(any time after the previous one) then `compute()` on the device, strictly in step order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import StepPlan
from stages.executor.attention import build_attention_metadata
from stages.executor.model import PagedLlama, load_model
from stages.executor.sampler import NUM_F, NUM_I, HostSlotParams, SampleOutput, SamplingState
from stages.executor.step_inputs import HostStep, prepare_host_step, staging_size, unpack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerShape:
    max_num_seqs: int
    block_size: int
    max_model_len: int
    kv_cache_memory: int
    max_num_tokens: int = 2048
    max_block_updates: int = 4096
    num_ring_slots: int = 3
    num_eos_ids: int = 4

    @property
    def max_stop_ids(self) -> int:
        """(slot, id) pairs min_tokens may suppress in one step: see validate_params."""
        from stages.tokenizer import MAX_STOP_TOKEN_IDS

        return self.max_num_seqs * (MAX_STOP_TOKEN_IDS + self.num_eos_ids)


def kv_bytes_per_block(model: PagedLlama, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * itemsize


class SlotState:
    """Per-slot device state shared by every runner: block table, last sample, sampling
    parameters and penalty counts."""

    def __init__(self, shape: RunnerShape, device: torch.device, pin: bool,
                 vocab_size: int) -> None:
        self.device = device
        max_blocks = -(-shape.max_model_len // shape.block_size)
        self.block_table = torch.zeros(shape.max_num_seqs, max_blocks, dtype=torch.int32,
                                       device=device)
        self.last_sampled = torch.zeros(shape.max_num_seqs, dtype=torch.int64, device=device)
        self.sampling = SamplingState(shape.max_num_seqs, vocab_size, device)
        self.host_params = HostSlotParams(shape.max_num_seqs)
        size = staging_size(shape.max_num_seqs, shape.max_num_tokens, shape.max_block_updates,
                            shape.max_stop_ids)
        # One packed staging buffer per ring slot: rewritten only after its step completed.
        self.staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pin)
                        for _ in range(shape.num_ring_slots)]

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        slot = plan.ring_slot
        return prepare_host_step(plan, ring, self.staging[slot], self.host_params, slot)

    def apply(self, step: HostStep, v: dict[str, torch.Tensor]) -> torch.Tensor:
        """Apply the step's slot changes on the device; returns its input ids [T] with
        placeholders resolved from each slot's last sample (and counted for penalties)."""
        if step.sizes["bt_slot"]:
            self.block_table[v["bt_slot"], v["bt_index"]] = v["bt_block"].int()
        if n := step.sizes["new_slots"]:
            fparams = v["new_fparams"].to(torch.int32).view(torch.float32).view(n, NUM_F)
            self.sampling.init_slots(v["new_slots"], fparams, v["new_iparams"].view(n, NUM_I),
                                     v["stop_slots"], v["stop_ids"])
        ids = v["input_ids"]
        ids = torch.where(ids < 0, self.last_sampled[v["token_slots"]], ids)
        if step.sampling.use_penalties:
            self.sampling.count_tokens(ids, v["token_slots"], v["positions"])
        return ids

    def sample(self, step: HostStep, v: dict[str, torch.Tensor],
               logits: torch.Tensor) -> SampleOutput:
        slots = v["sample_slots"]
        out = self.sampling.sample(logits, slots, v["positions"][v["logits_indices"]],
                                   step.sampling)
        self.last_sampled[slots] = out.tokens
        return out


class ModelRunner:
    """The real model path."""

    def __init__(self, model: PagedLlama, shape: RunnerShape, device: torch.device) -> None:
        self.model, self.shape, self.device = model, shape, device
        dtype = model.lm_head.weight.dtype
        per_block = kv_bytes_per_block(model, shape.block_size, dtype)
        self.num_blocks = shape.kv_cache_memory // per_block
        if self.num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {shape.kv_cache_memory} bytes holds no KV block "
                             f"({per_block} bytes each)")
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = torch.zeros(model.num_layers, 2, self.num_blocks, shape.block_size,
                                     model.num_kv_heads, model.head_dim, dtype=dtype, device=device)
        self.vocab_size = model.cfg["vocab_size"]
        self.slots = SlotState(shape, device, device.type == "cuda", self.vocab_size)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks,
                    shape.block_size, self.num_blocks * per_block / 2**20)

    @classmethod
    def from_dir(cls, model_dir: str, dtype: torch.dtype, device: torch.device,
                 shape: RunnerShape) -> ModelRunner:
        return cls(load_model(model_dir, dtype, device, shape.max_model_len), shape, device)

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        return self.slots.prepare(plan, ring)

    @torch.inference_mode()
    def compute(self, step: HostStep, packed: torch.Tensor) -> SampleOutput:
        """Run `step` whose packed buffer is already on the device; returns its samples."""
        v = unpack(packed, step.sizes)
        ids = self.slots.apply(step, v)
        meta = build_attention_metadata(v, step.decode_groups, step.prefills,
                                        self.slots.block_table, self.shape.block_size)
        logits = self.model(ids, v["positions"], self.kv_caches, meta, v["logits_indices"])
        return self.slots.sample(step, v, logits)

    def execute(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> SampleOutput:
        """prepare + compute, synchronously (tests, the in-process engine)."""
        step = self.prepare(plan, ring)
        return self.compute(step, step.packed.to(self.device))


class TimedRunner:
    """A measuring instrument, not a model: each step waits `a + b * tokens` milliseconds
    (sleeping, so the host is free) and emits deterministic tokens, to measure the
    orchestration alone as a fast device would expose it. Same slot protocol as the model."""

    def __init__(self, a_ms: float, b_ms: float, shape: RunnerShape, vocab_size: int) -> None:
        self.a_ms, self.b_ms, self.shape = a_ms, b_ms, shape
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self.num_blocks = shape.max_num_seqs * -(-shape.max_model_len // shape.block_size)
        self.slots = SlotState(shape, self.device, False, vocab_size)

    def prepare(self, plan: StepPlan, ring: dict[str, np.ndarray]) -> HostStep:
        return self.slots.prepare(plan, ring)

    def compute(self, step: HostStep, packed: torch.Tensor) -> SampleOutput:
        """Sampling parameters are ignored: the tokens are a function of the context."""
        v = unpack(packed, step.sizes)
        ids = self.slots.apply(step, v)
        idx = v["logits_indices"]
        tokens = (ids[idx] * 1103515245 + v["positions"][idx] + 12345) % self.vocab_size
        self.slots.last_sampled[v["sample_slots"]] = tokens
        time.sleep((self.a_ms + self.b_ms * step.num_tokens) / 1000)
        return SampleOutput(tokens)

    execute = ModelRunner.execute
