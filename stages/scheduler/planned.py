"""A step as the scheduler plans it, laid into a step-input ring slot by ipc/step.py's
write_step. Runs in the scheduler process (and in the in-process engine)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ipc.messages import LoraLoad, SlotGrammar, SlotLogitBias, StepPlan
from ipc.step import NewSlot, StepRow, write_step
from stages.scheduler.sequence import Sequence


@dataclass(slots=True)
class PlannedRow(StepRow):
    """A row of the step (ipc/step.py StepRow: its fields, as the ring carries them) and the
    sequence it is for."""

    seq: Sequence = field(kw_only=True)


@dataclass
class PlannedStep:
    step_id: int
    ring_slot: int = -1  # its slot in both rings, held until its result is in
    rows: list[PlannedRow] = field(default_factory=list)
    block_updates: list[tuple[int, int, int]] = field(default_factory=list)  # slot, index, block
    new_slots: list[NewSlot] = field(default_factory=list)  # sequences taking a slot
    stop_ids: list[tuple[int, int]] = field(default_factory=list)  # (slot, id) min_tokens masks
    grammars: list[SlotGrammar] = field(default_factory=list)  # new slots with a grammar
    logit_biases: list[SlotLogitBias] = field(default_factory=list)  # new slots with one
    # runtime LoRA adapters its rows need loaded, and those evicted for them (adapters.py)
    lora_loads: list[LoraLoad] = field(default_factory=list)
    lora_evictions: list[int] = field(default_factory=list)
    # (token index in the step, prompt token it scores), and whose they are, in order
    prompt_logprobs: list[tuple[int, int]] = field(default_factory=list)
    plp_owners: list[tuple[Sequence, int]] = field(default_factory=list)
    members: set[Sequence] = field(default_factory=set)  # sequences planned in this step
    is_starved: bool = False  # a running sequence could not get blocks
    has_preempted: bool = False
    num_tokens: int = 0
    # positions it samples (the ids its result holds): one per sampled row, and one more per
    # draft of a row with drafts
    num_sampled: int = 0
    num_plain: int = 0  # its leading rows that are plain decodes (write_step's num_plain)

    @property
    def sampled_rows(self) -> list[PlannedRow]:
        return [r for r in self.rows if r.do_sample]

    @property
    def num_drafted_rows(self) -> int:
        """Rows carrying drafts: how many accepted counts its result holds."""
        return sum(1 for r in self.rows if r.num_draft)

    def write(self, buf: dict[str, np.ndarray]) -> StepPlan:
        """Lay this step into its step-input ring slot; returns the plan to send."""
        plan = write_step(buf, self.step_id, self.ring_slot, self.rows,
                          block_updates=self.block_updates, new_slots=self.new_slots,
                          stop_ids=self.stop_ids, prompt_logprobs=self.prompt_logprobs,
                          grammars=self.grammars, num_plain=self.num_plain,
                          logit_biases=self.logit_biases)
        if self.lora_loads:
            plan = dataclasses.replace(plan, lora_loads=self.lora_loads,
                                       lora_evictions=self.lora_evictions)
        return plan
