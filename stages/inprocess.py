"""The scheduler and executor cores wired together in one process, without sockets or shared
memory: for tests and debugging. Same step protocol, same ring layout (plain numpy buffers)."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ipc.messages import SamplingParams, TokenizedRequest
from ipc.rings import sampled_specs, step_input_specs
from stages.executor.runner import ModelRunner, RunnerShape
from stages.scheduler.core import Scheduler, SchedulerLimits
from stages.scheduler.process import make_plan, write_step


def _buffers(specs) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {s.name: np.zeros(s.shape, dtype=s.dtype) for s in specs}


class InProcessEngine:
    """generate(prompt ids) -> output ids, through Scheduler.schedule/on_sampled and
    ModelRunner.execute; up to `depth` steps are planned ahead of their results."""

    def __init__(self, model_dir: str, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 block_size: int = 4, kv_cache_memory: int = 1 << 24, depth: int = 2,
                 max_model_len: int = 256, eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        max_updates = (max_num_batched_tokens // block_size + 2 * max_num_seqs
                       + -(-max_model_len // block_size))  # as PipelineConfig.max_block_updates
        shape = RunnerShape(max_num_seqs, block_size, max_model_len, kv_cache_memory,
                            max_num_batched_tokens, max_updates, depth + 1)
        self.runner = ModelRunner.from_dir(model_dir, dtype, torch.device(device), shape)
        self.limits = SchedulerLimits(self.runner.num_blocks, block_size, max_num_seqs,
                                      max_num_batched_tokens, max_model_len, max_updates,
                                      eos_token_ids, depth)
        self.scheduler = Scheduler(self.limits)
        specs = step_input_specs(max_num_seqs, max_num_batched_tokens, max_updates)
        self.rings = [_buffers(specs) for _ in range(depth + 1)]
        self.sampled = _buffers(sampled_specs(max_num_seqs))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        for i, ids in enumerate(prompts):
            self.scheduler.add_request(TokenizedRequest(str(i), "", ids, params, 0.0))
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        inflight: deque = deque()
        while self.scheduler.requests or inflight:
            while (step := self.scheduler.schedule()) is not None:
                ring = self.rings[step.ring_slot]
                write_step(step, ring)
                tokens = self.runner.execute(make_plan(step), ring)
                inflight.append((step.step_id, tokens.cpu()))
            if not inflight:
                raise RuntimeError("the scheduler has requests but planned no step")
            step_id, tokens = inflight.popleft()
            self.scheduler.on_sampled(step_id, tokens.tolist())
            for delta in self.scheduler.take_outputs().deltas:
                outputs[delta.request_id].extend(delta.token_ids)
        return [outputs[str(i)] for i in range(len(prompts))]
