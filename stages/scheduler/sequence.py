"""One sample of one request inside the scheduler process (a request with n > 1 has n).

Token accounting with run-ahead: `output_ids` holds sampled tokens already known; `num_pending`
counts tokens sampled by steps still in flight. Their KV is not yet computed: the next step
feeds the newest of them as a placeholder, resolved on the device.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass, field

from ipc.messages import FinishReason, SamplingParams, TokenLogprob
from stages.scheduler.block_allocator import BlockKey
from stages.scheduler.speculative import ProposalState

# A page of Pages.blocks given back once out of a sliding window (KVManager.trim).
NO_BLOCK = -1


@dataclass(eq=False)
class Pages:
    """A sequence's pages in one KV group (KVManager.groups): entry j holds tokens
    [j * block_size, (j + 1) * block_size) in block blocks[j] of the group's pool; the first
    num_trimmed fell out of the group's window and were given back (NO_BLOCK); the first
    num_registered were offered to the group's prefix cache. Every group of a running
    sequence has as many pages."""

    blocks: list[int] = field(default_factory=list)
    num_trimmed: int = 0
    num_registered: int = 0

    @property
    def num_held(self) -> int:
        """Blocks it holds: its pages' but those given back."""
        return len(self.blocks) - self.num_trimmed


class SeqStatus(enum.Enum):
    """A sample's state; every change goes through Sequence.move_to, which allows only
    the transitions of _TRANSITIONS. (Prefilling is RUNNING with its prompt not all computed;
    preempted is WAITING with num_preemptions > 0.)"""

    HELD = "held"  # sample 1..n-1, until sample 0's prompt is planned (its blocks cached)
    WAITING = "waiting"  # in the waiting queue, by fair-queueing tag and arrival
    RUNNING = "running"  # holds an executor slot and KV blocks
    PREEMPTING = "preempting"  # a victim: leaves the running set once num_inflight is 0
    FINISHED = "finished"  # told to the client; blocks freed once num_inflight is 0


_TRANSITIONS = {
    SeqStatus.HELD: {SeqStatus.WAITING, SeqStatus.FINISHED},
    SeqStatus.WAITING: {SeqStatus.RUNNING, SeqStatus.FINISHED},
    SeqStatus.RUNNING: {SeqStatus.PREEMPTING, SeqStatus.FINISHED},
    SeqStatus.PREEMPTING: {SeqStatus.WAITING, SeqStatus.FINISHED},
    SeqStatus.FINISHED: set(),
}


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0  # sample index among the request's n
    order: int = 0  # arrival order in the scheduler: breaks ties between equal tags
    tag: int = 0  # fair-queueing start tag (QueuePolicy.tag_request): waiting order
    # Within its sender, requests are weighted fair queued: this sample's start and finish in
    # the sender's own virtual time (QueuePolicy.tag_request, promote_within_sender).
    inner_start: float = 0.0
    inner_finish: float = 0.0
    sender: str = ""  # whose share it counts against: the client and the request's user
    reply_to: str = ""  # the client's address
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for
    num_pending: int = 0  # sampled by in-flight steps, ids not yet known
    num_computed: int = 0  # tokens whose KV is written or being written
    # its pages in each KV group (one group: every layer's; KVManager.admit makes them)
    pages: list[Pages] = field(default_factory=lambda: [Pages()])
    # While its n > 1 siblings wait to be admitted (sample 0's, set by the scheduler), the
    # first page its windowed groups keep: the siblings' prefix hit needs the pages from it
    # on (KVManager.trim). None: the window alone decides.
    trim_floor: int | None = None
    block_keys: list[BlockKey] = field(default_factory=list)  # of its leading full blocks
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    slot: int | None = None
    num_inflight: int = 0  # in-flight steps that include this sequence
    num_preemptions: int = 0
    resumed_at: int | None = None  # len(output_ids) when last re-admitted after a preemption
    finish_reason: FinishReason | None = None
    stop_token: int | None = None  # the stop token id that finished it, if one did
    num_sent: int = 0  # output tokens already handed to the detokenizer
    grammar: str = ""  # its structured output as grammar text (stages/grammar.py)
    admitted_at: float | None = None  # wall clock of its first admission
    first_token_at: float | None = None  # wall clock of its first output token
    # prompt_logprobs: entry i scores prompt token i + 1; positions planned so far; sent?
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_plp_planned: int = 0
    plp_sent: bool = False
    error: str | None = None  # why it finished with an error, if it did
    embedding: bytes | None = None  # a pooling request's vector, once its prompt is computed
    # Speculative decoding: its back-off and n-gram index (made on its first proposal), and
    # its steps in flight that carry drafts (while one is, it is not planned again: how many
    # tokens stand is not known yet, so neither is where the next one goes)
    proposal: ProposalState | None = None
    num_drafted_inflight: int = 0
    # With a draft model: whether the executor's draft model keeps its KV, so that it may
    # draft (decided as it takes its slot)
    draft_model_kv: bool = False
    # Screens for the checks every step makes (stopping.py), set as the scheduler takes the
    # request: the output count that ends it by length (output_limit), and the ids that end
    # it once past min_tokens (stopping_ids). Only a sample that passes a screen gets the full
    # check; the defaults send every one to it.
    output_limit: int = 0
    stopping_ids: frozenset[int] = frozenset()
    # With pipeline stages: the id of the last step that planned a sampled row for it. While
    # that step is among the P - 1 before the one being planned, its sample is still in the
    # pipeline and the sequence sits that step out (StepBuilder._fill_staged). Not kept
    # with one stage.
    sampled_in_step: int = -1
    # Its LoRA adapter's id (ipc/lora.py; 0: the base model): its rows' adapter_id, and the
    # seed of its prefix-cache keys, so the KV computed under one adapter is never another's.
    adapter_id: int = 0

    def move_to(self, status: SeqStatus) -> None:
        if status not in _TRANSITIONS[self.status]:
            raise RuntimeError(f"sequence {self.request_id}/{self.index}: no transition from "
                               f"{self.status.value} to {status.value}")
        self.status = status

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Waiting order: fair-queueing tag, then arrival, then sample index."""
        return (self.tag, self.order, self.index)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt logprobs are computed (sample 0 of a request that asks)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def pools_every_token(self) -> bool:
        """An embedding pooled over its prompt's tokens (mean) or its first (cls): computed
        in full, never from the prefix cache, whose blocks hold KV but not hidden states."""
        return self.params.pooling in ("mean", "cls")

    @property
    def is_just_resumed(self) -> bool:
        """Re-admitted after a preemption and not one new token since: not the next victim."""
        return self.resumed_at == len(self.output_ids)

    @property
    def blocks(self) -> list[int]:
        """Its pages' blocks in the first KV group (every layer's, or the layers that read
        every key beside windowed ones)."""
        return self.pages[0].blocks

    @property
    def num_trimmed(self) -> int:
        return self.pages[0].num_trimmed

    @property
    def num_registered(self) -> int:
        return self.pages[0].num_registered

    @property
    def num_held_blocks(self) -> int:
        """Blocks it holds in the first KV group: its pages' but those given back."""
        return self.pages[0].num_held

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known + self.num_pending

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids) + self.num_pending

    def token_at(self, index: int) -> int:
        """The id of token `index`, or -1 if it is still being sampled (a placeholder)."""
        num_prompt = len(self.prompt_ids)
        if index < num_prompt:
            return self.prompt_ids[index]
        if index < self.num_known:
            return self.output_ids[index - num_prompt]
        return -1

    def tokens(self, start: int, end: int) -> list[int]:
        """The ids of tokens [start, end), with -1 for those still being sampled."""
        num_prompt, prompt, outputs = len(self.prompt_ids), self.prompt_ids, self.output_ids
        if end <= num_prompt:
            return prompt[start:end]
        known = (prompt[start:] if start < num_prompt else []) + outputs[
            max(start - num_prompt, 0):end - num_prompt]
        return known + [-1] * (end - start - len(known))

    def keys_for(self, num_blocks: int, block_size: int) -> list[BlockKey]:
        """Prefix-cache keys of the first num_blocks full blocks (all their tokens known)."""
        while len(self.block_keys) < num_blocks:
            i = len(self.block_keys)
            tokens = self.tokens(i * block_size, (i + 1) * block_size)
            assert -1 not in tokens
            parent = (self.block_keys[-1] if self.block_keys
                      else adapter_seed(self.adapter_id))
            self.block_keys.append(block_key(parent, tokens))
        return self.block_keys[:num_blocks]


def adapter_seed(adapter_id: int) -> BlockKey:
    """The parent of a sequence's first block key: b"" for the base model, the adapter's id
    otherwise (ids are never reused for another adapter within a run)."""
    return b"" if adapter_id == 0 else b"lora" + adapter_id.to_bytes(4, "little")


def block_key(parent: BlockKey, tokens: list[int]) -> BlockKey:
    """A 128-bit BLAKE2b digest of the previous block's key and this block's tokens: equal
    keys mean equal prefixes (a collision, even a crafted one, is out of reach), so one
    request can never be served another's KV."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()
