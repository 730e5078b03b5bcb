"""One request's state inside the scheduler process.

Token accounting with run-ahead: `output_ids` holds sampled tokens already known; `num_pending`
counts tokens sampled by steps still in flight. Their KV is not yet computed: the next step
feeds the newest of them as a placeholder, resolved on the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ipc.messages import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # told to the client; blocks freed once num_inflight is 0


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_pending: int = 0  # sampled by in-flight steps, ids not yet known
    num_computed: int = 0  # tokens whose KV is written or being written
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    num_inflight: int = 0  # in-flight steps that include this sequence
    is_preempting: bool = False  # leaves the running set once num_inflight is 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    num_sent: int = 0  # output tokens already handed to the detokenizer

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
