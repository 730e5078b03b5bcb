"""Speculative decoding's side of planning, in the scheduler process: how many drafts a
decoding row carries (proposer, max_tokens, context, budget and KV room), whether the draft
model keeps a sample's KV, and the counts of drafts planned and accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.sampling import uses_penalties
from ipc.speculative import SpeculativeConfig
from stages.scheduler.kv_manager import KVManager
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import Sequence
from stages.scheduler.speculative import ProposalState, Proposer, make_proposer


@dataclass
class DraftCounts:
    """Speculative decoding's counts for SchedulerStats (all zero without speculation)."""

    num_drafts: int = 0  # rows planned with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # one per draft position


class DraftPlanner:
    def __init__(self, speculative: SpeculativeConfig, max_len: int, max_num_seqs: int,
                 counts: DraftCounts) -> None:
        """counts: where to count, with accepted_per_pos as long as speculative's K."""
        self.proposer: Proposer = make_proposer(speculative)
        self.cfg = speculative
        self.num_speculative_tokens = speculative.num_tokens
        self.max_len, self.max_num_seqs = max_len, max_num_seqs
        self.counts = counts

    def keeps_kv(self, seq: Sequence, num_running: int, num_waiting: int) -> bool:
        """Whether the draft model keeps the KV of seq, which takes its slot now: one that
        may draft (not opted out, no penalties, no structured output), joining a batch of
        at most max_batch sequences. It stops for good once more run (StepBuilder): the
        draft model's passes over every row would cost each step more than drafts win
        back."""
        if not self.cfg.is_draft_model:
            return False
        p = seq.params
        if not p.speculate or uses_penalties(p) or seq.grammar:
            return False
        limit = self.cfg.max_batch
        # (the batch it joins: a burst that will fill the slots counts already)
        soon = min(num_running + num_waiting, self.max_num_seqs)
        return limit is None or soon <= limit

    def over_batch(self, num_running: int) -> bool:
        """More sequences run than drafting pays for (the configuration's max_batch)."""
        limit = self.cfg.max_batch
        return limit is not None and num_running > limit

    def room(self, seq: Sequence, more: int = 0) -> int:
        """The drafts seq's max_tokens and the context leave it room for (with `more` of
        its tokens beyond those planned so far): each row also samples one token."""
        room = self.max_len - (seq.num_tokens + more) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - (seq.num_outputs + more) - 1)
        return room

    def is_last(self, seq: Sequence, num_drafts: int) -> bool:
        """Whether, if a row's drafts all stand, seq has no room to draft again: the
        executor then runs no draft passes ahead of the next step (drafter.py)."""
        return self.room(seq, 1 + num_drafts) <= 0

    def drafts(self, step: PlannedStep, seq: Sequence, budget: int, kv: KVManager) -> list[int]:
        """The tokens proposed to follow decoding sequence seq this step (none for a request
        that opts out or has penalties: the executor counts tokens as they are computed; a
        structured output's matcher masks each proposed position, so a draft model, whose
        drafts the host never sees, drafts none for one: keeps_kv). Never more than its
        max_tokens, the context, the step's token budget or the KV blocks it holds and the
        free ones allow: a draft never preempts anything. None while more sequences run
        than the configuration's max_batch."""
        p = seq.params
        if not p.speculate or uses_penalties(p):
            return []
        if self.cfg.is_draft_model and not seq.draft_model_kv:
            return []
        if self.over_batch(len(kv.running)):
            return []  # (drafting stopped paying: ipc/speculative.py DRAFT_MAX_BATCH)
        most = min(self.num_speculative_tokens, budget, self.room(seq))
        if most <= 0:
            return []
        if seq.proposal is None:
            seq.proposal = ProposalState()
        drafts = self.proposer.propose(seq.proposal, seq.prompt_ids, seq.output_ids,
                                       seq.num_pending, most)
        if not drafts:
            return []
        # KV room: the blocks it holds, and free ones. A draft model's row holds the
        # position after its drafts too (where its last sample lands if all stand), whose
        # block the executor's draft passes run ahead in (drafter.py).
        bonus = int(self.cfg.is_draft_model)
        held = kv.draft_room(step, seq, seq.num_tokens + len(drafts) + bonus)
        return drafts[:max(0, held - seq.num_tokens - bonus)]

    def count_planned(self, num_drafts: int) -> None:
        self.counts.num_drafts += 1
        self.counts.num_draft_tokens += num_drafts

    def count_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """A drafted row's result: the counts, and the sample's back-off (Proposer.record)."""
        self.counts.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.counts.accepted_per_pos[pos] += 1
        if seq.proposal is not None:
            Proposer.record(seq.proposal, num_accepted)
