"""Continuous batching core of the scheduler process: no sockets, unit-tested directly.

One step reads as: `schedule()` plans the next step (it may run `depth` steps ahead of the
executor), `on_sampled()` takes a step's sampled ids, `take_outputs()` hands token deltas on.
Decodes are planned first, then chunks of prompts; waiting requests are admitted by priority,
then first come first served. A request with n samples is n sequences: sample 0 is admitted
first, the others once its prompt is planned, so they find its full blocks in the prefix cache.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ipc.messages import (
    STEP_SECONDS_BOUNDS,
    STEP_TOKENS_BOUNDS,
    DetokRequestInfo,
    RequestRejected,
    SamplingParams,
    SchedulerStats,
    SlotInit,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.sequence import SeqStatus, Sequence

MASK64 = (1 << 64) - 1


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


# Logprobs of one step's sampled rows, in row order: (logprob, top ids, top logprobs).
StepLogprobs = tuple[list[float], list[list[int]], list[list[float]]]


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
    members: set[Sequence] = field(default_factory=set)  # sequences planned in this step
    is_starved: bool = False  # a running sequence could not get blocks
    has_preempted: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def sampled_seqs(self) -> list[Sequence]:
        return [r.seq for r in self.rows if r.do_sample]


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s own seed: the request's seed for sample 0, a mix of both for the rest
    (so n samples differ, and each is reproducible on its own)."""
    if seed is None or index == 0:
        return seed
    mixed = ((seed & MASK64) * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & MASK64
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


class StepMetrics:
    """Histograms of step duration and tokens per step, and the device's recent idle
    fraction, from the device interval each executor report carries."""

    WINDOW_S = 5.0  # idle fraction over the steps of the last few seconds
    MAX_GAP_S = 0.5  # a longer gap between steps means there was no work, not an idle device

    def __init__(self) -> None:
        self.seconds = [0] * (len(STEP_SECONDS_BOUNDS) + 1)
        self.tokens = [0] * (len(STEP_TOKENS_BOUNDS) + 1)
        self.seconds_sum = 0.0
        self.tokens_sum = 0
        self._recent: deque[tuple[float, float]] = deque()

    def record(self, num_tokens: int, start: float, end: float) -> None:
        duration = max(0.0, end - start)
        self.seconds[bisect.bisect_left(STEP_SECONDS_BOUNDS, duration)] += 1
        self.tokens[bisect.bisect_left(STEP_TOKENS_BOUNDS, num_tokens)] += 1
        self.seconds_sum += duration
        self.tokens_sum += num_tokens
        self._recent.append((start, end))
        while self._recent and self._recent[0][1] < end - self.WINDOW_S:
            self._recent.popleft()

    @property
    def idle_fraction(self) -> float:
        steps = list(self._recent)
        busy = sum(e - s for s, e in steps)
        idle = sum(max(0.0, b[0] - a[1]) for a, b in zip(steps, steps[1:], strict=False)
                   if b[0] - a[1] < self.MAX_GAP_S)
        return idle / (busy + idle) if busy + idle > 0 else 0.0


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


class Scheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        # A sequence may not outgrow the whole cache: past it, it could only preempt itself.
        self.max_len = min(limits.max_model_len, limits.num_blocks * limits.block_size)
        self.allocator = BlockAllocator(limits.num_blocks, limits.block_size)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live samples
        self._held: dict[str, list[Sequence]] = {}  # samples 1..n-1 until sample 0's prompt
        self.free_slots: list[int] = list(range(limits.max_num_seqs - 1, -1, -1))
        self.inflight: deque[PlannedStep] = deque()
        # A ring slot is rewritten only after the step that used it reported back.
        self.free_ring_slots: list[int] = list(range(limits.depth, -1, -1))
        self.next_step_id = 0
        self._next_order = 0
        self._early_aborts: dict[str, float] = {}
        self._new_infos: list[DetokRequestInfo] = []
        self._rejected: list[RequestRejected] = []
        self._touched: dict[Sequence, None] = {}  # new tokens or finished since take_outputs
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self.finished: dict[str, int] = {}  # sequences (and refused requests) by reason
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_metrics = StepMetrics()
        self._started = time.monotonic()

    def seq(self, request_id: str, index: int = 0) -> Sequence:
        """A live sample of a request (tests and debugging)."""
        return next(s for s in self.requests[request_id] if s.index == index)

    # ------------------------------------------------------------ requests in

    def add_request(self, req: TokenizedRequest) -> None:
        error = self._admission_error(req)
        if error is not None:
            reason, message = error
            self._rejected.append(RequestRejected(req.request_id, req.reply_to, reason, message,
                                                  len(req.prompt_token_ids)))
            self.finished[reason] = self.finished.get(reason, 0) + 1
            return
        p = req.params
        self.prompt_tokens += len(req.prompt_token_ids)
        self._new_infos.append(DetokRequestInfo(
            req.request_id, req.reply_to, len(req.prompt_token_ids), p.skip_special_tokens,
            req.arrival_time, p.n, list(p.stop), p.include_stop_str_in_output, p.min_tokens,
            p.logprobs))
        order, self._next_order = self._next_order, self._next_order + 1
        seqs = [Sequence(req.request_id, list(req.prompt_token_ids), p, req.arrival_time,
                         index=i, order=order) for i in range(p.n)]
        self.requests[req.request_id] = seqs
        self._enqueue(seqs[0])
        if len(seqs) > 1:
            self._held[req.request_id] = seqs[1:]

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

    def abort(self, request_id: str, reason: str = "abort", index: int = -1) -> None:
        """End a request (index -1) or one of its samples wherever it is. reason 'stop' comes
        from a detokenizer that found a stop string; the client already has its answer."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            if reason == "abort":  # it may still be in a tokenizer: remember it for a while
                now = time.monotonic()
                self._early_aborts = {k: t for k, t in self._early_aborts.items()
                                      if now - t < 60}
                self._early_aborts[request_id] = now
            return
        for seq in list(seqs):
            if index in (-1, seq.index):
                self._finish(seq, reason)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

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
            self._register_blocks(row.seq)
        self._release_siblings()
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
        step.members.add(seq)
        start = seq.num_computed
        ids = [seq.token_at(i) for i in range(start, start + num_new)]
        seq.num_computed += num_new
        do_sample = seq.num_computed == seq.num_tokens
        step.rows.append(StepRow(seq, ids, seq.num_computed, do_sample))
        if do_sample:
            seq.num_pending += 1
        return num_new

    def _grow(self, step: PlannedStep, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens tokens, preempting another sequence if need be."""
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
            self._map_block(step, seq, block)
        return True

    def _map_block(self, step: PlannedStep, seq: Sequence, block: int) -> None:
        step.block_updates.append((seq.slot, len(seq.blocks), block))  # type: ignore[arg-type]
        seq.blocks.append(block)

    def _preempt_one(self, step: PlannedStep, needy: Sequence) -> bool:
        """Preempt the lowest-priority, latest running sequence not in this step (needy itself
        if it is that one); within the lowest priority, one just resumed is spared while
        another can go. True if blocks were freed now; False if none were (they may be on
        their way)."""
        if any(s.is_preempting for s in self.running):
            return False  # blocks are on their way back; wait for them
        candidates = [s for s in self.running if s not in step.members and s.blocks
                      and s.status is SeqStatus.RUNNING]
        if not candidates:
            return False
        victim = max(candidates, key=lambda s: (s.params.priority, not s.is_just_resumed,
                                                s.sort_key))
        step.has_preempted = True  # no admission in this step: the victim would come right back
        self._start_preemption(victim)
        return not victim.is_preempting and victim is not needy

    def _start_preemption(self, seq: Sequence) -> None:
        seq.is_preempting = True
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._maybe_release(seq)

    def _admit(self, step: PlannedStep, budget: int) -> int:
        bs = self.limits.block_size
        while (self.waiting and budget > 0 and self.free_slots and not step.is_starved
               and not step.has_preempted):
            seq = self.waiting[0]
            # Reuse cached full blocks, but compute at least the last token (for its logits).
            # Not with penalties: the executor counts a sequence's tokens as they are computed.
            hits = [] if uses_penalties(seq.params) else self.allocator.lookup(
                seq.keys_for((seq.num_known - 1) // bs, bs))
            num_hit = len(hits) * bs
            num_new = min(seq.num_tokens - num_hit, budget)
            new_blocks = self.allocator.blocks_for(num_hit + num_new) - len(hits)
            if new_blocks + self.allocator.num_free_among(hits) > self.allocator.num_free:
                break
            if len(step.block_updates) + len(hits) + new_blocks > self.limits.max_block_updates:
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            for block in hits:
                self.allocator.take(block)
                self._map_block(step, seq, block)
            seq.num_computed = num_hit
            self.prefix_cache_queries += seq.num_known
            self.prefix_cache_hits += num_hit
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit
            if seq.num_preemptions:
                seq.outputs_at_resume = len(seq.output_ids)
            step.new_slots.append(self._slot_init(seq))
            budget -= self._plan_row(step, seq, budget)
        return budget

    def _slot_init(self, seq: Sequence) -> SlotInit:
        p = seq.params
        stop_ids: list[int] = []
        if p.min_tokens > len(seq.output_ids):  # the ids min_tokens keeps from being sampled
            stop_ids = [*p.stop_token_ids, *(() if p.ignore_eos else self.limits.eos_token_ids)]
        assert seq.slot is not None
        return SlotInit(seq.slot, p.temperature, p.top_p, max(p.top_k, 0), p.min_p,
                        p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                        p.min_tokens, len(seq.prompt_ids), sample_seed(p.seed, seq.index),
                        p.logprobs, stop_ids)

    def _register_blocks(self, seq: Sequence) -> None:
        """Offer seq's full blocks whose tokens are all known to the prefix cache. Their KV is
        written by a step already planned, so every step planned from now on can read it."""
        bs = self.limits.block_size
        if seq.num_computed < (seq.num_registered + 1) * bs:
            return  # the common case, checked first: no new full block
        num_full = min(seq.num_computed, seq.num_known, len(seq.blocks) * bs) // bs
        if num_full <= seq.num_registered:
            return
        keys = seq.keys_for(num_full, bs)
        for i in range(seq.num_registered, num_full):
            self.allocator.register(seq.blocks[i], keys[i])
        seq.num_registered = num_full

    def _release_siblings(self) -> None:
        """Samples 1..n-1 wait until sample 0's prompt is planned (and its blocks cached)."""
        for rid, siblings in list(self._held.items()):
            first = next((s for s in self.requests[rid] if s.index == 0), None)
            if (first is None or first.status is SeqStatus.FINISHED
                    or first.num_computed >= len(first.prompt_ids)):
                del self._held[rid]
                for seq in siblings:
                    self._enqueue(seq)

    # ------------------------------------------------------------ results in

    def on_sampled(self, step_id: int, token_ids: list[int],
                   logprobs: StepLogprobs | None = None) -> None:
        """Step `step_id` finished; token_ids has one id per sampling row, in row order, and
        logprobs (if the step computed them) one entry per row as well."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"executor reported step {step_id}, expected {step.step_id}")
        self.free_ring_slots.append(step.ring_slot)
        sampled = step.sampled_seqs
        if len(sampled) != len(token_ids):
            raise RuntimeError(f"step {step_id}: {len(token_ids)} ids for {len(sampled)} rows")
        for j, (seq, token) in enumerate(zip(sampled, token_ids, strict=True)):
            seq.num_pending -= 1
            if seq.status is not SeqStatus.RUNNING:
                continue  # a finished one's extra token is dropped
            seq.output_ids.append(token)
            self.generation_tokens += 1
            k = seq.params.logprobs
            if k is not None and logprobs is not None:
                lp, top_ids, top_lps = logprobs
                seq.output_logprobs.append(TokenLogprob(token, lp[j], top_ids[j][:k],
                                                        top_lps[j][:k]))
            self._touched[seq] = None
            self._check_stop(seq, token)
            self._register_blocks(seq)
        for row in step.rows:
            row.seq.num_inflight -= 1
            self._maybe_release(row.seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if len(seq.output_ids) > params.min_tokens:
            if token in params.stop_token_ids:
                seq.stop_token = token
                self._finish(seq, "stop")
                return
            if not params.ignore_eos and token in self.limits.eos_token_ids:
                self._finish(seq, "stop")
                return
        max_tokens = params.max_tokens
        if (max_tokens is not None and len(seq.output_ids) >= max_tokens
                or seq.num_known >= self.max_len):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
            held = self._held.get(seq.request_id, [])
            if seq in held:
                held.remove(seq)
        self._touched[seq] = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self._maybe_release(seq)
        if seq.index == 0 and seq.request_id in self._held:
            self._release_siblings()  # they no longer wait for its prompt

    def _maybe_release(self, seq: Sequence) -> None:
        """Free blocks and slot once no in-flight step can still write them."""
        if seq.num_inflight:
            return
        seqs = self.requests.get(seq.request_id)
        if seq.status is SeqStatus.FINISHED and seqs is not None and seq in seqs:
            self._release(seq)
            seqs.remove(seq)
            if not seqs:
                del self.requests[seq.request_id]
                self._held.pop(seq.request_id, None)
        elif seq.is_preempting and seq.status is SeqStatus.RUNNING:
            self._release(seq)
            seq.is_preempting = False
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            self._enqueue(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.blocks[::-1])
        seq.blocks = []
        seq.num_registered = 0
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)

    def stats(self) -> SchedulerStats:
        lim, m = self.limits, self.step_metrics
        return SchedulerStats(
            lim.num_blocks, self.allocator.num_free, lim.max_num_seqs, len(self.free_slots),
            lim.depth + 1, len(self.free_ring_slots), len(self.inflight), len(self.waiting),
            len(self.running), len(self.requests), self.num_preemptions, self.next_step_id,
            self.prefix_cache_queries, self.prefix_cache_hits, self.allocator.num_cached_free,
            dict(self.finished), self.prompt_tokens, self.generation_tokens,
            list(m.seconds), m.seconds_sum, list(m.tokens), m.tokens_sum, m.idle_fraction,
            time.monotonic() - self._started)

    # ------------------------------------------------------------ outputs

    def take_outputs(self) -> StepOutputs:
        """New request infos, token deltas and rejections since the last call, in order."""
        deltas = []
        for seq in self._touched:
            start, seq.num_sent = seq.num_sent, len(seq.output_ids)
            new = seq.output_ids[start:]
            finished = seq.status is SeqStatus.FINISHED
            if not new and not finished:
                continue
            logprobs = seq.output_logprobs[start:] if seq.params.logprobs is not None else None
            deltas.append(TokenDelta(
                seq.request_id, new, seq.finish_reason if finished else None, None, seq.index,
                logprobs, max(seq.num_cached_tokens, 0), seq.stop_token))
        out = StepOutputs(self._new_infos, deltas, self._rejected)
        self._new_infos, self._rejected, self._touched = [], [], {}
        return out
