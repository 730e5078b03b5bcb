"""What a client returns for one request: its samples added up (`CompletionOutput`). Runs in
the client's process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ipc.messages import WHOLE_REQUEST, ErrorKind, FinishReason, RequestOutput, TokenLogprob
from ipc.outputs import SampleResult


@dataclass
class CompletionOutput:
    """The whole result of one request. text, token_ids, finish_reason, stop_reason and
    logprobs are sample 0's; `samples` has all n (n > 1 only matters there)."""

    request_id: str
    n: int = 1
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # whose fault the error is
    error_param: str | None = None  # the field at fault, if one is
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # over all samples
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    samples: list[SampleResult] = field(default_factory=list)
    prompt: Any = None  # what was asked (the offline API sets it)
    _num_finished: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.samples = self.samples or [SampleResult(i) for i in range(self.n)]

    @property
    def outputs(self) -> list[SampleResult]:
        """The n samples (vLLM's RequestOutput.outputs)."""
        return self.samples

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def stop_reason(self) -> str | int | None:
        return self.samples[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.samples[0].logprobs

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """With SamplingParams.prompt_logprobs: one per prompt token (the first's is NaN)."""
        return self.samples[0].prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.finish_time is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def add(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.num_prompt_tokens = out.num_prompt_tokens
        if out.index == WHOLE_REQUEST:  # refused: every sample ends here
            for s in self.samples:
                s.end(out.finish_reason)
            self._num_finished = self.n
        else:
            s = self.samples[out.index]
            was_finished = s.finished
            s.add(out)
            self.num_cached_tokens = out.num_cached_tokens
            self.num_output_tokens += len(out.token_ids)
            self._num_finished += s.finished and not was_finished
        if out.error is not None:
            self.error, self.error_kind, self.error_param = (out.error, out.error_kind,
                                                             out.error_param)
        if self._num_finished >= self.n:
            self.finish_reason, self.finish_time = self.samples[0].finish_reason, now
