"""Every wire type of the pipeline, in one place. Imported by all processes.

A message is a frozen dataclass encoded by `ipc.codec` as a msgpack array `[TAG, *fields]`.
Field order is the contract: new fields are appended, with defaults, never inserted.
Nested structs travel as plain arrays of their fields (their type is known from the parent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

PROTOCOL_VERSION = 1


class Struct:
    """A nested record: encoded as the array of its fields, without a tag."""


class Message(Struct):
    """A top-level message: encoded as `[TAG, *fields]`; TAGs are unique."""

    TAG: ClassVar[int]


# ---------------------------------------------------------------- request parameters


@dataclass(frozen=True, slots=True)
class SamplingParams(Struct):
    """What the client asks of one request; validated by the tokenizer stage.

    max_tokens None means: until a stop condition or the end of the model's context.
    temperature 0 means greedy.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class ChatMessage(Struct):
    role: str
    content: str


# ---------------------------------------------------------------- client -> tokenizer


@dataclass(frozen=True, slots=True)
class AddRequest(Message):
    """Exactly one of prompt, prompt_token_ids, messages is set. Outputs go to reply_to."""

    TAG: ClassVar[int] = 1
    request_id: str
    reply_to: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    params: SamplingParams
    arrival_time: float


# ---------------------------------------------------------------- client -> scheduler


@dataclass(frozen=True, slots=True)
class AbortRequest(Message):
    """Stop a request wherever it is; its final output has finish_reason 'abort'."""

    TAG: ClassVar[int] = 2
    request_id: str


# ---------------------------------------------------------------- tokenizer -> scheduler


@dataclass(frozen=True, slots=True)
class TokenizedRequest(Message):
    TAG: ClassVar[int] = 3
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


# ---------------------------------------------------------------- scheduler -> detokenizer


@dataclass(frozen=True, slots=True)
class DetokRequestInfo(Struct):
    """Sent once, with the first batch that mentions the request."""

    request_id: str
    reply_to: str
    num_prompt_tokens: int
    skip_special_tokens: bool
    arrival_time: float


@dataclass(frozen=True, slots=True)
class TokenDelta(Struct):
    """New token ids of one request; a finish_reason ends the request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestRejected(Struct):
    """A request the scheduler refused on arrival (duplicate id, cannot fit, aborted early).
    It has no detokenizer state: the answer goes straight to reply_to."""

    request_id: str
    reply_to: str
    finish_reason: str
    error: str | None
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class DetokBatch(Message):
    """One message per step per detokenizer shard, never one per token."""

    TAG: ClassVar[int] = 4
    new_requests: list[DetokRequestInfo]
    deltas: list[TokenDelta]
    rejected: list[RequestRejected] = field(default_factory=list)


# ---------------------------------------------------------------- detokenizer/tokenizer -> client


@dataclass(frozen=True, slots=True)
class RequestOutput(Struct):
    """A streamed delta of one request. text and token_ids are new since the last output."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class RequestOutputs(Message):
    TAG: ClassVar[int] = 5
    outputs: list[RequestOutput]


# ---------------------------------------------------------------- scheduler <-> executor


@dataclass(frozen=True, slots=True)
class SlotInit(Struct):
    """A sequence takes an executor slot: the slot's device-side sampling state is reset."""

    slot: int
    temperature: float


@dataclass(frozen=True, slots=True)
class StepPlan(Message):
    """Step `step_id`; its bulk inputs lie in slot `ring_slot` of the step-input ring.

    The ring slot holds num_seqs sequence rows, num_tokens token ids (-1 = placeholder: the
    token this sequence's executor slot sampled last) and num_block_updates block-table writes.
    """

    TAG: ClassVar[int] = 6
    step_id: int
    ring_slot: int
    num_seqs: int
    num_tokens: int
    num_block_updates: int
    num_sampled: int
    new_slots: list[SlotInit]


@dataclass(frozen=True, slots=True)
class SampledTokens(Message):
    """Step `step_id` is done; its sampled ids lie in `ring_slot` of the sampled-token ring,
    one per sampling sequence, in the order of the step's sequence rows."""

    TAG: ClassVar[int] = 7
    step_id: int
    ring_slot: int
    num_sampled: int
    device_start: float = 0.0
    device_end: float = 0.0


# ---------------------------------------------------------------- stages -> launcher


@dataclass(frozen=True, slots=True)
class StageReady(Message):
    """A stage finished starting. info carries values found at run time (num_kv_blocks)."""

    TAG: ClassVar[int] = 8
    stage: str
    rank: int
    pid: int
    info: dict[str, int]


@dataclass(frozen=True, slots=True)
class StageFailed(Message):
    """A stage is about to die; message says why."""

    TAG: ClassVar[int] = 9
    stage: str
    rank: int
    pid: int
    message: str


@dataclass(frozen=True, slots=True)
class SchedulerStats(Message):
    """The scheduler's accounting, sent to the launcher a few times a second."""

    TAG: ClassVar[int] = 10
    num_blocks: int
    num_free_blocks: int
    num_slots: int
    num_free_slots: int
    num_ring_slots: int
    num_free_ring_slots: int
    num_inflight_steps: int
    num_waiting: int
    num_running: int
    num_requests: int
    num_preemptions: int
    num_steps: int


ALL_MESSAGES: tuple[type[Message], ...] = (
    AddRequest,
    AbortRequest,
    TokenizedRequest,
    DetokBatch,
    RequestOutputs,
    StepPlan,
    SampledTokens,
    StageReady,
    StageFailed,
    SchedulerStats,
)
