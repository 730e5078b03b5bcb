"""The waiting queue's policy, in the scheduler process: which waiting sample is admitted next
(start-time fair queueing across senders, weighted fair queueing within one, priority), the
cap on waiting samples, and which running sample gives up its slot to a waiting one."""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from typing import NamedTuple

from ipc.messages import SamplingParams
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import SeqStatus, Sequence

# One step of priority is worth this many tokens of other requests' work: a request of priority
# p is admitted before requests of priority p + 1 that came up to this much work before it.
PRIORITY_STEP_TOKENS = 1024
# Within one sender, in its virtual time (tokens of service per live sample): a request of
# priority p goes before the sender's requests of priority p + 1 that came up to this much
# service before it. (Strict priority would let a sender's own urgent traffic starve its
# other requests for as long as it lasts.)
INNER_PRIORITY_STEP = 64
MAX_SENDERS = 4096  # past this many senders, the idle and the caught up are forgotten
SORT_KEY = operator.attrgetter("sort_key")  # the waiting queue's order (Sequence.sort_key)


class RequestTags(NamedTuple):
    """Where a new request's samples queue: sample i has tag `start + i * cost`; each starts
    at `inner` in its sender's own virtual time and finishes at `inner + cost`."""

    order: int  # arrival order in the scheduler (ties between equal tags)
    start: int
    cost: int
    inner: float


def inner_key(seq: Sequence) -> tuple[float, int, int]:
    """A sample's order within its sender: weighted fair queueing finish (priority shifts
    it by INNER_PRIORITY_STEP a step), then arrival."""
    return (seq.inner_finish, seq.order, seq.index)


def victim_key(seq: Sequence) -> tuple[int, bool, tuple[int, int, int]]:
    """The order in which running samples give up their blocks (the largest first): the
    lowest priority, then one not just resumed (so it is spared while another can go),
    then the latest in the waiting order."""
    return (seq.params.priority, not seq.is_just_resumed, seq.sort_key)


class QueuePolicy:
    """The waiting samples in admission order (`waiting`, sorted by Sequence.sort_key) and
    the fair-queueing state that orders them. Senders are a client and a request's user."""

    def __init__(self, max_len: int, max_waiting: int | None = None) -> None:
        """max_len: the longest a sequence may grow (a request's cost is bounded by it).
        max_waiting: samples that may wait (queued or held), None for no cap."""
        self.max_len, self.max_waiting = max_len, max_waiting
        self.waiting: list[Sequence] = []
        self._next_order = 0
        # Start-time fair queueing over senders, in tokens of work: the virtual time is the
        # largest tag admitted; a sender's end is where its next request starts.
        self.vtime = 0
        self.sender_end: dict[str, int] = {}
        self._forget_at = MAX_SENDERS
        # Within a sender, weighted fair queueing over its samples: each sender's virtual
        # time, its live samples, and a heap of its waiting samples by inner finish (entries
        # of samples no longer waiting, or re-tagged, are skipped lazily).
        self.inner_vtime: dict[str, float] = {}
        self.sender_samples: dict[str, int] = {}
        self._inner_queue: dict[str, list[tuple[float, int, int, int, Sequence]]] = {}
        self._heap_ids = itertools.count()

    # ------------------------------------------------------------ arrivals

    def overload(self, num_held: int, n: int) -> str | None:
        """Why a request of n samples cannot wait (num_held samples wait for their sample 0
        besides the queue), or None if it can."""
        num_waiting = len(self.waiting) + num_held
        if self.max_waiting is None or num_waiting + n <= self.max_waiting:
            return None
        return (f"the engine is overloaded ({num_waiting} sequences waiting, at most "
                f"{self.max_waiting}); retry shortly")

    def tag_request(self, params: SamplingParams, num_prompt: int, sender: str) -> RequestTags:
        """Tags of an admitted request, whose n samples now count as the sender's live ones.
        A sender's requests follow one another (first come first served within it), each
        costing n * (prompt + most outputs) tokens; a sender that was idle starts at the
        virtual time, so it is served next whatever others queued before. Priority moves a
        request by PRIORITY_STEP_TOKENS per step. So one request's n, its prompt length and a
        flood of requests are counted against their sender, and nobody else waits behind
        them (see also share_slots). Which of a sender's samples takes its turn is decided
        among its requests (promote_within_sender)."""
        p = params
        cost = num_prompt + min(p.max_tokens or self.max_len, max(self.max_len - num_prompt, 1))
        base = max(self.vtime, self.sender_end.get(sender, 0))
        self.sender_end[sender] = base + p.n * cost
        if len(self.sender_end) > self._forget_at:
            self._forget_senders(sender)
        order, self._next_order = self._next_order, self._next_order + 1
        inner = self.inner_vtime.get(sender, 0) + p.priority * INNER_PRIORITY_STEP
        self.sender_samples[sender] = self.sender_samples.get(sender, 0) + p.n
        return RequestTags(order, base + p.priority * PRIORITY_STEP_TOKENS, cost, inner)

    def _forget_senders(self, sender: str) -> None:
        """Past MAX_SENDERS, keep only senders with live samples and ahead of the virtual
        time: for one caught up, max(vtime, end) is vtime anyway; an idle one gains at most
        the cost of its last request. (A sender has live samples while sender_samples counts
        it, so `sender`, whose request is being tagged, is kept too.)"""
        live = set(self.sender_samples) | {sender}
        vtime = self.vtime
        self.sender_end = {k: v for k, v in self.sender_end.items() if v > vtime and k in live}
        self.inner_vtime = {k: v for k, v in self.inner_vtime.items() if k in live}
        self._inner_queue = {k: v for k, v in self._inner_queue.items() if k in live}
        self._forget_at = max(MAX_SENDERS, 2 * len(self.sender_end))

    def release_sample(self, sender: str) -> None:
        """A sample of sender's is gone for good (finished and released)."""
        left = self.sender_samples.pop(sender, 1) - 1
        if left:
            self.sender_samples[sender] = left

    # ------------------------------------------------------------ the queue

    def enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=SORT_KEY)
        heapq.heappush(self._inner_queue.setdefault(seq.sender, []),
                       (*inner_key(seq), next(self._heap_ids), seq))

    def remove(self, seq: Sequence) -> None:
        """A waiting sample ends before its turn (its heap entry is skipped later)."""
        self.waiting.remove(seq)

    def promote_within_sender(self) -> None:
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
            if best.status is SeqStatus.WAITING and inner_key(best) == heap[0][:3]:
                break
            heapq.heappop(heap)  # admitted, finished, or re-tagged since
        else:
            return
        if best is first:
            return
        i = bisect.bisect_left(self.waiting, best.sort_key, key=SORT_KEY)
        assert self.waiting[i] is best
        del self.waiting[i]
        del self.waiting[0]
        first.tag, best.tag = best.tag, first.tag
        # (by its key too: another sender's sample may hold the same tag, arrived earlier)
        bisect.insort(self.waiting, best, key=SORT_KEY)
        bisect.insort(self.waiting, first, key=SORT_KEY)

    def pop_admitted(self) -> Sequence:
        """The first waiting sample takes its turn: both virtual times reach its start."""
        seq = self.waiting.pop(0)
        self.vtime = max(self.vtime, seq.tag)
        self.inner_vtime[seq.sender] = max(self.inner_vtime.get(seq.sender, 0),
                                           seq.inner_start)
        return seq

    def serve(self, step: PlannedStep) -> None:
        """Each sender's virtual time moves with the tokens a step computes for it, shared
        over its live samples (the service each would have had from a fluid share). So a
        request arriving later starts where the others have got to, and a stream of short
        ones cannot keep a long one waiting for ever: its finish is passed after a bounded
        amount of their work. (Admission also moves it to the admitted sample's start.)"""
        served: dict[str, int] = {}
        for row in step.rows:
            served[row.seq.sender] = served.get(row.seq.sender, 0) + len(row.token_ids)
        self.credit(served)

    def credit(self, served: dict[str, int]) -> None:
        """serve, from the tokens of a step each sender had (Scheduler.schedule counts them
        in its one pass over the rows)."""
        for sender, tokens in served.items():
            self.inner_vtime[sender] = self.inner_vtime.get(sender, 0) + tokens / max(
                1, self.sender_samples.get(sender, 1))

    # ------------------------------------------------------------ slots

    def share_slots(self, running: list[Sequence], max_num_seqs: int) -> Sequence | None:
        """Every slot is taken and a sequence waits: the running one to preempt for it, if
        any (re-tagged behind it). If the first waiting one's sender holds fewer than its
        fair share of the slots (max_num_seqs over the senders running and the first
        waiting) while another holds more, that one's last sequence. Its slot comes back
        once its steps drain, and the waiting one is admitted then: a request with n = 128,
        or a sender's many requests, cannot keep everyone else waiting until they end. The
        caller takes one victim at a time, and only down to the fair share, so this never
        thrashes: senders holding their share are never touched."""
        first = self.waiting[0]
        held: dict[str, list[Sequence]] = {}
        for seq in running:
            if seq.status is SeqStatus.RUNNING:
                held.setdefault(seq.sender, []).append(seq)
        if not held:
            return None  # every slot is a finished sequence's, about to come back
        num_senders = len(held) + (first.sender not in held)
        share = -(-max_num_seqs // num_senders)
        if len(held.get(first.sender, ())) >= share:
            return self._share_within_sender(first, held[first.sender])
        most = max(held.values(), key=len)
        if len(most) <= share:
            return None
        return self._behind(max(most, key=SORT_KEY), first)

    def _share_within_sender(self, first: Sequence, mine: list[Sequence]) -> Sequence | None:
        """first's sender holds its share of the slots: among its own, the running sample
        that would finish last (promote_within_sender) gives its slot to first if first
        would finish strictly sooner. A sample that made room is never preempted for the
        one it made room for (its finish is later), and equal requests never preempt one
        another, so this does not thrash."""
        victim = max(mine, key=inner_key)
        return self._behind(victim, first) if first.inner_finish < victim.inner_finish else None

    def _behind(self, victim: Sequence, first: Sequence) -> Sequence:
        # Behind the one it makes room for, so that one takes the slot (not it again).
        victim.tag = max(self.vtime, first.tag) + 1
        return victim
