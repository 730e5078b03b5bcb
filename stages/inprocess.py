"""The scheduler and executor cores wired together in one process, without sockets or shared
memory: for tests and debugging. Same step protocol, same ring layout (plain numpy buffers)."""

from __future__ import annotations

from collections import deque

import torch

from ipc.config import EngineLimits, kept_windows
from ipc.lora import LoraConfig, lora_limits
from ipc.messages import SamplingParams, TokenizedRequest
from ipc.model_info import ModelInfo
from ipc.outputs import SampleResult
from ipc.speculative import SpeculativeConfig
from ipc.step import PromptLogprobs, StepLogprobs, local_buffers, step_input_specs
from stages.executor.pooling import vector_bytes
from stages.executor.runner import ModelRunner
from stages.executor.sampler import SampleOutput
from stages.scheduler.core import Scheduler


def logprobs_lists(out: SampleOutput) -> StepLogprobs | None:
    if out.logprob is None or out.top_ids is None or out.top_logprobs is None:
        return None
    return out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()


def prompt_lists(out: SampleOutput) -> PromptLogprobs | None:
    p = out.prompt
    if p is None:
        return None
    return p.logprob.tolist(), p.rank.tolist(), p.top_ids.tolist(), p.top_logprobs.tolist()


class InProcessEngine:
    """generate(prompt ids) -> output ids, through Scheduler.schedule/on_sampled and
    ModelRunner.execute; up to `depth` steps are planned ahead of their results."""

    def __init__(self, model_dir: str, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 block_size: int = 4, kv_cache_memory: int = 1 << 24, depth: int = 2,
                 max_model_len: int = 256, eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: str = "cpu",
                 compile: bool = False, graphs: bool | None = None,
                 cpu_kernels: bool | None = None, quantization: str | None = None,
                 speculative: SpeculativeConfig | None = None,
                 kv_cache_dtype: str = "auto", lora: LoraConfig | None = None) -> None:
        info = ModelInfo.from_dir(model_dir)
        self.limits = EngineLimits(max_num_seqs, max_num_batched_tokens, block_size,
                                   max_model_len, info.vocab_size, eos_token_ids, depth,
                                   num_speculative_tokens=speculative.num_tokens
                                   if speculative is not None else 0,
                                   kv_windows=kept_windows(info, speculative),
                                   **lora_limits(lora))
        self.runner = ModelRunner.from_dir(model_dir, dtype, torch.device(device), self.limits,
                                           kv_cache_memory, compile, graphs=graphs,
                                           cpu_kernels=cpu_kernels, quantization=quantization,
                                           speculative=speculative, kv_cache_dtype=kv_cache_dtype,
                                           lora=lora)
        self.scheduler = Scheduler(self.limits, self.runner.num_blocks,
                                   speculative=speculative)
        specs = step_input_specs(self.limits)
        self.rings = [local_buffers(specs) for _ in range(self.limits.num_ring_slots)]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        results = self.run([(str(i), ids, params) for i, ids in enumerate(prompts)])
        return [results[str(i), 0].token_ids for i in range(len(prompts))]

    def _grammar(self, params: SamplingParams) -> str:
        """As the tokenizer stage does: the structured output's grammar text."""
        matchers = self.runner.slots.matchers
        if params.structured_outputs is None or matchers is None:
            return ""
        return matchers.grammars.grammar(params.structured_outputs)

    def run(self, requests: list[tuple[str, list[int], SamplingParams]]
            ) -> dict[tuple[str, int], SampleResult]:
        """Run requests (id, prompt ids, params) to the end; results by (id, sample index)."""
        results: dict[tuple[str, int], SampleResult] = {}
        for rid, ids, params in requests:
            self.scheduler.add_request(TokenizedRequest(rid, "", ids, params, 0.0,
                                                        self._grammar(params)))
            for i in range(params.n):
                results[rid, i] = SampleResult(i)
        inflight: deque = deque()
        while self.scheduler.requests or inflight:
            while (step := self.scheduler.schedule()) is not None:
                ring = self.rings[step.ring_slot]
                out = self.runner.execute(step.write(ring), ring)
                inflight.append((step.step_id, out))
            if not inflight:
                raise RuntimeError("the scheduler has requests but planned no step")
            self.runner.work_ahead(lambda: False)  # (as a device does while no plan came)
            step_id, out = inflight.popleft()
            self.scheduler.on_sampled(step_id, out.tokens.tolist(), logprobs_lists(out),
                                      prompt_lists(out),
                                      out.accepted.tolist() if out.accepted is not None else None,
                                      vector_bytes(out.pooled) if out.pooled is not None
                                      else None)
            for delta in self.scheduler.take_outputs().deltas:
                results[delta.request_id, delta.index].add(delta)
        return results
