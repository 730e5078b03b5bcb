"""The scheduler and executor cores wired together in one process, without sockets or shared
memory: for tests and debugging. Same step protocol, same ring layout (plain numpy buffers)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ipc.messages import SamplingParams, TokenDelta, TokenizedRequest, TokenLogprob
from ipc.rings import sampled_specs, step_input_specs
from stages.executor.runner import ModelRunner, RunnerShape
from stages.executor.sampler import SampleOutput
from stages.scheduler.core import Scheduler, SchedulerLimits, StepLogprobs
from stages.scheduler.process import make_plan, write_step


@dataclass
class SampleResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, delta: TokenDelta) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens


def logprobs_lists(out: SampleOutput) -> StepLogprobs | None:
    if out.logprob is None or out.top_ids is None or out.top_logprobs is None:
        return None
    return out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()


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
        results = self.run([(str(i), ids, params) for i, ids in enumerate(prompts)])
        return [results[str(i), 0].token_ids for i in range(len(prompts))]

    def run(self, requests: list[tuple[str, list[int], SamplingParams]]
            ) -> dict[tuple[str, int], SampleResult]:
        """Run requests (id, prompt ids, params) to the end; results by (id, sample index)."""
        results: dict[tuple[str, int], SampleResult] = {}
        for rid, ids, params in requests:
            self.scheduler.add_request(TokenizedRequest(rid, "", ids, params, 0.0))
            for i in range(params.n):
                results[rid, i] = SampleResult()
        inflight: deque = deque()
        while self.scheduler.requests or inflight:
            while (step := self.scheduler.schedule()) is not None:
                ring = self.rings[step.ring_slot]
                write_step(step, ring)
                out = self.runner.execute(make_plan(step), ring)
                inflight.append((step.step_id, out))
            if not inflight:
                raise RuntimeError("the scheduler has requests but planned no step")
            step_id, out = inflight.popleft()
            self.scheduler.on_sampled(step_id, out.tokens.tolist(), logprobs_lists(out))
            for delta in self.scheduler.take_outputs().deltas:
                results[delta.request_id, delta.index].add(delta)
        return results
