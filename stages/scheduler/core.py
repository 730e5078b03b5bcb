"""Continuous batching core of the scheduler process: no sockets, unit-tested directly.

One step reads as: `schedule()` plans the next step (it may run `depth` steps ahead of the
executor), `on_sampled()` takes a step's sampled ids, `take_outputs()` hands token deltas on.
Decodes are planned first, then chunks of prompts, first come first served.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ipc.messages import (
    DetokRequestInfo,
    RequestRejected,
    SchedulerStats,
    SlotInit,
    TokenDelta,
    TokenizedRequest,
)
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_block_updates: int
    eos_token_ids: tuple[int, ...]
    depth: int = 2


class StepOutputs(NamedTuple):
    infos: list[DetokRequestInfo]
    deltas: list[TokenDelta]
    rejected: list[RequestRejected]


@dataclass
class StepRow:
    seq: Sequence
    token_ids: list[int]  # -1 for a placeholder
    context_len: int  # KV length after this step
    do_sample: bool


@dataclass
class PlannedStep:
    step_id: int
    ring_slot: int = -1  # its slot in both rings, held until its result is in
    rows: list[StepRow] = field(default_factory=list)
    block_updates: list[tuple[int, int, int]] = field(default_factory=list)  # slot, index, block
    new_slots: list[SlotInit] = field(default_factory=list)
    members: set[str] = field(default_factory=set)  # request ids planned in this step
    is_starved: bool = False  # a running sequence could not get blocks
    has_preempted: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [r.seq for r in self.rows if r.do_sample]


class Scheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        # A sequence may not outgrow the whole cache: past it, it could only preempt itself.
        self.max_len = min(limits.max_model_len, limits.num_blocks * limits.block_size)
        self.allocator = BlockAllocator(limits.num_blocks, limits.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.free_slots: list[int] = list(range(limits.max_num_seqs - 1, -1, -1))
        self.inflight: deque[PlannedStep] = deque()
        # A ring slot is rewritten only after the step that used it reported back.
        self.free_ring_slots: list[int] = list(range(limits.depth, -1, -1))
        self.next_step_id = 0
        self._early_aborts: dict[str, float] = {}
        self._new_infos: list[DetokRequestInfo] = []
        self._rejected: list[RequestRejected] = []
        self._touched: dict[str, Sequence] = {}  # new tokens or finished since take_outputs
        self.num_preemptions = 0

    # ------------------------------------------------------------ requests in

    def add_request(self, req: TokenizedRequest) -> None:
        error = self._admission_error(req)
        if error is not None:
            reason, message = error
            self._rejected.append(RequestRejected(req.request_id, req.reply_to, reason, message,
                                                  len(req.prompt_token_ids)))
            return
        self._new_infos.append(DetokRequestInfo(
            req.request_id, req.reply_to, len(req.prompt_token_ids),
            req.params.skip_special_tokens, req.arrival_time))
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, req.arrival_time)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def _admission_error(self, req: TokenizedRequest) -> tuple[str, str | None] | None:
        """(finish_reason, message) if the request cannot be taken."""
        if req.request_id in self.requests:
            return "error", f"request id {req.request_id!r} is already in use"
        if self._early_aborts.pop(req.request_id, None) is not None:
            return "abort", None
        needed = self.allocator.blocks_for(len(req.prompt_token_ids) + 1)
        if needed > self.limits.num_blocks:
            return "error", (f"the prompt needs {needed} KV blocks but the cache has only "
                             f"{self.limits.num_blocks}; raise --kv-cache-memory or shorten it")
        return None

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            # It may still be in a tokenizer: remember it for a while.
            now = time.monotonic()
            self._early_aborts = {k: t for k, t in self._early_aborts.items() if now - t < 60}
            self._early_aborts[request_id] = now
            return
        self._finish(seq, "abort")

    # ------------------------------------------------------------ planning

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(self._wants_step(s) for s in self.running)

    def can_schedule(self) -> bool:
        return len(self.inflight) < self.limits.depth and self.has_work

    def schedule(self) -> PlannedStep | None:
        """Plan the next step, or None if there is nothing to run or too much in flight."""
        if not self.can_schedule():
            return None
        step = PlannedStep(self.next_step_id)
        budget = self.limits.max_num_batched_tokens
        ready = [s for s in self.running if self._wants_step(s)]
        decodes = [s for s in ready if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in ready if s.num_tokens - s.num_computed > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if self._wants_step(seq):  # an earlier row of this step may have preempted it
                budget -= self._plan_row(step, seq, budget)
        budget = self._admit(step, budget)
        if not step.rows:
            return None
        self.next_step_id += 1
        step.ring_slot = self.free_ring_slots.pop()
        for row in step.rows:
            row.seq.num_inflight += 1
        self.inflight.append(step)
        return step

    def _wants_step(self, seq: Sequence) -> bool:
        if seq.status is not SeqStatus.RUNNING or seq.is_preempting:
            return False
        if seq.num_computed >= seq.num_tokens:
            return False  # all computed: waiting for its sample
        # Stop planning once the tokens in flight already reach a length limit.
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and seq.num_outputs >= max_tokens:
            return False
        return seq.num_tokens < self.max_len

    def _plan_row(self, step: PlannedStep, seq: Sequence, budget: int) -> int:
        """Add seq's next chunk to step; returns the tokens used (0 if it must wait)."""
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        if not self._grow(step, seq, seq.num_computed + num_new):
            step.is_starved = True
            return 0
        step.members.add(seq.request_id)
        start = seq.num_computed
        ids = [seq.token_at(i) for i in range(start, start + num_new)]
        seq.num_computed += num_new
        do_sample = seq.num_computed == seq.num_tokens
        step.rows.append(StepRow(seq, ids, seq.num_computed, do_sample))
        if do_sample:
            seq.num_pending += 1
        return num_new

    def _grow(self, step: PlannedStep, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens tokens, preempting a later sequence if need be."""
        needed = self.allocator.blocks_for(num_tokens) - len(seq.blocks)
        if needed <= 0:
            return True
        if len(step.block_updates) + needed > self.limits.max_block_updates:
            return False
        blocks = self.allocator.allocate(needed)
        while blocks is None:
            if not self._preempt_one(step, seq):
                return False
            blocks = self.allocator.allocate(needed)
        for block in blocks:
            step.block_updates.append((seq.slot, len(seq.blocks), block))  # type: ignore[arg-type]
            seq.blocks.append(block)
        return True

    def _preempt_one(self, step: PlannedStep, needy: Sequence) -> bool:
        """Preempt the latest running sequence not in this step (needy itself as a last
        resort). True if blocks were freed now; False if none were (they may be on their way)."""
        if any(s.is_preempting for s in self.running):
            return False  # blocks are on their way back; wait for them
        candidates = [s for s in self.running if s.request_id not in step.members and s.blocks
                      and s.status is SeqStatus.RUNNING]
        victims = [s for s in candidates if s is not needy] or candidates
        if not victims:
            return False
        victim = victims[-1]
        step.has_preempted = True  # no admission in this step: the victim would come right back
        self._start_preemption(victim)
        return not victim.is_preempting and victim is not needy

    def _start_preemption(self, seq: Sequence) -> None:
        seq.is_preempting = True
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._maybe_release(seq)

    def _admit(self, step: PlannedStep, budget: int) -> int:
        while (self.waiting and budget > 0 and self.free_slots and not step.is_starved
               and not step.has_preempted):
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if self.allocator.blocks_for(num_new) > self.allocator.num_free:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            step.new_slots.append(SlotInit(seq.slot, seq.params.temperature))
            budget -= self._plan_row(step, seq, budget)
        return budget

    # ------------------------------------------------------------ results in

    def on_sampled(self, step_id: int, token_ids: list[int]) -> None:
        """Step `step_id` finished; token_ids has one id per sampling row, in row order."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"executor reported step {step_id}, expected {step.step_id}")
        self.free_ring_slots.append(step.ring_slot)
        sampled = step.sampled_seqs
        if len(sampled) != len(token_ids):
            raise RuntimeError(f"step {step_id}: {len(token_ids)} ids for {len(sampled)} rows")
        for seq, token in zip(sampled, token_ids, strict=True):
            seq.num_pending -= 1
            if seq.status is SeqStatus.RUNNING:  # a finished one's extra token is dropped
                seq.output_ids.append(token)
                self._touched[seq.request_id] = seq
                self._check_stop(seq, token)
        for row in step.rows:
            row.seq.num_inflight -= 1
            self._maybe_release(row.seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        is_eos = not params.ignore_eos and token in self.limits.eos_token_ids
        if is_eos or token in params.stop_token_ids:
            self._finish(seq, "stop")
            return
        max_tokens = params.max_tokens
        if (max_tokens is not None and len(seq.output_ids) >= max_tokens
                or seq.num_known >= self.max_len):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._touched[seq.request_id] = seq
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._maybe_release(seq)

    def _maybe_release(self, seq: Sequence) -> None:
        """Free blocks and slot once no in-flight step can still write them."""
        if seq.num_inflight:
            return
        if seq.status is SeqStatus.FINISHED and seq.request_id in self.requests:
            self._release(seq)
            del self.requests[seq.request_id]
        elif seq.is_preempting and seq.status is SeqStatus.RUNNING:
            self._release(seq)
            seq.is_preempting = False
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)

    def stats(self) -> SchedulerStats:
        lim = self.limits
        return SchedulerStats(
            lim.num_blocks, self.allocator.num_free, lim.max_num_seqs, len(self.free_slots),
            lim.depth + 1, len(self.free_ring_slots), len(self.inflight), len(self.waiting),
            len(self.running), len(self.requests), self.num_preemptions, self.next_step_id)

    # ------------------------------------------------------------ outputs

    def take_outputs(self) -> StepOutputs:
        """New request infos, token deltas and rejections since the last call, in order."""
        deltas = []
        for seq in self._touched.values():
            new = seq.output_ids[seq.num_sent:]
            seq.num_sent = len(seq.output_ids)
            if seq.status is SeqStatus.FINISHED:
                deltas.append(TokenDelta(seq.request_id, new, seq.finish_reason))
            elif new:
                deltas.append(TokenDelta(seq.request_id, new))
        out = StepOutputs(self._new_infos, deltas, self._rejected)
        self._new_infos, self._rejected, self._touched = [], [], {}
        return out
