"""One sample's streamed outputs added up: the client, the HTTP front end and the in-process
engine each assemble results with it (from RequestOutputs, or from the scheduler's deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.messages import FinishReason, RequestOutput, TokenDelta, TokenLogprob


@dataclass
class SampleResult:
    """One of a request's n samples, so far."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked for (sample 0)
    embedding: bytes | None = None  # a pooling request's raw vector (ipc/pooling.py)

    def add(self, out: RequestOutput | TokenDelta) -> None:
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        self.num_cached_tokens = out.num_cached_tokens
        if isinstance(out, TokenDelta):
            if out.finish_reason is not None:
                self.end(out.finish_reason, out.stop_token_id)
            return
        self.text += out.text
        if out.finished:
            self.end(out.finish_reason, out.stop_reason)

    def end(self, reason: FinishReason | None, stop_reason: str | int | None = None) -> None:
        self.finished, self.finish_reason, self.stop_reason = True, reason, stop_reason
