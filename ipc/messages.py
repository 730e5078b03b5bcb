"""Every wire type of the pipeline, in one place. Imported by all processes.

A message is a frozen dataclass encoded by `ipc.codec` as a msgpack array `[TAG, *fields]`.
Field order is the contract: new fields are appended, with defaults, never inserted.
Nested structs travel as plain arrays of their fields (their type is known from the parent).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar


class Struct:
    """A nested record: encoded as the array of its fields, without a tag."""


class Message(Struct):
    """A top-level message: encoded as `[TAG, *fields]`; TAGs are unique."""

    TAG: ClassVar[int]


# ---------------------------------------------------------------- outcomes


class _WireEnum(str, enum.Enum):
    """A str enum that is its value wherever it is written: on the wire, in JSON, in text."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class FinishReason(_WireEnum):
    """Why a sample ended (vLLM's and OpenAI's words)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the end of the context
    ABORT = "abort"  # the client asked
    ERROR = "error"  # see the output's error_kind and error


class ErrorKind(_WireEnum):
    """Whose fault an error output is, so a front end answers without reading the message."""

    INVALID_REQUEST = "invalid_request"  # the client must fix it; error_param names the field
    UNAVAILABLE = "unavailable"  # the engine cannot take it now (stopped, failing)
    INTERNAL = "internal"  # a bug in a stage or a front end


# ---------------------------------------------------------------- request parameters


@dataclass(frozen=True, slots=True)
class StructuredOutputs(Struct):
    """A format the output must follow, enforced token by token while sampling (vLLM's
    `StructuredOutputsParams`). Exactly one of: json (a JSON Schema, as JSON text or a dict),
    json_object (any JSON object), regex, choice (one of these strings), grammar (a Lark
    grammar). Checked by the tokenizer stage, which compiles it (stages/grammar.py)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, list, bool)):  # a schema given as a Python value
            import json

            object.__setattr__(self, "json", json.dumps(self.json))

    def kinds(self) -> list[str]:
        """The names of the constraints given (valid: exactly one)."""
        given = [("json", self.json is not None), ("regex", self.regex is not None),
                 ("choice", self.choice is not None), ("grammar", self.grammar is not None),
                 ("json_object", self.json_object)]
        return [name for name, is_given in given if is_given]


@dataclass(frozen=True, slots=True)
class ReasoningTags(Struct):
    """Where a thinking model's reasoning is, so that a structured output applies after it:
    the answer starts inside it (`opened`: the template opened it), or it may open it with
    its first token (`start_id`, -1: it cannot); it ends with token `end_id`."""

    start_id: int
    end_id: int
    opened: bool = False


@dataclass(frozen=True, slots=True)
class LogitBias(Struct):
    """OpenAI's logit_bias entry: `bias` is added to token `token_id`'s logit before sampling
    (greedy too); -100 bans the token, +100 all but forces it."""

    token_id: int
    bias: float


@dataclass(frozen=True, slots=True)
class SamplingParams(Struct):
    """What the client asks of one request; validated by the tokenizer stage
    (ipc/params.py validate_params), with the meanings vLLM's users expect.

    max_tokens None means: until a stop condition or the end of the model's context.
    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 mean off.
    Penalties follow vLLM: repetition_penalty divides positive (multiplies negative) logits of
    tokens seen in the prompt or output; presence/frequency_penalty subtract from the logits of
    output tokens once / once per occurrence.
    seed makes the request's draws depend only on (seed, sample index, position), not on its
    batch mates. n samples share the prompt's KV blocks. logprobs None: none; k: the sampled
    token's logprob and the k most likely alternatives (k <= 20). Lower priority values are
    served first, within the range the engine allows and the fairness bound of the scheduler
    (docs/ARCHITECTURE.md, "Fairness"). user names who the request is for: the scheduler
    shares the engine fairly between users (and clients), first come first served within one.
    structured_outputs constrains the output to a format (JSON Schema, regex, choice, grammar).
    prompt_logprobs k: each prompt token's logprob under the model (after the first, which has
    none) and its k most likely alternatives, in sample 0's first output; such a prompt is
    computed in full (no prefix-cache hit), and only these requests pay for it.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None
    priority: int = 0
    user: str = ""
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None
    # With speculative decoding on (--speculative), False keeps this request out of it: one
    # token a step, as without. Its outputs are the same either way.
    speculate: bool = True
    # OpenAI's logit_bias; a {token id: bias} dict is taken too (vLLM's spelling)
    logit_bias: list[LogitBias] = field(default_factory=list)
    # a thinking model's tags: the structured output constrains only what follows them
    reasoning: ReasoningTags | None = None
    # An embedding request (ipc/pooling.py): "last", "mean" or "cls" pools the final norm's
    # hidden states of the prompt into one vector (TokenDelta.embedding); "" generates.
    pooling: str = ""
    # The LoRA adapter the request runs under, by its served name (--lora-modules); "": the
    # base model. The server takes it from the request's `model`.
    lora_name: str = ""
    # An adapter loaded at run time (POST /v1/load_lora_adapter): its PEFT folder, which the
    # scheduler keys it by (a new id for each (name, path)) and the executor loads it from.
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", [LogitBias(int(t), float(b))
                                                    for t, b in self.logit_bias.items()])


@dataclass(frozen=True, slots=True)
class ToolCall(Struct):
    """A function call an assistant message made (OpenAI's `tool_calls` entry)."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True, slots=True)
class ChatMessage(Struct):
    """role: system, user, assistant or tool (a tool's result, answering tool_call_id)."""

    role: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class ToolSpec(Struct):
    """A function the model may call: its name, what it does, its parameters' JSON Schema
    (as JSON text)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'


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
    tools: list[ToolSpec] = field(default_factory=list)  # shown to the model with messages
    # a chat's extra variables for its template (JSON text of an object; "": none), as
    # transformers' apply_chat_template takes them: {"enable_thinking": false}
    chat_template_kwargs: str = ""


# ---------------------------------------------------------------- client -> scheduler


@dataclass(frozen=True, slots=True)
class AbortRequest(Message):
    """Stop a request wherever it is; its final output has finish_reason 'abort'."""

    TAG: ClassVar[int] = 2
    request_id: str


@dataclass(frozen=True, slots=True)
class Reconcile(Message):
    """Sent by a client through tokenizer `rank` once the launcher has restarted it, naming
    the unfinished requests the client had sent to that rank; forwarded in order behind
    every request the new worker received first. Each id the scheduler then does not know
    was lost with the dead worker: it gets an error (a finished one's final output is
    already ahead of it, and the client ignores what comes after that)."""

    TAG: ClassVar[int] = 13
    reply_to: str
    rank: int
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ForgetClient(Message):
    """From the launcher of an HTTP front end whose worker died: abort every request that
    replies to `reply_to`, and refuse any that arrives for it later."""

    TAG: ClassVar[int] = 14
    reply_to: str


@dataclass(frozen=True, slots=True)
class StageRestarted(Message):
    """From the launcher: stage:rank died and a new process took its place. For a
    detokenizer, the scheduler fails the requests of its shard (their text state is lost)."""

    TAG: ClassVar[int] = 15
    stage: str
    rank: int


@dataclass(frozen=True, slots=True)
class EngineReconcile(Message):
    """A client's Reconcile as tokenizer `rank` passes it to every engine, behind every
    request it forwarded there first: each engine answers which of the ids it holds."""

    TAG: ClassVar[int] = 16
    nonce: int  # the tokenizer's, to match the answers
    rank: int
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ReconcileAnswer(Message):
    """An engine's answer to an EngineReconcile: the ids it holds (or held lately: finished
    ones are not lost). An id no engine names was lost with the dead tokenizer."""

    TAG: ClassVar[int] = 17
    nonce: int
    engine: int
    known_ids: list[str]


@dataclass(frozen=True, slots=True)
class EngineDown(Message):
    """From the launcher to each detokenizer: engine `engine` died (its scheduler or
    executor) in its incarnation `incarnation` (0 first, one more each time it is started
    again); its requests there end with an error."""

    TAG: ClassVar[int] = 18
    engine: int
    message: str
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class Members(Message):
    """From the launcher to every stage, when a stage joined from another host or one that
    had joined left: where each stage's inbox is, by engine or rank ("" where none serves).
    A stage sends to these, never to a list of its own; a later epoch replaces the whole."""

    TAG: ClassVar[int] = 19
    epoch: int
    engines: list[str]  # each engine's scheduler inbox
    tokenizers: list[str]  # each tokenizer worker's stage inbox (ReconcileAnswer)
    detokenizers: list[str]
    # On the launcher's host: it can reach the ipc:// reply sockets of local clients.
    local_detokenizers: list[bool]
    # Why an engine no longer served is down ("E" -> the death), as the status says it too: a
    # tokenizer may hear of the death here first.
    engines_down_why: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- detokenizer -> scheduler


@dataclass(frozen=True, slots=True)
class StopSample(Message):
    """Sample `index` of a request produced one of its stop strings (or its text could not be
    made): the detokenizer has already given its client the final output; the scheduler frees
    the sample at once."""

    TAG: ClassVar[int] = 12
    request_id: str
    index: int


# ---------------------------------------------------------------- tokenizer -> scheduler


@dataclass(frozen=True, slots=True)
class TokenizedRequest(Message):
    TAG: ClassVar[int] = 3
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    grammar: str = ""  # params.structured_outputs as grammar text (stages/grammar.py)


# ---------------------------------------------------------------- scheduler -> detokenizer


@dataclass(frozen=True, slots=True)
class DetokRequestInfo(Struct):
    """Sent once, with the first batch that mentions the request."""

    request_id: str
    reply_to: str
    num_prompt_tokens: int
    skip_special_tokens: bool
    arrival_time: float
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings count only from this many output tokens on
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob(Struct):
    """One output token's logprob (from the model's raw distribution) and the top
    alternatives, most likely first. Token texts are filled in by the detokenizer."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)
    rank: int | None = None  # of token_id under the model (1: most likely); prompt logprobs


@dataclass(slots=True)
class TokenDelta(Struct):
    """New token ids of one sample of a request; a finish_reason ends the sample. (Not
    frozen, unlike the other messages: one is made per sample per step, by the scheduler
    and again by the detokenizer's decoding, and a frozen dataclass sets each field through
    object.__setattr__: 1.6 us a delta against 0.6. Nobody changes one after it is made.)"""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None  # with finish_reason ERROR
    index: int = 0  # sample index, 0..n-1
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    stop_token_id: int | None = None  # the stop_token_ids entry that finished it
    prompt_logprobs: list[TokenLogprob] | None = None  # once, all; the first's logprob is NaN
    embedding: bytes | None = None  # a pooling request's vector (little-endian float32)


def same_length(name: str, *columns: list[Any]) -> None:
    """Columns of one table (as unpacked: the codec checks each column's items alone)."""
    if len({len(c) for c in columns}) > 1:
        raise ValueError(f"{name}: columns of different lengths {[len(c) for c in columns]}")


@dataclass(slots=True)
class TokenColumns(Struct):
    """The steady case of TokenDelta, as columns: a sample's one new token, the sample not
    finished, no logprobs of either kind, no embedding (every other field at its default but
    index and num_cached_tokens). At a step of 256 samples a TokenDelta each was the largest
    part of the scheduler's host work (made, sorted to detokenizers and packed: ~0.37 ms of
    ~0.96 a step) and about half of the detokenizer's decoding and feeding; four lists pack
    and unpack in msgpack's C. Not frozen: the scheduler appends to it."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        same_length("TokenColumns", self.request_ids, self.token_ids, self.indexes,
                    self.num_cached_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, token_id: int, index: int, num_cached: int) -> None:
        self.request_ids.append(request_id)
        self.token_ids.append(token_id)
        self.indexes.append(index)
        self.num_cached_tokens.append(num_cached)

    def delta(self, i: int) -> TokenDelta:
        """Row i as the TokenDelta it stands for."""
        return TokenDelta(self.request_ids[i], [self.token_ids[i]], None, None,
                          self.indexes[i], None, self.num_cached_tokens[i])

    def deltas(self) -> list[TokenDelta]:
        return [self.delta(i) for i in range(len(self.request_ids))]


@dataclass(frozen=True, slots=True)
class RequestRejected(Struct):
    """A request the scheduler refused on arrival (duplicate id, cannot fit, aborted early).
    It has no detokenizer state: the answer goes straight to reply_to."""

    request_id: str
    reply_to: str
    finish_reason: FinishReason
    error: str | None
    num_prompt_tokens: int
    error_kind: ErrorKind | None = None


@dataclass(frozen=True, slots=True)
class DetokBatch(Message):
    """One message per step per detokenizer shard, never one per token."""

    TAG: ClassVar[int] = 4
    new_requests: list[DetokRequestInfo]
    deltas: list[TokenDelta]
    rejected: list[RequestRejected] = field(default_factory=list)
    engine: int = 0  # the data-parallel engine whose scheduler sent it
    incarnation: int = 0  # that engine's (see EngineDown)
    # Deltas of the steady case (one per sample, as `deltas` are: a sample is in one or the
    # other in a batch)
    plain: TokenColumns = field(default_factory=TokenColumns)

    @property
    def num_deltas(self) -> int:
        return len(self.deltas) + len(self.plain)


# ---------------------------------------------------------------- detokenizer/tokenizer -> client


WHOLE_REQUEST = -1  # RequestOutput.index of an answer that ends every sample (an error)


@dataclass(slots=True)
class RequestOutput(Struct):
    """A streamed delta of one sample of a request (index 0..n-1). text and token_ids are
    new since the last output of that sample; finished ends the sample. stop_reason is the
    stop string or stop token id that ended it, if any. A request refused before it ran
    gets one output with index WHOLE_REQUEST. An error output says whose fault it is
    (error_kind) and, for a bad field, which (error_param). (Not frozen, like TokenDelta:
    one is made per sample per step, by the detokenizer and again by the client's decoding,
    and a frozen dataclass sets each of its fifteen fields through object.__setattr__:
    1.7 us an output against 0.4. Nobody changes one after it is made.)"""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    index: int = 0
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    error_kind: ErrorKind | None = None
    error_param: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # see SamplingParams.prompt_logprobs
    embedding: bytes | None = None  # a pooling request's vector, raw (float32; see pooling)

    @classmethod
    def refusal(cls, request_id: str, kind: ErrorKind | None, message: str | None,
                param: str | None = None, num_prompt_tokens: int = 0,
                reason: FinishReason = FinishReason.ERROR) -> RequestOutput:
        """The one output of a request that ends before it runs (an error, or an abort)."""
        return cls(request_id, "", [], True, reason, message, num_prompt_tokens, 0,
                   WHOLE_REQUEST, error_kind=kind, error_param=param)


@dataclass(slots=True)
class OutputColumns(Struct):
    """The steady case of RequestOutput, as columns (TokenColumns' outputs): a sample's text
    of one new token, the sample not finished, no logprobs, no error (the other fields at
    their defaults). The detokenizer's steady path fills them without making a RequestOutput
    each, and packs them in msgpack's C; the client makes the RequestOutputs as it routes
    them (all_outputs), at about the cost of unpacking them had been. Not frozen: the
    detokenizer appends to it."""

    request_ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        same_length("OutputColumns", self.request_ids, self.texts, self.token_ids, self.indexes,
                    self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, text: str, token_id: int, index: int,
               num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.texts.append(text)
        self.token_ids.append(token_id)
        self.indexes.append(index)
        self.num_prompt_tokens.append(num_prompt_tokens)
        self.num_output_tokens.append(num_output_tokens)
        self.num_cached_tokens.append(num_cached_tokens)

    def outputs(self) -> list[RequestOutput]:
        """The RequestOutputs the columns stand for."""
        return [RequestOutput(rid, text, [token], False, None, None, prompt, out, index, None,
                              None, cached)
                for rid, text, token, index, prompt, out, cached in zip(
                    self.request_ids, self.texts, self.token_ids, self.indexes,
                    self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens,
                    strict=True)]


@dataclass(frozen=True, slots=True)
class RequestOutputs(Message):
    TAG: ClassVar[int] = 5
    outputs: list[RequestOutput]
    # Outputs of the steady case (one per sample, as `outputs` are: a sample is in one or the
    # other in a message)
    plain: OutputColumns = field(default_factory=OutputColumns)

    def all_outputs(self) -> list[RequestOutput]:
        """`outputs` and the columns' (the order between samples carries nothing)."""
        return self.outputs + self.plain.outputs() if self.plain else self.outputs


# ---------------------------------------------------------------- scheduler <-> executor


@dataclass(frozen=True, slots=True)
class StepPlan(Message):
    """Step `step_id`; its bulk inputs lie in slot `ring_slot` of the step-input ring
    (layout: ipc/step.py).

    The ring slot holds num_seqs sequence rows, num_tokens token ids (-1 = placeholder: the
    token this sequence's executor slot sampled last), num_block_updates block-table writes,
    num_new_slots sequences taking an executor slot (their encoded sampling parameters) and
    num_stop_ids (slot, token id) pairs that min_tokens suppresses.
    """

    TAG: ClassVar[int] = 6
    step_id: int
    ring_slot: int
    num_seqs: int
    num_tokens: int
    num_block_updates: int
    num_new_slots: int
    num_stop_ids: int
    grammars: list[SlotGrammar] = field(default_factory=list)
    num_prompt_logprobs: int = 0  # positions whose logits score the next prompt token
    logit_biases: list[SlotLogitBias] = field(default_factory=list)  # new slots with one
    # Adapters loaded at run time that this step's rows need, loaded before its forward,
    # and the ids evicted first to make room (stages/scheduler/adapters.py)
    lora_loads: list[LoraLoad] = field(default_factory=list)
    lora_evictions: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoraLoad(Struct):
    """An adapter loaded at run time takes adapter id `adapter_id` in the executor: its
    served name and PEFT folder (checked by the server before it was taken)."""

    adapter_id: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class SlotLogitBias(Struct):
    """A sequence with a logit_bias takes executor slot `slot` (with a StepPlan): the ids and
    the biases its sampler adds (a step without one carries nothing: most steps)."""

    slot: int
    token_ids: list[int]
    biases: list[float]


@dataclass(frozen=True, slots=True)
class SlotGrammar(Struct):
    """A sequence with a structured output takes executor slot `slot` (with a StepPlan): its
    grammar text, and the outputs it already has (a preempted sequence resuming) for the
    slot's matcher to catch up on."""

    slot: int
    grammar: str
    output_ids: list[int] = field(default_factory=list)
    reasoning: ReasoningTags | None = None  # the grammar starts after the reasoning


@dataclass(frozen=True, slots=True)
class SampledTokens(Message):
    """Step `step_id` is done; its sampled ids lie in `ring_slot` of the sampled-token ring,
    one per sampled position, in the order of the step's sequence rows (a row's, and one
    per draft of a row with drafts; then how many stand per drafted row)."""

    TAG: ClassVar[int] = 7
    step_id: int
    ring_slot: int
    num_sampled: int
    device_start: float = 0.0
    device_end: float = 0.0
    num_top_logprobs: int = -1  # -1: no logprobs this step; k: logprob + k alternatives
    num_prompt_logprobs: int = 0  # prompt-token logprobs in the ring (StepPlan's count)
    # One pooled vector (float32 bytes) per row that ended a pooling request's prompt, in
    # row order: carried here, not in the ring, since it goes on to the client as bytes.
    pooled: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LastStep(Message):
    """From an engine's first executor rank to its other tensor-parallel ranks as it stops:
    `step_id` is the last plan it forwarded (-1: none), which it runs too. Each rank runs the
    plans up to it and then stops, so no rank waits in a collective for one that left."""

    TAG: ClassVar[int] = 21
    step_id: int


@dataclass(frozen=True, slots=True)
class RemoteStep(Message):
    """A step plan and its ring slot's contents (ipc/step.py step_columns), from an engine's
    first executor rank to a rank of a pipeline stage on another host, which maps no ring."""

    TAG: ClassVar[int] = 23
    plan: StepPlan
    columns: dict[str, bytes]


@dataclass(frozen=True, slots=True)
class RemoteSampled(Message):
    """A step's samples from a sampling rank on another host to the engine's first rank,
    which writes `columns` (ipc/step.py sampled_columns) into the sampled-token ring and
    passes `tokens` on to the scheduler."""

    TAG: ClassVar[int] = 24
    tokens: SampledTokens
    columns: dict[str, bytes]


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
class StageAlive(Message):
    """From a stage on another host, every HEARTBEAT_S: it still runs (the launcher cannot
    watch its process; one silent for REMOTE_SILENCE_S is gone)."""

    TAG: ClassVar[int] = 20
    stage: str
    rank: int


@dataclass(frozen=True, slots=True)
class StageLeaving(Message):
    """From a stage on another host that stops of its own accord (a signal, a death on its
    host): gone now, rather than after REMOTE_SILENCE_S of silence; reason says why."""

    TAG: ClassVar[int] = 22
    stage: str
    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class JoinedRankDied(Message):
    """From a host running an engine's joined pipeline stages to the launcher: its rank
    `rank` (global), started at `rendezvous`, died; the launcher starts the engine again if
    that is the engine's rendezvous still (a rank of a past start is no news)."""

    TAG: ClassVar[int] = 25
    engine: int
    rank: int
    rendezvous: str
    message: str


@dataclass(frozen=True, slots=True)
class StageFailed(Message):
    """A stage is about to die; message says why."""

    TAG: ClassVar[int] = 9
    stage: str
    rank: int
    pid: int
    message: str


@dataclass(frozen=True, slots=True)
class Histogram(Struct):
    """Counts per bucket (the bounds are the metric's, the last bucket +Inf) and their sum."""

    buckets: list[int]
    sum: float


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
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused
    num_cached_blocks: int = 0  # free blocks that still hold reusable KV
    finished: dict[str, int] = field(default_factory=dict)  # by FinishReason value
    prompt_tokens: int = 0  # of requests admitted
    generation_tokens: int = 0  # sampled and kept
    step_seconds_buckets: list[int] = field(default_factory=list)  # see STEP_SECONDS_BOUNDS
    step_seconds_sum: float = 0.0
    step_tokens_buckets: list[int] = field(default_factory=list)  # see STEP_TOKENS_BOUNDS
    step_tokens_sum: int = 0
    device_idle_fraction: float = 0.0  # over the last few seconds of steps
    uptime_s: float = 0.0
    num_refused_messages: int = 0  # frames the scheduler refused: foreign or malformed
    # Finished requests (sample 0 of each) by phase (REQUEST_PHASES): waiting for admission,
    # admission to first token, first token to end, admission to end.
    request_phases: dict[str, Histogram] = field(default_factory=dict)
    engine: int = 0  # which data-parallel engine's scheduler this is
    # Tokens of work its unfinished sequences hold (prompt and output, waiting or running):
    # the load the tokenizers' router balances (stages/router.py).
    load_tokens: int = 0
    # Speculative decoding (vLLM's spec_decode counters): rows planned with drafts, their
    # draft tokens, the drafts accepted, and accepted drafts by position in the row.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    run_ahead_depth: int = 0  # steps that may be in flight now (--run-ahead-depth)
    # Positions computed for a sequence that had already finished (its run-ahead steps'
    # tokens), dropped: up to depth - 1 per finished sequence.
    discarded_tokens: int = 0
    # The KV cache's configuration (vLLM's cache_config_info): tokens a block, and its format
    # as --kv-cache-dtype names it (auto: the model's dtype).
    block_size: int = 0
    cache_dtype: str = ""
    # The most KV blocks one sequence held at once since the start: with a sliding window on
    # every layer, about window / block_size however long the sequences grow.
    max_seq_blocks: int = 0


# Upper bounds of the scheduler's histogram buckets (the last bucket is +Inf).
STEP_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_TOKENS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# vLLM's request-time buckets, so that dashboards built for it read ours alike.
REQUEST_SECONDS_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                          50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REQUEST_PHASES = ("queue", "prefill", "decode", "inference")


@dataclass(frozen=True, slots=True)
class PipelineStatus(Message):
    """Published by the launcher a few times a second to anyone subscribed (clients, the HTTP
    front ends): which stages are alive and the scheduler's latest accounting."""

    TAG: ClassVar[int] = 11
    time: float  # time.time() of publication
    stages: dict[str, bool]  # "stage:rank" -> alive
    failure: str | None
    scheduler: SchedulerStats | None
    restarts: dict[str, int] = field(default_factory=dict)  # "stage:rank" -> times restarted
    # Data-parallel engines (scheduler is then their sum): each one's load in tokens, and
    # whether it serves (an engine whose scheduler or executor died serves again once it
    # has been started again: engines_restarting names it meanwhile).
    engine_loads: list[int] = field(default_factory=list)
    engines_alive: list[bool] = field(default_factory=list)
    # Stages that joined from other hosts, for remote clients: "tokenizer:R" -> its tcp://
    # request inbox, "scheduler:E" -> its tcp:// abort inbox.
    joined: dict[str, str] = field(default_factory=dict)
    stopping: bool = False  # the launcher is stopping the pipeline: stages that joined stop
    left: list[str] = field(default_factory=list)  # joined stages that have left (gone)
    engines_restarting: list[int] = field(default_factory=list)
    engines_down_why: dict[str, str] = field(default_factory=dict)  # "E" -> the death, in words
    # An engine's executor ranks beyond one: "executor:R" -> its place, engine.stage.rank
    # ("e0.s1.t0"; ipc/ranks.py RankLayout.describe)
    ranks: dict[str, str] = field(default_factory=dict)
    # Hosts that joined to run an engine's last pipeline stages: "pipeline:N" -> HOST:PORT
    # of the TCP store the engine's ranks meet in now (a new one each time the engine
    # starts): that host starts its ranks there (pipeline/runtime/remote.py)
    rendezvous: dict[str, str] = field(default_factory=dict)
    # With --listen: "E" -> the tcp:// abort inbox of the launcher's host's engine E as it
    # runs now (a port of its own each time it starts: remote clients follow it)
    abort_inboxes: dict[str, str] = field(default_factory=dict)


ALL_MESSAGES: tuple[type[Message], ...] = (
    AddRequest,
    AbortRequest,
    Reconcile,
    EngineReconcile,
    ReconcileAnswer,
    EngineDown,
    Members,
    ForgetClient,
    StageRestarted,
    StopSample,
    TokenizedRequest,
    DetokBatch,
    RequestOutputs,
    StepPlan,
    LastStep,
    RemoteStep,
    RemoteSampled,
    JoinedRankDied,
    SampledTokens,
    StageReady,
    StageAlive,
    StageLeaving,
    StageFailed,
    SchedulerStats,
    PipelineStatus,
)
