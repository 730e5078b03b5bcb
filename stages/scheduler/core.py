"""Continuous batching core of the scheduler process: no sockets, unit-tested directly.

One step reads as: `schedule()` plans the next step (it may run `depth` steps ahead of the
executor, times the pipeline's stages: EngineLimits.max_inflight), `on_sampled()` takes a
step's sampled ids, `take_outputs()` hands token deltas on.
`Scheduler` composes its parts and moves samples between their states: the queue policy
(queue_policy.py: fair queueing, priority, the waiting cap), the KV manager (kv_manager.py:
slots, blocks, prefix cache, preemption room), the step builder (step_builder.py, with
drafts.py for speculative rows) and the book of requests (requests.py: n-sample siblings,
finals, outputs). A request with n samples is n sequences: sample 0 is admitted first, the
others once its prompt is planned, so they find its full blocks in the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ipc.config import EngineLimits
from ipc.messages import (
    ErrorKind,
    FinishReason,
    RequestRejected,
    SchedulerStats,
    TokenizedRequest,
    TokenLogprob,
)
from ipc.speculative import SpeculativeConfig
from ipc.step import PromptLogprobs, StepLogprobs
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.drafts import DraftCounts, DraftPlanner
from stages.scheduler.kv_manager import KVManager
from stages.scheduler.metrics import RequestPhases, StepMetrics
from stages.scheduler.planned import PlannedRow, PlannedStep
from stages.scheduler.queue_policy import MAX_SENDERS, QueuePolicy
from stages.scheduler.requests import (
    RECENT_FINAL_S,
    RequestBook,
    StepOutputs,
    invalid_reason,
    take_prompt_logprobs,
)
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.step_builder import StepBuilder
from stages.scheduler.stopping import check_stop, output_limit, stopping_ids

# (named here too: the process and tests import them from the core)
__all__ = ["MAX_SENDERS", "RECENT_FINAL_S", "Scheduler", "StepOutputs"]

T = TypeVar("T")


class _Part(Generic[T]):
    """A Scheduler attribute that lives in one of its parts: `part.name`, read through."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, obj: Any, owner: type | None = None) -> T:
        return getattr(getattr(obj, self.part), self.name)  # type: ignore[no-any-return]


class Scheduler:
    def __init__(self, limits: EngineLimits, num_blocks: int,
                 max_waiting: int | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        """num_blocks: the KV cache's, as the executor reported them (every KV group's blocks
        come from them: limits.kv_windows). max_waiting: sequences that may wait
        (queued or held); a request that would pass it is refused as unavailable, counted
        here where it happens. speculative: propose drafts for decoding sequences (n-gram
        prompt lookup, or a draft model's placeholders); its K must be the limits'."""
        self.limits = limits
        if speculative is not None and speculative.num_tokens > limits.num_speculative_tokens:
            raise ValueError(f"speculative K {speculative.num_tokens} exceeds the rings' "
                             f"{limits.num_speculative_tokens}")
        self.kv = KVManager(num_blocks, limits.block_size, limits.max_num_seqs,
                            limits.max_block_updates, limits.kv_windows)
        self.num_blocks = num_blocks
        # A sequence may not outgrow the whole cache: past it, it could only preempt itself.
        # In a windowed group, one holds only the blocks its window spans.
        self.max_len = self.kv.max_len(limits.max_model_len)
        self.queue = QueuePolicy(self.max_len, max_waiting)
        k = speculative.num_tokens if speculative is not None else 0
        self.spec = DraftCounts(accepted_per_pos=[0] * k)
        self.drafts = (DraftPlanner(speculative, self.max_len, limits.max_num_seqs, self.spec)
                       if speculative is not None else None)
        self.builder = StepBuilder(limits, self.max_len, self.queue, self.kv, self.drafts,
                                   self._preempt)
        self.book = RequestBook()
        self.inflight: deque[PlannedStep] = deque()
        # A ring slot is rewritten only after the step that used it reported back.
        self.free_ring_slots: list[int] = list(range(limits.num_ring_slots - 1, -1, -1))
        # The run-ahead depth of each micro-batch set: limits.depth, or with auto_depth 2
        # until the shell sees the device's steps are short (pacing.py RunAheadDepth). With
        # P pipeline stages, P sets take turns, so P times as many steps may be in flight.
        self.depth = min(2, limits.depth) if limits.auto_depth else limits.depth
        self.stages = limits.pipeline_stages
        self.discarded_tokens = 0  # computed for a sequence that had finished: dropped
        # Requests whose sample 0 keeps windowed pages for its waiting siblings (trim_floor)
        self._sharing: dict[str, Sequence] = {}
        self.next_step_id = 0
        self.num_preemptions = 0
        self.generation_tokens = 0
        self.step_metrics = StepMetrics()
        self.request_phases = RequestPhases()
        self._started = time.monotonic()

    # The parts' state, read where callers (the process, tools, tests) have always read it.
    requests = _Part[dict[str, list[Sequence]]]("book", "requests")
    waiting = _Part[list[Sequence]]("queue", "waiting")
    allocator = _Part[BlockAllocator]("kv", "allocator")
    running = _Part[list[Sequence]]("kv", "running")
    free_slots = _Part[list[int]]("kv", "free_slots")
    prefix_cache_hits = _Part[int]("kv", "prefix_cache_hits")
    spec_num_drafts = _Part[int]("spec", "num_drafts")
    spec_num_draft_tokens = _Part[int]("spec", "num_draft_tokens")
    spec_num_accepted_tokens = _Part[int]("spec", "num_accepted_tokens")
    spec_accepted_per_pos = _Part[list[int]]("spec", "accepted_per_pos")

    def seq(self, request_id: str, index: int = 0) -> Sequence:
        """A live sample of a request (tests and debugging)."""
        return self.book.seq(request_id, index)

    # ------------------------------------------------------------ requests in

    def add_request(self, req: TokenizedRequest) -> None:
        refusal = self._admission_error(req)
        if refusal is not None:
            self.book.refuse(refusal)
            return
        p = req.params
        sender = f"{req.reply_to}\0{p.user}"
        num_prompt = len(req.prompt_token_ids)
        tags = self.queue.tag_request(p, num_prompt, sender)
        limit, stop_ids = (output_limit(p, num_prompt, self.max_len),
                           stopping_ids(p, self.limits.eos_token_ids))
        seqs = [Sequence(req.request_id, list(req.prompt_token_ids), p, req.arrival_time,
                         index=i, order=tags.order, tag=tags.start + i * tags.cost,
                         sender=sender, reply_to=req.reply_to, grammar=req.grammar,
                         inner_start=tags.inner, inner_finish=tags.inner + tags.cost,
                         status=SeqStatus.HELD if i else SeqStatus.WAITING,
                         output_limit=limit, stopping_ids=stop_ids,
                         adapter_id=self.builder.adapters.id_of(p) or 0)
                for i in range(p.n)]
        self.book.add(req, seqs)
        self.queue.enqueue(seqs[0])

    def _admission_error(self, req: TokenizedRequest) -> RequestRejected | None:
        """The answer to a request that cannot be taken, if it cannot."""
        num_prompt, book = len(req.prompt_token_ids), self.book

        def refuse(reason: FinishReason, message: str | None = None,
                   kind: ErrorKind = ErrorKind.INVALID_REQUEST) -> RequestRejected:
            return RequestRejected(req.request_id, req.reply_to, reason, message, num_prompt,
                                   kind if reason is FinishReason.ERROR else None)

        if req.request_id in book.requests:
            return refuse(FinishReason.ERROR, f"request id {req.request_id!r} is already in use")
        invalid = invalid_reason(req, self.limits)
        if invalid is not None:
            return refuse(FinishReason.ERROR, invalid)
        if book.was_aborted(req.request_id) or req.reply_to in book.forgotten:
            return refuse(FinishReason.ABORT)
        overload = self.queue.overload(sum(map(len, book.held.values())), req.params.n)
        if overload is not None:
            return refuse(FinishReason.ERROR, overload, ErrorKind.UNAVAILABLE)
        needed = self.kv.blocks_to_run(num_prompt + 1)
        if needed > self.num_blocks:
            return refuse(FinishReason.ERROR,
                          f"the prompt needs {needed} KV blocks but the cache has only "
                          f"{self.num_blocks}; raise --kv-cache-memory or shorten it")
        return None

    def abort(self, request_id: str) -> None:
        """End every sample of a request wherever it is (finish reason abort)."""
        seqs = self.book.requests.get(request_id)
        if seqs is None:  # it may still be in a tokenizer: remember it for a while
            self.book.note_early_abort(request_id)
            return
        for seq in list(seqs):
            self._finish(seq, FinishReason.ABORT)

    def fail_requests(self, belongs: Callable[[str], bool], message: str) -> None:
        """The detokenizer of the requests whose id `belongs` died: their text state went
        with it. Each live one ends with an error that needs no such state, in place of the
        rest of its output; so does each that ended in the last RECENT_FINAL_S, whose final
        output may have gone to the dead worker (a client ignores what follows a final)."""
        book = self.book
        book.prune_finals()
        failed: set[str] = set()
        for rid, seqs in list(book.requests.items()):
            if belongs(rid):
                first = seqs[0]
                for seq in list(seqs):
                    self._finish(seq, FinishReason.ERROR)
                    book.touched.pop(seq, None)  # no delta: nobody holds its text state now
                book.reject_unavailable(rid, first.reply_to, message, len(first.prompt_ids))
                failed.add(rid)
        book.fail_recent(belongs, failed, message)

    def known_requests(self, request_ids: list[str]) -> list[str]:
        """Which of these ids this engine holds. A client names the unfinished requests it
        had sent to a tokenizer that was restarted; this is asked behind every request the
        new worker forwarded first, so an id no engine holds was lost with the dead one
        (ipc.messages.EngineReconcile; the tokenizer answers the client). One that ended
        lately counts as held: its final output may still be on its way to the client."""
        return self.book.known(request_ids)

    def forget_client(self, reply_to: str) -> None:
        """A client died (an HTTP worker): abort what it had sent, refuse what still comes."""
        for rid in self.book.forget_client(reply_to):
            self.abort(rid)

    def stop_sample(self, request_id: str, index: int) -> None:
        """A detokenizer found a stop string in sample `index`; its client already has the
        final output, so the sample is only freed (a late duplicate is ignored)."""
        for seq in list(self.book.requests.get(request_id, ())):
            if seq.index == index:
                self._finish(seq, FinishReason.STOP)

    # ------------------------------------------------------------ planning

    def schedule(self) -> PlannedStep | None:
        """Plan the next step, or None if there is nothing to run or too much in flight."""
        if len(self.inflight) >= self.depth * self.stages:
            return None
        step = PlannedStep(self.next_step_id)
        self.builder.fill(step)
        if self._sharing:
            self._siblings_admitted()
        if not step.rows:
            return None
        self.next_step_id += 1
        step.ring_slot = self.free_ring_slots.pop()
        # One pass over the rows (a row per sequence per step): in flight, the tokens each
        # sender is served, and the blocks a row filled offered to the prefix cache (the
        # common case, no new full block, checked here as register_blocks checks it first).
        served: dict[str, int] = {}
        bs, register = self.kv.block_size, self.kv.register_blocks
        for row in step.rows:
            seq = row.seq
            seq.num_inflight += 1
            served[seq.sender] = served.get(seq.sender, 0) + len(row.token_ids)
            if seq.num_computed >= (seq.num_registered + 1) * bs:
                register(seq)
        self.queue.credit(served)
        if self.book.held:
            self._release_siblings()
        self.inflight.append(step)
        return step

    def has_room(self) -> bool:
        """Whether a request arriving now could still join the next step: a slot that the
        waiting samples will not take, and the work known (prompt tokens to compute,
        decodes) short of the step's budget."""
        waiting = self.queue.waiting
        if len(self.kv.free_slots) <= len(waiting):
            return False
        known = sum(seq.num_tokens - seq.num_computed for seq in self.kv.running
                    if seq.status is SeqStatus.RUNNING)
        known += sum(seq.num_tokens for seq in waiting)
        return known < self.limits.max_num_batched_tokens

    def _release_siblings(self) -> None:
        for seq in self.book.siblings_ready():
            self.queue.enqueue(seq)
            first = self.book.requests[seq.request_id][0]
            if (self.kv.windowed and first.index == 0 and first.status is SeqStatus.RUNNING
                    and first.trim_floor is None):
                # Its windowed pages that the siblings' prefix hit reads stay until they
                # are admitted (holding them too) or gone: _siblings_admitted.
                bs = self.kv.block_size
                hit = (len(first.prompt_ids) - 1) // bs * bs
                first.trim_floor = self.kv.windowed[0].first_read_page(hit)
                self._sharing[seq.request_id] = first

    def _siblings_admitted(self) -> None:
        """Sample 0 of a request whose siblings no longer wait lets its window decide."""
        for rid, first in list(self._sharing.items()):
            seqs = self.book.requests.get(rid, [])
            if not any(s.status is SeqStatus.WAITING for s in seqs if s is not first):
                first.trim_floor = None
                del self._sharing[rid]

    # ------------------------------------------------------------ results in

    def on_sampled(self, step_id: int, token_ids: list[int],
                   logprobs: StepLogprobs | None = None,
                   prompt_logprobs: PromptLogprobs | None = None,
                   accepted: list[int] | None = None,
                   pooled: list[bytes] | None = None) -> None:
        """Step `step_id` finished; token_ids has one id per sampled position, in row order
        (a row's, and one more per draft of a row with drafts), and logprobs (if the step
        computed them) one entry per position as well; accepted how many positions stand in
        each row with drafts; prompt_logprobs one per pair of the step's prompt_logprobs;
        pooled one vector per sampled row of an embedding (its prompt's end), in row
        order: that row's token is dropped and the embedding finishes with its vector."""
        step = self.inflight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"executor reported step {step_id}, expected {step.step_id}")
        if prompt_logprobs is not None:
            take_prompt_logprobs(step, prompt_logprobs)
        self.free_ring_slots.append(step.ring_slot)
        if len(token_ids) != step.num_sampled:
            raise RuntimeError(f"step {step_id}: {len(token_ids)} ids for {step.num_sampled} "
                               "sampled positions")
        # Most rows are a sequence's one sampled token, neither its first nor an error, with
        # no logprobs to keep: those are taken here, and only a token that passes a screen
        # (stopping.py output_limit, stopping_ids) gets check_stop. The rest go the general
        # way (_take_drafted, _take_token).
        touched, finished = self.book.touched, SeqStatus.FINISHED
        bs, register = self.kv.block_size, self.kv.register_blocks
        stands = iter(accepted or ())
        vectors = iter(pooled or ())
        num_taken = 0
        j = 0  # the row's first position among token_ids
        for row in step.rows:
            if not row.do_sample:
                continue
            seq = row.seq
            if row.num_draft:
                self._take_drafted(step_id, row, next(stands, 0), token_ids, j, logprobs)
                j += 1 + row.num_draft
                continue
            seq.num_pending -= 1
            token = token_ids[j]
            j += 1
            if row.pooling:  # an embedding's prompt is computed: its vector, not the token
                self._take_embedding(step_id, seq, next(vectors, None))
                continue
            if seq.status is finished:  # a finished one's extra token is dropped
                self.discarded_tokens += 1
                continue
            if (token < 0 or seq.first_token_at is None
                    or logprobs is not None and seq.params.logprobs is not None):
                self._take_token(seq, token, logprobs, j - 1)
            else:
                out = seq.output_ids
                out.append(token)
                num_taken += 1
                touched[seq] = None
                n = len(out)
                if n >= seq.output_limit or (token in seq.stopping_ids
                                             and n > seq.params.min_tokens):
                    self._stop_if_done(seq, token)
            if seq.num_computed >= (seq.num_registered + 1) * bs:
                register(seq)
        self.generation_tokens += num_taken
        running = SeqStatus.RUNNING
        for row in step.rows:
            seq = row.seq
            seq.num_inflight -= 1
            if not seq.num_inflight and seq.status is not running:
                self._maybe_release(seq)  # (a running one keeps its blocks and slot)

    def _take_drafted(self, step_id: int, row: PlannedRow, num_stand: int,
                      token_ids: list[int], first: int, logprobs: StepLogprobs | None) -> None:
        """A sampled row with drafts: its positions from `first` that stand are taken."""
        seq = row.seq
        num_stand = self._verify(step_id, row, num_stand)
        if seq.status is SeqStatus.FINISHED:  # a finished one's extra tokens are dropped
            self.discarded_tokens += num_stand
            return
        for j in range(first, first + num_stand):
            if not self._take_token(seq, token_ids[j], logprobs, j):
                break
        self.kv.register_blocks(seq)

    def _verify(self, step_id: int, row: PlannedRow, num_stand: int) -> int:
        """A sampled row with drafts is in: of its 1 + num_draft positions, num_stand stand
        (the rest are rejected drafts, whose KV is dropped). Returns num_stand."""
        seq, width = row.seq, 1 + row.num_draft
        seq.num_pending -= width
        if not 1 <= num_stand <= width:
            raise RuntimeError(f"step {step_id}: {num_stand} positions stand in a row "
                               f"of {width}")
        seq.num_drafted_inflight -= 1
        self.kv.drop_rejected(seq, width - num_stand)
        assert self.drafts is not None  # (rows carry drafts only with a proposer)
        self.drafts.count_accepted(seq, num_stand - 1)
        return num_stand

    def _take_embedding(self, step_id: int, seq: Sequence, vector: bytes | None) -> None:
        """An embedding's last prompt chunk is in: it finishes (stop) with its vector; the
        token its row sampled is dropped (the sampler runs over every sampled row alike)."""
        if vector is None:
            raise RuntimeError(f"step {step_id}: no pooled vector for an embedding's row")
        if seq.status is SeqStatus.FINISHED:  # (aborted meanwhile)
            return
        seq.embedding = vector
        self.kv.register_blocks(seq)  # (its prompt's KV serves later prompts, as any)
        self._finish(seq, FinishReason.STOP)

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
        self.book.touched[seq] = None
        return not self._stop_if_done(seq, token)

    def _stop_if_done(self, seq: Sequence, token: int) -> bool:
        """Finish seq if `token`, its last output, ends it; True if it did."""
        finish = check_stop(seq.params, self.limits.eos_token_ids, token, len(seq.output_ids),
                            seq.num_known, self.max_len)
        if finish is None:
            return False
        seq.stop_token = finish.stop_token
        self._finish(seq, finish.reason)
        return True

    # ------------------------------------------------------------ state changes

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.queue.remove(seq)
        self.book.finish(seq, reason)
        if seq.index == 0 and seq.admitted_at is not None:
            self.request_phases.record(seq.arrival_time, seq.admitted_at, seq.first_token_at,
                                       time.time())
        self._maybe_release(seq)
        if seq.index == 0 and seq.request_id in self.book.held:
            self._release_siblings()  # they no longer wait for its prompt

    def _preempt(self, victim: Sequence) -> None:
        """victim leaves the running set once its in-flight steps drain, and waits again."""
        victim.move_to(SeqStatus.PREEMPTING)
        self.kv.victims.add(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._maybe_release(victim)

    def _maybe_release(self, seq: Sequence) -> None:
        """Free blocks and slot once no in-flight step can still write them."""
        if seq.num_inflight:
            return
        if seq.status is SeqStatus.FINISHED and self.book.is_live(seq):
            self.kv.release(seq)
            self.book.remove(seq)
            self.queue.release_sample(seq.sender)
        elif seq.status is SeqStatus.PREEMPTING:
            self.kv.release(seq)
            seq.move_to(SeqStatus.WAITING)
            seq.num_computed = 0
            self.queue.enqueue(seq)

    # ------------------------------------------------------------ outputs

    def stats(self) -> SchedulerStats:
        lim, m, kv = self.limits, self.step_metrics, self.kv
        return SchedulerStats(
            self.num_blocks, kv.allocator.num_free, lim.max_num_seqs, len(kv.free_slots),
            lim.num_ring_slots, len(self.free_ring_slots), len(self.inflight),
            len(self.queue.waiting), len(kv.running), len(self.book.requests),
            self.num_preemptions, self.next_step_id, kv.prefix_cache_queries,
            kv.prefix_cache_hits, kv.allocator.num_cached_free, dict(self.book.finished),
            self.book.prompt_tokens, self.generation_tokens,
            list(m.seconds), m.seconds_sum, list(m.tokens), m.tokens_sum, m.idle_fraction,
            time.monotonic() - self._started,
            request_phases=self.request_phases.snapshot(),
            load_tokens=sum(s.num_known for seqs in self.book.requests.values() for s in seqs),
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec.accepted_per_pos),
            run_ahead_depth=self.depth, discarded_tokens=self.discarded_tokens,
            max_seq_blocks=kv.max_seq_blocks)

    def take_outputs(self, columns: bool = False) -> StepOutputs:
        """New request infos, token deltas and rejections since the last call, in order
        (with `columns`, the steady case's deltas apart: RequestBook.take_outputs)."""
        return self.book.take_outputs(columns)
