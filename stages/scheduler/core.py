"""Continuous batching core of the scheduler process: no sockets, unit-tested directly.

One step reads as: `schedule()` plans the next step (it may run `depth` steps ahead of the
executor), `on_sampled()` takes a step's sampled ids, `take_outputs()` hands token deltas on.
Decodes are planned first, then chunks of prompts; waiting requests are admitted in order of
their fair-queueing tags (`_tag_request`: across senders; within one, requests are weighted
fair queued, `_promote_within_sender`). A request with n samples is n sequences: sample 0 is
admitted first, the others once its prompt is planned, so they find its full blocks in the
prefix cache.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from ipc.config import EngineLimits
from ipc.messages import (
    DetokRequestInfo,
    ErrorKind,
    FinishReason,
    RequestRejected,
    SchedulerStats,
    SlotGrammar,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)
from ipc.params import MAX_RECONCILE_IDS, RequestError, validate_params
from ipc.sampling import encode_slot, uses_penalties
from ipc.speculative import SpeculativeConfig
from ipc.step import PromptLogprobs, StepLogprobs
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.metrics import RequestPhases, StepMetrics
from stages.scheduler.planned import PlannedRow, PlannedStep
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.speculative import ProposalState, Proposer, make_proposer
from stages.scheduler.stopping import check_stop, reaches_length, suppressed_ids

# One step of priority is worth this many tokens of other requests' work: a request of priority
# p is admitted before requests of priority p + 1 that came up to this much work before it.
PRIORITY_STEP_TOKENS = 1024
# Within one sender, in its virtual time (tokens of service per live sample): a request of
# priority p goes before the sender's requests of priority p + 1 that came up to this much
# service before it. (Strict priority would let a sender's own urgent traffic starve its
# other requests for as long as it lasts.)
INNER_PRIORITY_STEP = 64
MAX_FORGOTTEN_CLIENTS = 1024
_SORT_KEY = operator.attrgetter("sort_key")  # the waiting queue's order (Sequence.sort_key)
# A dead detokenizer may have taken the final outputs of requests that ended this recently.
RECENT_FINAL_S = 10.0
MAX_RECENT_FINALS = 65536
MAX_SENDERS = 4096  # past this many senders, the idle and the caught up are forgotten


class StepOutputs(NamedTuple):
    infos: list[DetokRequestInfo]
    deltas: list[TokenDelta]
    rejected: list[RequestRejected]


class Scheduler:
    def __init__(self, limits: EngineLimits, num_blocks: int,
                 max_waiting: int | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        """max_waiting: sequences that may wait (queued or held); a request that would pass
        it is refused as unavailable, counted here where it happens. speculative: propose
        drafts for decoding sequences (n-gram prompt lookup, or a draft model's placeholders);
        its K must be the limits'."""
        self.limits, self.num_blocks, self.max_waiting = limits, num_blocks, max_waiting
        if speculative is not None and speculative.num_tokens > limits.num_speculative_tokens:
            raise ValueError(f"speculative K {speculative.num_tokens} exceeds the rings' "
                             f"{limits.num_speculative_tokens}")
        self.proposer = make_proposer(speculative) if speculative is not None else None
        self.num_speculative_tokens = speculative.num_tokens if speculative is not None else 0
        self.spec_num_drafts = 0  # rows planned with drafts
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * self.num_speculative_tokens
        # A sequence may not outgrow the whole cache: past it, it could only preempt itself.
        self.max_len = min(limits.max_model_len, num_blocks * limits.block_size)
        self.allocator = BlockAllocator(num_blocks, limits.block_size)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live samples
        self._held: dict[str, list[Sequence]] = {}  # the HELD samples of each request
        # Preempted sequences whose blocks are not released yet (one may have finished since,
        # while its in-flight steps drain): while any is, no other victim is taken.
        self._victims: set[Sequence] = set()
        self.free_slots: list[int] = list(range(limits.max_num_seqs - 1, -1, -1))
        self.inflight: deque[PlannedStep] = deque()
        # A ring slot is rewritten only after the step that used it reported back.
        self.free_ring_slots: list[int] = list(range(limits.depth, -1, -1))
        self.next_step_id = 0
        self._next_order = 0
        # Start-time fair queueing over senders (client and user), in tokens of work: the
        # virtual time is the largest tag admitted; a sender's end is where its next starts.
        self._vtime = 0
        self._sender_end: dict[str, int] = {}
        self._forget_at = MAX_SENDERS
        # Within a sender, weighted fair queueing over its samples: each sender's virtual
        # time, its live samples, and a heap of its waiting samples by inner finish (entries
        # of samples no longer waiting, or re-tagged, are skipped lazily).
        self._inner_vtime: dict[str, float] = {}
        self._sender_samples: dict[str, int] = {}
        self._inner_queue: dict[str, list[tuple[float, int, int, int, Sequence]]] = {}
        self._heap_ids = itertools.count()
        self._early_aborts: dict[str, float] = {}
        self._forgotten: dict[str, None] = {}  # reply addresses of dead clients, newest last
        # (when, request id, reply_to, prompt length) of the samples that ended lately
        self._recent_finals: deque[tuple[float, str, str, int]] = deque()
        self._new_infos: list[DetokRequestInfo] = []
        self._rejected: list[RequestRejected] = []
        self._touched: dict[Sequence, None] = {}  # new tokens or finished since take_outputs
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found
        self.finished: dict[str, int] = {}  # sequences (and refused requests) by reason value
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_metrics = StepMetrics()
        self.request_phases = RequestPhases()
        self._started = time.monotonic()

    def seq(self, request_id: str, index: int = 0) -> Sequence:
        """A live sample of a request (tests and debugging)."""
        return next(s for s in self.requests[request_id] if s.index == index)

    # ------------------------------------------------------------ requests in

    def add_request(self, req: TokenizedRequest) -> None:
        refusal = self._admission_error(req)
        if refusal is not None:
            self._rejected.append(refusal)
            self._count_finished(refusal.finish_reason)
            self._remember_final(req.request_id, req.reply_to, len(req.prompt_token_ids))
            return
        p = req.params
        self.prompt_tokens += len(req.prompt_token_ids)
        self._new_infos.append(DetokRequestInfo(
            req.request_id, req.reply_to, len(req.prompt_token_ids), p.skip_special_tokens,
            req.arrival_time, p.n, list(p.stop), p.include_stop_str_in_output, p.min_tokens,
            p.logprobs))
        order, self._next_order = self._next_order, self._next_order + 1
        sender = f"{req.reply_to}\0{p.user}"
        start, cost = self._tag_request(req, sender)
        inner = self._inner_vtime.get(sender, 0) + p.priority * INNER_PRIORITY_STEP
        seqs = [Sequence(req.request_id, list(req.prompt_token_ids), p, req.arrival_time,
                         index=i, order=order, tag=start + i * cost, sender=sender,
                         reply_to=req.reply_to, grammar=req.grammar,
                         inner_start=inner, inner_finish=inner + cost,
                         status=SeqStatus.HELD if i else SeqStatus.WAITING) for i in range(p.n)]
        self.requests[req.request_id] = seqs
        self._sender_samples[sender] = self._sender_samples.get(sender, 0) + p.n
        self._enqueue(seqs[0])
        if len(seqs) > 1:
            self._held[req.request_id] = seqs[1:]

    def _tag_request(self, req: TokenizedRequest, sender: str) -> tuple[int, int]:
        """(tag of sample 0, tag step between samples). A sender's requests follow one
        another (first come first served within it), each costing n * (prompt + most
        outputs) tokens; a sender that was idle starts at the virtual time, so it is served
        next whatever others queued before. Priority moves a request by PRIORITY_STEP_TOKENS
        per step. So one request's n, its prompt length and a flood of requests are counted
        against their sender, and nobody else waits behind them (see also _share_slots).
        Which of a sender's samples takes its turn is decided among its requests
        (_promote_within_sender)."""
        p, num_prompt = req.params, len(req.prompt_token_ids)
        cost = num_prompt + min(p.max_tokens or self.max_len, max(self.max_len - num_prompt, 1))
        base = max(self._vtime, self._sender_end.get(sender, 0))
        self._sender_end[sender] = base + p.n * cost
        # Past MAX_SENDERS, keep only senders with work and ahead of the virtual time: for
        # one caught up, max(vtime, end) is vtime anyway; an idle one gains at most the cost
        # of its last request.
        if len(self._sender_end) > self._forget_at:
            live = {s.sender for seqs in self.requests.values() for s in seqs} | {sender}
            vtime = self._vtime
            self._sender_end = {k: v for k, v in self._sender_end.items()
                                if v > vtime and k in live}
            self._inner_vtime = {k: v for k, v in self._inner_vtime.items() if k in live}
            self._inner_queue = {k: v for k, v in self._inner_queue.items() if k in live}
            self._forget_at = max(MAX_SENDERS, 2 * len(self._sender_end))
        return base + p.priority * PRIORITY_STEP_TOKENS, cost

    def _admission_error(self, req: TokenizedRequest) -> RequestRejected | None:
        """The answer to a request that cannot be taken, if it cannot."""
        num_prompt = len(req.prompt_token_ids)

        def refuse(reason: FinishReason, message: str | None = None,
                   kind: ErrorKind = ErrorKind.INVALID_REQUEST) -> RequestRejected:
            return RequestRejected(req.request_id, req.reply_to, reason, message, num_prompt,
                                   kind if reason is FinishReason.ERROR else None)

        if req.request_id in self.requests:
            return refuse(FinishReason.ERROR, f"request id {req.request_id!r} is already in use")
        invalid = self._invalid(req)
        if invalid is not None:
            return refuse(FinishReason.ERROR, invalid)
        if self._early_aborts.pop(req.request_id, None) is not None:
            return refuse(FinishReason.ABORT)
        if req.reply_to in self._forgotten:
            return refuse(FinishReason.ABORT)
        num_waiting = len(self.waiting) + sum(map(len, self._held.values()))
        if self.max_waiting is not None and num_waiting + req.params.n > self.max_waiting:
            return refuse(FinishReason.ERROR,
                          f"the engine is overloaded ({num_waiting} sequences waiting, at most "
                          f"{self.max_waiting}); retry shortly", ErrorKind.UNAVAILABLE)
        needed = self.allocator.blocks_for(num_prompt + 1)
        if needed > self.num_blocks:
            return refuse(FinishReason.ERROR,
                          f"the prompt needs {needed} KV blocks but the cache has only "
                          f"{self.num_blocks}; raise --kv-cache-memory or shorten it")
        return None

    def _invalid(self, req: TokenizedRequest) -> str | None:
        """What is wrong with a request the tokenizer should not have let through: checked
        again here, since a bad one would otherwise reach the executor."""
        ids, lim = req.prompt_token_ids, self.limits
        if not ids:
            return "the prompt is empty"
        if min(ids) < 0 or max(ids) >= lim.vocab_size:
            return f"the prompt has token ids outside the vocabulary [0, {lim.vocab_size})"
        if len(ids) >= lim.max_model_len:
            return (f"the prompt has {len(ids)} tokens; the context holds {lim.max_model_len}, "
                    "which must leave room for at least one output token")
        try:
            validate_params(req.params, lim.vocab_size, lim.priority_range)
        except RequestError as exc:
            return exc.message
        if (req.params.structured_outputs is not None) != bool(req.grammar):
            return "a structured output must come with its grammar (from a tokenizer stage)"
        return None

    def abort(self, request_id: str) -> None:
        """End every sample of a request wherever it is (finish reason abort)."""
        seqs = self.requests.get(request_id)
        if seqs is None:  # it may still be in a tokenizer: remember it for a while
            now = time.monotonic()
            self._early_aborts = {k: t for k, t in self._early_aborts.items() if now - t < 60}
            self._early_aborts[request_id] = now
            return
        for seq in list(seqs):
            self._finish(seq, FinishReason.ABORT)

    def fail_requests(self, belongs: Callable[[str], bool], message: str) -> None:
        """The detokenizer of the requests whose id `belongs` died: their text state went
        with it. Each live one ends with an error that needs no such state, in place of the
        rest of its output; so does each that ended in the last RECENT_FINAL_S, whose final
        output may have gone to the dead worker (a client ignores what follows a final)."""
        now = time.monotonic()
        while self._recent_finals and now - self._recent_finals[0][0] > RECENT_FINAL_S:
            self._recent_finals.popleft()
        failed: set[str] = set()
        for rid, seqs in list(self.requests.items()):
            if belongs(rid):
                first = seqs[0]
                for seq in list(seqs):
                    self._finish(seq, FinishReason.ERROR)
                    self._touched.pop(seq, None)  # no delta: nobody holds its text state now
                self._reject_unavailable(rid, first.reply_to, message, len(first.prompt_ids))
                failed.add(rid)
        for _, rid, reply_to, num_prompt in self._recent_finals:
            if rid not in failed and belongs(rid):
                self._reject_unavailable(rid, reply_to, message, num_prompt)
                failed.add(rid)

    def _reject_unavailable(self, rid: str, reply_to: str, message: str,
                            num_prompt: int) -> None:
        self._rejected.append(RequestRejected(rid, reply_to, FinishReason.ERROR, message,
                                              num_prompt, ErrorKind.UNAVAILABLE))

    def known_requests(self, request_ids: list[str]) -> list[str]:
        """Which of these ids this engine holds. A client names the unfinished requests it
        had sent to a tokenizer that was restarted; this is asked behind every request the
        new worker forwarded first, so an id no engine holds was lost with the dead one
        (ipc.messages.EngineReconcile; the tokenizer answers the client). One that ended
        lately counts as held: its final output may still be on its way to the client."""
        ended = {rid for _, rid, _, _ in self._recent_finals}
        return [rid for rid in request_ids[:MAX_RECONCILE_IDS]
                if rid in self.requests or rid in ended]

    def forget_client(self, reply_to: str) -> None:
        """A client died (an HTTP worker): abort what it had sent, refuse what still comes."""
        self._forgotten[reply_to] = None
        while len(self._forgotten) > MAX_FORGOTTEN_CLIENTS:
            del self._forgotten[next(iter(self._forgotten))]
        for rid in [r for r, seqs in self.requests.items() if seqs[0].reply_to == reply_to]:
            self.abort(rid)

    def stop_sample(self, request_id: str, index: int) -> None:
        """A detokenizer found a stop string in sample `index`; its client already has the
        final output, so the sample is only freed (a late duplicate is ignored)."""
        for seq in list(self.requests.get(request_id, ())):
            if seq.index == index:
                self._finish(seq, FinishReason.STOP)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_SORT_KEY)
        heapq.heappush(self._inner_queue.setdefault(seq.sender, []),
                       (*_inner_key(seq), next(self._heap_ids), seq))

    def _promote_within_sender(self) -> None:
        """The first waiting sequence's sender has the next turn; within the sender, the turn
        goes to the waiting sample that would finish first in a fluid share of the sender
        among its samples (weighted fair queueing by cost, shifted by priority; arrival the
        tie-break): the two swap tags. So a short request is not queued behind the
        remaining samples (or the many requests) of a long one from the same client, while
        the sender as a whole keeps its place among senders."""
        first = self.waiting[0]
        heap = self._inner_queue.get(first.sender)
        while heap:
            best = heap[0][-1]
            if best.status is SeqStatus.WAITING and _inner_key(best) == heap[0][:3]:
                break
            heapq.heappop(heap)  # admitted, finished, or re-tagged since
        else:
            return
        if best is first:
            return
        key = best.sort_key
        i = bisect.bisect_left(self.waiting, key, key=_SORT_KEY)
        assert self.waiting[i] is best
        del self.waiting[i]
        del self.waiting[0]
        first.tag, best.tag = best.tag, first.tag
        self.waiting.insert(0, best)  # (its new tag is the smallest)
        bisect.insort(self.waiting, first, key=_SORT_KEY)

    # ------------------------------------------------------------ planning

    def schedule(self) -> PlannedStep | None:
        """Plan the next step, or None if there is nothing to run or too much in flight."""
        if len(self.inflight) >= self.limits.depth:
            return None
        step = PlannedStep(self.next_step_id)
        budget = self.limits.max_num_batched_tokens
        if self.waiting:
            self._promote_within_sender()
        if self.waiting and not self.free_slots and not self._victims:
            self._share_slots()
        decodes, prefills = [], []
        for seq in self.running:
            if self._wants_step(seq):
                (decodes if seq.num_tokens - seq.num_computed == 1 else prefills).append(seq)
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if self._wants_step(seq):  # an earlier row of this step may have preempted it
                budget -= self._plan_row(step, seq, budget)
        if self.waiting:
            budget = self._admit(step, budget)
        if not step.rows:
            return None
        self.next_step_id += 1
        self._serve_inner_vtime(step)
        step.ring_slot = self.free_ring_slots.pop()
        for row in step.rows:
            row.seq.num_inflight += 1
            self._register_blocks(row.seq)
        if self._held:
            self._release_siblings()
        self.inflight.append(step)
        return step

    def has_room(self) -> bool:
        """Whether a request arriving now could still join the next step: a slot that the
        waiting samples will not take, and the work known (prompt tokens to compute,
        decodes) short of the step's budget."""
        if len(self.free_slots) <= len(self.waiting):
            return False
        known = sum(seq.num_tokens - seq.num_computed for seq in self.running
                    if seq.status is SeqStatus.RUNNING)
        known += sum(seq.num_tokens for seq in self.waiting)
        return known < self.limits.max_num_batched_tokens

    def _wants_step(self, seq: Sequence) -> bool:
        if seq.status is not SeqStatus.RUNNING or seq.num_drafted_inflight:
            return False
        num_tokens = seq.num_tokens
        if seq.num_computed >= num_tokens:
            return False  # all computed: waiting for its sample
        # Stop planning once the tokens in flight already reach a length limit.
        return not reaches_length(seq.params, seq.num_outputs, num_tokens, self.max_len)

    def _plan_row(self, step: PlannedStep, seq: Sequence, budget: int) -> int:
        """Add seq's next chunk to step; returns the tokens used (0 if it must wait)."""
        start, num_tokens = seq.num_computed, seq.num_tokens
        num_new = min(num_tokens - start, budget)
        if not self._grow(step, seq, start + num_new):
            step.is_starved = True
            return 0
        step.members.add(seq)
        if _scores_prompt(seq):
            self._plan_prompt_logprobs(step, seq, start, start + num_new)
        tokens = seq.tokens(start, start + num_new)
        if seq.draft_model_kv and self._over_draft_batch():
            seq.draft_model_kv = False  # (for good: its draft KV would have holes)
        drafts = (self._drafts(step, seq, budget - num_new)
                  if self.proposer is not None and num_tokens - start == 1 else [])
        seq.num_computed = start + num_new + len(drafts)
        do_sample = seq.num_computed >= num_tokens
        step.rows.append(PlannedRow(
            seq.slot, tokens + drafts, seq.num_computed, do_sample,  # type: ignore[arg-type]
            len(drafts), seq.draft_model_kv,
            bool(drafts) and self._last_drafts(seq, len(drafts)), seq=seq))
        step.num_tokens += num_new + len(drafts)
        if do_sample:
            seq.num_pending += 1 + len(drafts)
        if drafts:
            seq.num_drafted_inflight += 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(drafts)
        return num_new + len(drafts)

    def _last_drafts(self, seq: Sequence, num_drafts: int) -> bool:
        """Whether, if a row's drafts all stand, seq has no room to draft again: the
        executor then runs no draft passes ahead of the next step (drafter.py)."""
        return self._draft_room(seq, 1 + num_drafts) <= 0

    def _draft_room(self, seq: Sequence, more: int = 0) -> int:
        """The drafts seq's max_tokens and the context leave it room for (with `more` of
        its tokens beyond those planned so far): each row also samples one token."""
        room = self.max_len - (seq.num_tokens + more) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - (seq.num_outputs + more) - 1)
        return room

    def _draft_model_kv(self, seq: Sequence) -> bool:
        """Whether the draft model keeps the KV of seq, which takes its slot now: one that
        may draft (not opted out, no penalties, no structured output), joining a batch of
        at most max_batch sequences. It stops for good once more run (_plan_row): the draft
        model's passes over every row would cost each step more than drafts win back."""
        cfg = self.proposer.cfg if self.proposer is not None else None
        if cfg is None or not cfg.is_draft_model:
            return False
        p = seq.params
        if not p.speculate or uses_penalties(p) or seq.grammar:
            return False
        limit = cfg.max_batch
        # (the batch it joins: a burst that will fill the slots counts already)
        soon = min(len(self.running) + len(self.waiting), self.limits.max_num_seqs)
        return limit is None or soon <= limit

    def _over_draft_batch(self) -> bool:
        """More sequences run than drafting pays for (the configuration's max_batch)."""
        limit = self.proposer.cfg.max_batch if self.proposer is not None else None
        return limit is not None and len(self.running) > limit

    def _drafts(self, step: PlannedStep, seq: Sequence, room: int) -> list[int]:
        """The tokens proposed to follow decoding sequence seq this step (none for a request
        that opts out or has penalties: the executor counts tokens as they are computed; a
        structured output's matcher masks each proposed position, so a draft model, whose
        drafts the host never sees, drafts none for one: _draft_model_kv). Never more than
        its max_tokens, the context, the step's token budget (`room`) or the KV blocks it
        holds and the free ones allow: a draft never preempts anything. None while more
        sequences run than the configuration's max_batch."""
        assert self.proposer is not None
        p = seq.params
        if not p.speculate or uses_penalties(p):
            return []
        cfg = self.proposer.cfg
        if cfg.is_draft_model and not seq.draft_model_kv:
            return []
        if self._over_draft_batch():
            return []  # (drafting stopped paying: ipc/speculative.py DRAFT_MAX_BATCH)
        most = min(self.num_speculative_tokens, room, self._draft_room(seq))
        if most <= 0:
            return []
        if seq.proposal is None:
            seq.proposal = ProposalState()
        drafts = self.proposer.propose(seq.proposal, seq.prompt_ids, seq.output_ids,
                                       seq.num_pending, most)
        if not drafts:
            return []
        # KV room: the blocks it holds, and free ones (never a preemption). A draft model's
        # row holds the position after its drafts too (where its last sample lands if all
        # stand), whose block the executor's draft passes run ahead in (drafter.py).
        bonus = int(cfg.is_draft_model)
        end = seq.num_tokens + len(drafts) + bonus
        extra = self.allocator.blocks_for(end) - len(seq.blocks)
        if extra > 0:
            can = min(extra, self.allocator.num_free,
                      self.limits.max_block_updates - len(step.block_updates))
            for block in self.allocator.allocate(max(can, 0)) or []:
                self._map_block(step, seq, block)
            drafts = drafts[:max(0, len(seq.blocks) * self.limits.block_size
                                 - seq.num_tokens - bonus)]
        return drafts

    def _plan_prompt_logprobs(self, step: PlannedStep, seq: Sequence, start: int,
                              end: int) -> None:
        """The positions [start, end) about to be planned whose logits score the next prompt
        token, unless an earlier step (before a preemption) already scored it."""
        prompt = seq.prompt_ids
        first = max(start, seq.num_plp_planned)
        last = min(end, len(prompt) - 1)
        if first >= last:
            return
        base = step.num_tokens - start  # index in the step of the row's position 0
        step.prompt_logprobs += [(base + p, prompt[p + 1]) for p in range(first, last)]
        step.plp_owners.append((seq, last - first))
        seq.num_plp_planned = last

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
        if self._victims:
            return False  # blocks are on their way back; wait for them
        candidates = [s for s in self.running if s not in step.members and s.blocks
                      and s.status is SeqStatus.RUNNING]
        if not candidates:
            return False
        victim = max(candidates, key=lambda s: (s.params.priority, not s.is_just_resumed,
                                                s.sort_key))
        step.has_preempted = True  # no admission in this step: the victim would come right back
        self._preempt(victim)
        return victim not in self._victims and victim is not needy

    def _preempt(self, victim: Sequence) -> None:
        """victim leaves the running set once its in-flight steps drain, and waits again."""
        victim.move_to(SeqStatus.PREEMPTING)
        self._victims.add(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._maybe_release(victim)

    def _share_slots(self) -> None:
        """Every slot is taken and a sequence waits: if its sender holds fewer than its fair
        share of the slots (max_num_seqs over the senders running and the first waiting) while
        another holds more, preempt that one's last sequence. Its slot comes back once its
        steps drain, and the waiting one is admitted then: a request with n = 128, or a
        sender's many requests, cannot keep everyone else waiting until they end. One
        victim at a time (the _victims guard), and only down to the fair share, so this
        never thrashes: senders holding their share are never touched."""
        first = self.waiting[0]
        held: dict[str, list[Sequence]] = {}
        for seq in self.running:
            if seq.status is SeqStatus.RUNNING:
                held.setdefault(seq.sender, []).append(seq)
        if not held:
            return  # every slot is a finished sequence's, about to come back
        num_senders = len(held) + (first.sender not in held)
        share = -(-self.limits.max_num_seqs // num_senders)
        if len(held.get(first.sender, ())) >= share:
            self._share_within_sender(first, held[first.sender])
            return
        most = max(held.values(), key=len)
        if len(most) > share:
            victim = max(most, key=_SORT_KEY)
            # Behind the one it makes room for, so that one takes the slot (not it again).
            victim.tag = max(self._vtime, first.tag) + 1
            self._preempt(victim)

    def _serve_inner_vtime(self, step: PlannedStep) -> None:
        """Each sender's virtual time moves with the tokens a step computes for it, shared
        over its live samples (the service each would have had from a fluid share). So a
        request arriving later starts where the others have got to, and a stream of short
        ones cannot keep a long one waiting for ever: its finish is passed after a bounded
        amount of their work. (Admission also moves it to the admitted sample's start.)"""
        served: dict[str, int] = {}
        for row in step.rows:
            served[row.seq.sender] = served.get(row.seq.sender, 0) + len(row.token_ids)
        for sender, tokens in served.items():
            self._inner_vtime[sender] = self._inner_vtime.get(sender, 0) + tokens / max(
                1, self._sender_samples.get(sender, 1))

    def _share_within_sender(self, first: Sequence, mine: list[Sequence]) -> None:
        """first's sender holds its share of the slots: among its own, the running sample
        that would finish last (_promote_within_sender) gives its slot to first if first
        would finish strictly sooner. A sample that made room is
        never preempted for the one it made room for (its finish is later), and equal
        requests never preempt one another, so this does not thrash."""
        victim = max(mine, key=_inner_key)
        if first.inner_finish < victim.inner_finish:
            victim.tag = max(self._vtime, first.tag) + 1  # behind first among senders too
            self._preempt(victim)

    def _admit(self, step: PlannedStep, budget: int) -> int:
        bs = self.limits.block_size
        while (self.waiting and budget > 0 and self.free_slots and not step.is_starved
               and not step.has_preempted):
            self._promote_within_sender()
            seq = self.waiting[0]
            # Reuse cached full blocks, but compute at least the last token (for its logits).
            # Not with penalties: the executor counts a sequence's tokens as they are computed.
            # Nor with prompt logprobs: every prompt position's logits are needed.
            hits = [] if uses_penalties(seq.params) or _scores_prompt(seq) else (
                self.allocator.lookup(seq.keys_for((seq.num_known - 1) // bs, bs)))
            num_hit = len(hits) * bs
            num_new = min(seq.num_tokens - num_hit, budget)
            new_blocks = self.allocator.blocks_for(num_hit + num_new) - len(hits)
            if new_blocks + self.allocator.num_free_among(hits) > self.allocator.num_free:
                break
            if len(step.block_updates) + len(hits) + new_blocks > self.limits.max_block_updates:
                break
            self.waiting.pop(0)
            self._vtime = max(self._vtime, seq.tag)
            self._inner_vtime[seq.sender] = max(self._inner_vtime.get(seq.sender, 0),
                                                seq.inner_start)
            if seq.admitted_at is None:
                seq.admitted_at = time.time()
            seq.move_to(SeqStatus.RUNNING)
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
                seq.resumed_at = len(seq.output_ids)
            self._init_slot(step, seq)
            budget -= self._plan_row(step, seq, budget)
        return budget

    def _init_slot(self, step: PlannedStep, seq: Sequence) -> None:
        """seq takes its executor slot: its encoded parameters and the ids min_tokens masks."""
        slot = seq.slot
        assert slot is not None
        seq.draft_model_kv = self._draft_model_kv(seq)
        step.new_slots.append((slot, encode_slot(seq.params, len(seq.prompt_ids), seq.index)))
        step.stop_ids += [(slot, t) for t in suppressed_ids(
            seq.params, self.limits.eos_token_ids, len(seq.output_ids))]
        if seq.grammar:
            step.grammars.append(SlotGrammar(slot, seq.grammar, list(seq.output_ids)))

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
        """HELD samples wait until sample 0's prompt is planned (and its blocks cached)."""
        for rid, siblings in list(self._held.items()):
            first = next((s for s in self.requests[rid] if s.index == 0), None)
            if (first is None or first.status is SeqStatus.FINISHED
                    or first.num_computed >= len(first.prompt_ids)):
                del self._held[rid]
                for seq in siblings:
                    seq.move_to(SeqStatus.WAITING)
                    self._enqueue(seq)

    # ------------------------------------------------------------ results in

    def on_sampled(self, step_id: int, token_ids: list[int],
                   logprobs: StepLogprobs | None = None,
                   prompt_logprobs: PromptLogprobs | None = None,
                   accepted: list[int] | None = None) -> None:
        """Step `step_id` finished; token_ids has one id per sampled position, in row order
        (a row's, and one more per draft of a row with drafts), and logprobs (if the step
        computed them) one entry per position as well; accepted how many positions stand in
        each row with drafts; prompt_logprobs one per pair of the step's prompt_logprobs."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"executor reported step {step_id}, expected {step.step_id}")
        if prompt_logprobs is not None:
            self._take_prompt_logprobs(step, prompt_logprobs)
        self.free_ring_slots.append(step.ring_slot)
        rows = step.sampled_rows
        num_positions = sum(1 + r.num_draft for r in rows)
        if len(token_ids) != num_positions:
            raise RuntimeError(f"step {step_id}: {len(token_ids)} ids for {num_positions} "
                               "sampled positions")
        stands = iter(accepted or ())
        first = 0  # the row's first position among token_ids
        for row in rows:
            seq, width = row.seq, 1 + row.num_draft
            base, first = first, first + width
            seq.num_pending -= width
            num_stand = 1
            if row.num_draft:
                num_stand = next(stands, 0)
                if not 1 <= num_stand <= width:
                    raise RuntimeError(f"step {step_id}: {num_stand} positions stand in a row "
                                       f"of {width}")
                seq.num_drafted_inflight -= 1
                self._drop_rejected(seq, width - num_stand)
                self._count_drafts(seq, num_stand - 1)
            if seq.status is SeqStatus.FINISHED:
                continue  # a finished one's extra tokens are dropped
            for j in range(base, base + num_stand):
                if not self._take_token(seq, token_ids[j], logprobs, j):
                    break
            self._register_blocks(seq)
        for row in step.rows:
            row.seq.num_inflight -= 1
            self._maybe_release(row.seq)

    def _take_token(self, seq: Sequence, token: int, logprobs: StepLogprobs | None,
                    j: int) -> bool:
        """Append seq's next sampled token (position j of its step); False if it finished."""
        if token < 0:  # the executor could not sample it (its grammar failed)
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
        self._touched[seq] = None
        finish = check_stop(seq.params, self.limits.eos_token_ids, token, len(seq.output_ids),
                            seq.num_known, self.max_len)
        if finish is not None:
            seq.stop_token = finish.stop_token
            self._finish(seq, finish.reason)
            return False
        return True

    def _drop_rejected(self, seq: Sequence, num_rejected: int) -> None:
        """Forget the KV of a row's rejected drafts, and give back the blocks only they
        filled: nothing else in flight writes them (the sequence was not planned again)."""
        seq.num_computed -= num_rejected
        # (a draft model's row: the block its last sample lands in too, see _drafts)
        keep = self.allocator.blocks_for(seq.num_computed + int(seq.draft_model_kv))
        if len(seq.blocks) > keep and seq.status is not SeqStatus.FINISHED:
            self.allocator.free(seq.blocks[keep:][::-1])
            del seq.blocks[keep:]

    def _count_drafts(self, seq: Sequence, num_accepted: int) -> None:
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
        if seq.proposal is not None:
            Proposer.record(seq.proposal, num_accepted)

    def _take_prompt_logprobs(self, step: PlannedStep, scored: PromptLogprobs) -> None:
        lps, ranks, top_ids, top_lps = scored
        j = 0
        for seq, count in step.plp_owners:
            k = seq.params.prompt_logprobs or 0
            for _ in range(count):
                seq.prompt_logprobs.append(TokenLogprob(
                    step.prompt_logprobs[j][1], lps[j], top_ids[j][:k], top_lps[j][:k],
                    rank=ranks[j]))
                j += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.HELD:
            self._held[seq.request_id].remove(seq)
        self._touched[seq] = None
        self._remember_final(seq.request_id, seq.reply_to, len(seq.prompt_ids))
        seq.move_to(SeqStatus.FINISHED)
        seq.finish_reason = reason
        self._count_finished(reason)
        if seq.index == 0 and seq.admitted_at is not None:
            self.request_phases.record(seq.arrival_time, seq.admitted_at, seq.first_token_at,
                                       time.time())
        self._maybe_release(seq)
        if seq.index == 0 and seq.request_id in self._held:
            self._release_siblings()  # they no longer wait for its prompt

    def _remember_final(self, rid: str, reply_to: str, num_prompt: int) -> None:
        """For fail_requests: the final output just sent on may yet be lost with its
        detokenizer."""
        self._recent_finals.append((time.monotonic(), rid, reply_to, num_prompt))
        if len(self._recent_finals) > MAX_RECENT_FINALS:
            self._recent_finals.popleft()

    def _count_finished(self, reason: FinishReason) -> None:
        self.finished[reason.value] = self.finished.get(reason.value, 0) + 1

    def _maybe_release(self, seq: Sequence) -> None:
        """Free blocks and slot once no in-flight step can still write them."""
        if seq.num_inflight:
            return
        seqs = self.requests.get(seq.request_id)
        if seq.status is SeqStatus.FINISHED and seqs is not None and seq in seqs:
            self._release(seq)
            seqs.remove(seq)
            left = self._sender_samples.pop(seq.sender, 1) - 1
            if left:
                self._sender_samples[seq.sender] = left
            if not seqs:
                del self.requests[seq.request_id]
                self._held.pop(seq.request_id, None)
        elif seq.status is SeqStatus.PREEMPTING:
            self._release(seq)
            seq.move_to(SeqStatus.WAITING)
            seq.num_computed = 0
            self._enqueue(seq)

    def _release(self, seq: Sequence) -> None:
        self._victims.discard(seq)
        self.allocator.free(seq.blocks[::-1])
        seq.blocks = []
        seq.num_registered = 0
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)

    @staticmethod
    def _prompt_logprobs_to_send(seq: Sequence) -> list[TokenLogprob] | None:
        """All of a sequence's prompt logprobs, once they are in (the first token, which
        nothing scores, has logprob NaN)."""
        if seq.plp_sent or not _scores_prompt(seq):
            return None
        if len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1:
            return None
        seq.plp_sent = True
        return [TokenLogprob(seq.prompt_ids[0], math.nan), *seq.prompt_logprobs]

    def stats(self) -> SchedulerStats:
        lim, m = self.limits, self.step_metrics
        return SchedulerStats(
            self.num_blocks, self.allocator.num_free, lim.max_num_seqs, len(self.free_slots),
            lim.depth + 1, len(self.free_ring_slots), len(self.inflight), len(self.waiting),
            len(self.running), len(self.requests), self.num_preemptions, self.next_step_id,
            self.prefix_cache_queries, self.prefix_cache_hits, self.allocator.num_cached_free,
            dict(self.finished), self.prompt_tokens, self.generation_tokens,
            list(m.seconds), m.seconds_sum, list(m.tokens), m.tokens_sum, m.idle_fraction,
            time.monotonic() - self._started,
            request_phases=self.request_phases.snapshot(),
            load_tokens=sum(s.num_known for seqs in self.requests.values() for s in seqs),
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos))

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
                seq.request_id, new, seq.finish_reason if finished else None,
                seq.error if finished else None, seq.index,
                logprobs, max(seq.num_cached_tokens, 0), seq.stop_token,
                self._prompt_logprobs_to_send(seq)))
        out = StepOutputs(self._new_infos, deltas, self._rejected)
        self._new_infos, self._rejected, self._touched = [], [], {}
        return out


def _scores_prompt(seq: Sequence) -> bool:
    """Whether seq's prompt logprobs are computed (sample 0 of a request that asks)."""
    return seq.params.prompt_logprobs is not None and seq.index == 0


def _inner_key(seq: Sequence) -> tuple[float, int, int]:
    """A sample's order within its sender: weighted fair queueing finish (priority shifts
    it by INNER_PRIORITY_STEP a step), then arrival."""
    return (seq.inner_finish, seq.order, seq.index)
