"""The scheduler core's per-step paths written the straightforward way: one general call per
row (wants_step, _plan_row, _take_token with check_stop, register_blocks, _maybe_release, a
_shard per delta), as they were before issue 52 shortened them (commit 9fae5fa).
test_scheduler_equivalence.py drives the same random workloads through these and the real
core and shell, and requires the same steps, ring contents and detokenizer batches: every
shortcut must give what these give."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from ipc.messages import (
    DetokBatch,
    FinishReason,
    StepPlan,
    TokenColumns,
    TokenDelta,
    TokenLogprob,
)
from ipc.step import (
    BLOCK_UPDATES,
    NEW_SLOTS,
    PROMPT_LOGPROBS,
    ROWS,
    STEP_FIELDS,
    STOP_IDS,
    TOKENS,
    PromptLogprobs,
    StepLogprobs,
)
from stages.scheduler.core import RECENT_FINAL_S, Scheduler
from stages.scheduler.planned import PlannedRow, PlannedStep
from stages.scheduler.process import SchedulerShell
from stages.scheduler.requests import StepOutputs, take_prompt_logprobs
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.step_builder import StepBuilder
from stages.scheduler.stopping import check_stop, reaches_length


class ReferenceBuilder(StepBuilder):
    def fill(self, step: PlannedStep) -> None:
        budget = self.limits.max_num_batched_tokens
        queue, kv = self.queue, self.kv
        if queue.waiting:
            queue.promote_within_sender()
        if queue.waiting and not kv.free_slots and not kv.victims:
            victim = queue.share_slots(kv.running, self.limits.max_num_seqs)
            if victim is not None:
                self.preempt(victim)
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in kv.running:
            if self.wants_step(seq):
                (decodes if seq.num_tokens - seq.num_computed == 1 else prefills).append(seq)
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if self.wants_step(seq):
                budget -= self._plan_row(step, seq, budget)
        if queue.waiting:
            self._admit(step, budget)

    def wants_step(self, seq: Sequence) -> bool:
        if seq.status is not SeqStatus.RUNNING or seq.num_drafted_inflight:
            return False
        num_tokens = seq.num_tokens
        if seq.num_computed >= num_tokens:
            return False
        return not reaches_length(seq.params, seq.num_outputs, num_tokens, self.max_len)

    def _plan_row(self, step: PlannedStep, seq: Sequence, budget: int,
                  short_of_end: bool = False) -> int:
        assert not short_of_end  # (pipeline stages only: the reference has one)
        start, num_tokens = seq.num_computed, seq.num_tokens
        num_new = min(num_tokens - start, budget)
        if not self.kv.grow(step, seq, start + num_new, self.preempt):
            step.is_starved = True
            return 0
        step.members.add(seq)
        if seq.scores_prompt:
            self._plan_prompt_logprobs(step, seq, start, start + num_new)
        tokens = seq.tokens(start, start + num_new)
        dp = self.drafts
        if seq.draft_model_kv and dp is not None and dp.over_batch(len(self.kv.running)):
            seq.draft_model_kv = False
        drafts = (dp.drafts(step, seq, budget - num_new, self.kv)
                  if dp is not None and num_tokens - start == 1 else [])
        seq.num_computed = start + num_new + len(drafts)
        do_sample = seq.num_computed >= num_tokens
        assert seq.slot is not None
        step.rows.append(PlannedRow(
            seq.slot, tokens + drafts, seq.num_computed, do_sample, len(drafts),
            seq.draft_model_kv,
            bool(drafts) and dp is not None and dp.is_last(seq, len(drafts)), seq=seq))
        step.num_tokens += num_new + len(drafts)
        if do_sample:
            seq.num_pending += 1 + len(drafts)
        if drafts and dp is not None:
            seq.num_drafted_inflight += 1
            dp.count_planned(len(drafts))
        return num_new + len(drafts)


class ReferenceScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.builder = ReferenceBuilder(self.limits, self.max_len, self.queue, self.kv,
                                        self.drafts, self._preempt)

    def schedule(self) -> PlannedStep | None:
        if len(self.inflight) >= self.limits.depth:
            return None
        step = PlannedStep(self.next_step_id)
        self.builder.fill(step)
        if not step.rows:
            return None
        self.next_step_id += 1
        self.queue.serve(step)
        step.ring_slot = self.free_ring_slots.pop()
        for row in step.rows:
            row.seq.num_inflight += 1
            self.kv.register_blocks(row.seq)
        if self.book.held:
            self._release_siblings()
        self.inflight.append(step)
        return step

    def on_sampled(self, step_id: int, token_ids: list[int],
                   logprobs: StepLogprobs | None = None,
                   prompt_logprobs: PromptLogprobs | None = None,
                   accepted: list[int] | None = None) -> None:
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"executor reported step {step_id}, expected {step.step_id}")
        if prompt_logprobs is not None:
            take_prompt_logprobs(step, prompt_logprobs)
        self.free_ring_slots.append(step.ring_slot)
        rows = [r for r in step.rows if r.do_sample]
        num_positions = sum(1 + r.num_draft for r in rows)
        if len(token_ids) != num_positions:
            raise RuntimeError(f"step {step_id}: {len(token_ids)} ids for {num_positions} "
                               "sampled positions")
        stands = iter(accepted or ())
        first = 0
        for row in rows:
            seq = row.seq
            if row.num_draft:
                num_stand = self._verify(step_id, row, next(stands, 0))
            else:
                seq.num_pending -= 1
                num_stand = 1
            base, first = first, first + 1 + row.num_draft
            if seq.status is SeqStatus.FINISHED:
                continue
            for j in range(base, base + num_stand):
                if not self._take_token(seq, token_ids[j], logprobs, j):
                    break
            self.kv.register_blocks(seq)
        for row in step.rows:
            row.seq.num_inflight -= 1
            self._maybe_release(row.seq)

    def _take_token(self, seq: Sequence, token: int, logprobs: StepLogprobs | None,
                    j: int) -> bool:
        if token < 0:
            seq.error = "the structured output's grammar failed in the executor"
            self._finish(seq, FinishReason.ERROR)
            return False
        seq.output_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.time()
        self.generation_tokens += 1
        k = seq.params.logprobs
        if k is not None and logprobs is not None:
            lp, top_ids, top_lps = logprobs
            seq.output_logprobs.append(TokenLogprob(token, lp[j], top_ids[j][:k],
                                                    top_lps[j][:k]))
        self.book.touched[seq] = None
        finish = check_stop(seq.params, self.limits.eos_token_ids, token, len(seq.output_ids),
                            seq.num_known, self.max_len)
        if finish is not None:
            seq.stop_token = finish.stop_token
            self._finish(seq, finish.reason)
            return False
        return True

    def take_outputs(self) -> StepOutputs:
        book = self.book
        deltas = []
        for seq in book.touched:
            start, seq.num_sent = seq.num_sent, len(seq.output_ids)
            new = seq.output_ids[start:]
            finished = seq.status is SeqStatus.FINISHED
            if not new and not finished:
                continue
            logprobs = seq.output_logprobs[start:] if seq.params.logprobs is not None else None
            deltas.append(TokenDelta(
                seq.request_id, new, seq.finish_reason if finished else None,
                seq.error if finished else None, seq.index,
                logprobs, max(seq.num_cached_tokens, 0), seq.stop_token,
                _prompt_logprobs_to_send(seq)))
        out = StepOutputs(book.new_infos, deltas, book.rejected, TokenColumns())
        book.new_infos, book.rejected, book.touched = [], [], {}
        return out


def _prompt_logprobs_to_send(seq: Sequence) -> list[TokenLogprob] | None:
    if seq.plp_sent or not seq.scores_prompt:
        return None
    if len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1:
        return None
    seq.plp_sent = True
    return [TokenLogprob(seq.prompt_ids[0], math.nan), *seq.prompt_logprobs]


_ROW_FIELDS = tuple(f.name for f in STEP_FIELDS if f.count is ROWS)
_COLUMNS = {count: tuple(f.name for f in STEP_FIELDS if f.count is count)
            for count in (BLOCK_UPDATES, NEW_SLOTS, STOP_IDS, PROMPT_LOGPROBS)}


def reference_write(step: PlannedStep, buf: dict[str, np.ndarray]) -> StepPlan:
    """write_step as it was: every field from the rows' attributes and the entry lists."""
    buf["stamp"][0] = step.step_id
    input_ids = [t for r in step.rows for t in r.token_ids]
    buf["input_ids"][:len(input_ids)] = input_ids
    for name in _ROW_FIELDS:
        buf[name][:len(step.rows)] = [getattr(r, name) for r in step.rows]
    entries: dict[Any, Seq[tuple[Any, ...]]] = {
        BLOCK_UPDATES: step.block_updates,
        NEW_SLOTS: [(s, f, i) for s, (f, i) in step.new_slots],
        STOP_IDS: step.stop_ids, PROMPT_LOGPROBS: step.prompt_logprobs}
    for count, values in entries.items():
        if values:
            for name, column in zip(_COLUMNS[count], zip(*values, strict=True), strict=True):
                buf[name][:len(values)] = column
    buf["stamp"][1] = step.step_id
    sizes = {TOKENS: len(input_ids), ROWS: len(step.rows)} | {
        c: len(v) for c, v in entries.items()}
    return StepPlan(step_id=step.step_id, ring_slot=step.ring_slot,
                    grammars=step.grammars or [],
                    **{c.plan_field: n for c, n in sizes.items()})


def reference_flush(shell: SchedulerShell) -> None:
    """SchedulerShell._flush_outputs as it was: a _shard call per delta."""
    infos, deltas, rejected, _ = shell.core.take_outputs()
    if not (infos or deltas or rejected):
        return
    batches: dict[int, DetokBatch] = {}

    def batch(request_id: str, reply_to: str = "") -> DetokBatch:
        rank = shell._shard(request_id, reply_to)
        return batches.setdefault(rank, DetokBatch([], [], [], shell.cfg.engine,
                                                   shell.incarnation))

    for info in infos:
        batch(info.request_id, info.reply_to).new_requests.append(info)
    for delta in deltas:
        batch(delta.request_id).deltas.append(delta)
    for rej in rejected:
        batch(rej.request_id, rej.reply_to).rejected.append(rej)
    for rank, detok_batch in batches.items():
        shell.peers.to_detokenizer(rank, detok_batch)
    now = time.monotonic()
    ended = {d.request_id for d in deltas if d.finish_reason is not None}
    shell._unpin.extend((now, rid) for rid in ended | {r.request_id for r in rejected})
    while shell._unpin and now - shell._unpin[0][0] > RECENT_FINAL_S:
        rid = shell._unpin.popleft()[1]
        if rid not in shell.core.requests:
            shell._pins.pop(rid, None)
