"""A step as the scheduler plans it, and its layout into a step-input ring slot (ipc/step.py).
Runs in the scheduler process (and in the in-process engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ipc.messages import SlotGrammar, StepPlan
from ipc.step import NewSlot, write_step
from stages.scheduler.sequence import Sequence


@dataclass
class StepRow:
    seq: Sequence
    token_ids: list[int]  # -1 for a placeholder
    context_len: int  # KV length after this step
    do_sample: bool
    num_draft: int = 0  # its last tokens that are proposed, to be verified (speculation)
    draft_kv: bool = False  # the executor's draft model keeps the row's KV
    last_drafts: bool = False  # if its drafts all stand, the sequence may draft no more


@dataclass
class PlannedStep:
    step_id: int
    ring_slot: int = -1  # its slot in both rings, held until its result is in
    rows: list[StepRow] = field(default_factory=list)
    block_updates: list[tuple[int, int, int]] = field(default_factory=list)  # slot, index, block
    new_slots: list[NewSlot] = field(default_factory=list)  # sequences taking a slot
    stop_ids: list[tuple[int, int]] = field(default_factory=list)  # (slot, id) min_tokens masks
    grammars: list[SlotGrammar] = field(default_factory=list)  # new slots with a grammar
    # (token index in the step, prompt token it scores), and whose they are, in order
    prompt_logprobs: list[tuple[int, int]] = field(default_factory=list)
    plp_owners: list[tuple[Sequence, int]] = field(default_factory=list)
    members: set[Sequence] = field(default_factory=set)  # sequences planned in this step
    is_starved: bool = False  # a running sequence could not get blocks
    has_preempted: bool = False
    num_tokens: int = 0

    @property
    def sampled_rows(self) -> list[StepRow]:
        return [r for r in self.rows if r.do_sample]

    @property
    def num_drafted_rows(self) -> int:
        """Rows carrying drafts: how many accepted counts its result holds."""
        return sum(1 for r in self.rows if r.num_draft)

    def write(self, buf: dict[str, np.ndarray]) -> StepPlan:
        """Lay this step into its step-input ring slot; returns the plan to send."""
        rows = self.rows
        return write_step(
            buf, self.step_id, self.ring_slot,
            input_ids=[t for r in rows for t in r.token_ids],
            seq_slots=[r.seq.slot for r in rows],  # type: ignore[misc]
            query_lens=[len(r.token_ids) for r in rows],
            context_lens=[r.context_len for r in rows], do_sample=[r.do_sample for r in rows],
            block_updates=self.block_updates, new_slots=self.new_slots, stop_ids=self.stop_ids,
            grammars=self.grammars, prompt_logprobs=self.prompt_logprobs,
            num_drafts=[r.num_draft for r in rows], draft_kv=[r.draft_kv for r in rows],
            last_drafts=[r.last_drafts for r in rows])
