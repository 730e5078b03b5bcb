"""The queue policy alone (stages/scheduler/queue_policy.py): the order in which waiting samples
are admitted (fair between senders, weighted fair within one, priority), the waiting cap, and
which running sample gives its slot to a waiting one. No blocks, no steps: samples are made
here and admitted by hand, as StepBuilder admits them."""

from __future__ import annotations

from ipc.messages import SamplingParams
from stages.scheduler.planned import PlannedRow, PlannedStep
from stages.scheduler.queue_policy import (
    INNER_PRIORITY_STEP,
    MAX_SENDERS,
    PRIORITY_STEP_TOKENS,
    QueuePolicy,
)
from stages.scheduler.sequence import SeqStatus, Sequence

MAX_LEN = 4096


def add(q: QueuePolicy, rid: str, sender: str, prompt: int = 8, max_tokens: int = 8,
        priority: int = 0, n: int = 1,
        status: SeqStatus = SeqStatus.WAITING) -> list[Sequence]:
    """A request's samples, tagged as Scheduler.add_request tags them (all enqueued when
    WAITING: the siblings' hold is the request book's business, not the queue's)."""
    p = SamplingParams(max_tokens=max_tokens, priority=priority, n=n)
    tags = q.tag_request(p, prompt, sender)
    seqs = [Sequence(rid, [1] * prompt, p, 0.0, index=i, order=tags.order,
                     tag=tags.start + i * tags.cost, sender=sender, inner_start=tags.inner,
                     inner_finish=tags.inner + tags.cost, status=status) for i in range(n)]
    if status is SeqStatus.WAITING:
        for seq in seqs:
            q.enqueue(seq)
    return seqs


def admit(q: QueuePolicy, count: int | None = None) -> list[str]:
    """Admit `count` waiting samples (all by default) in the policy's order: 'rid' or
    'rid#i' for sample i > 0."""
    order = []
    while q.waiting and (count is None or len(order) < count):
        q.promote_within_sender()
        seq = q.pop_admitted()
        seq.move_to(SeqStatus.RUNNING)
        order.append(seq.request_id if seq.index == 0 else f"{seq.request_id}#{seq.index}")
    return order


def test_requests_cost_their_prompt_and_most_outputs() -> None:
    q = QueuePolicy(MAX_LEN)
    p = SamplingParams(max_tokens=8)
    assert q.tag_request(p, 100, "a").cost == 108
    # No max_tokens: up to the longest a sequence may grow.
    assert q.tag_request(SamplingParams(), 100, "b").cost == MAX_LEN
    assert q.sender_samples == {"a": 1, "b": 1}


def test_senders_take_turns_whatever_one_queued_first() -> None:
    q = QueuePolicy(MAX_LEN)
    for i in range(3):
        add(q, f"a{i}", "A")
    add(q, "b0", "B")
    assert admit(q) == ["a0", "b0", "a1", "a2"]


def test_a_sender_that_was_idle_is_served_next() -> None:
    q = QueuePolicy(MAX_LEN)
    for i in range(5):
        add(q, f"a{i}", "A")
    assert admit(q, 2) == ["a0", "a1"]
    add(q, "b0", "B")  # starts at the virtual time, not behind A's queue
    assert admit(q) == ["b0", "a2", "a3", "a4"]


def test_n_samples_count_against_their_sender() -> None:
    q = QueuePolicy(MAX_LEN)
    add(q, "wide", "A", n=3)
    add(q, "b0", "B")
    add(q, "b1", "B")
    # Each sample of "wide" costs as much as a request of B's: B is not held behind all three.
    assert admit(q) == ["wide", "b0", "wide#1", "b1", "wide#2"]


def test_priority_moves_a_request_between_senders() -> None:
    q = QueuePolicy(MAX_LEN)
    add(q, "late", "C", priority=1)
    add(q, "plain", "A")
    add(q, "urgent", "B", priority=-1)
    assert [s.tag for s in q.waiting] == [-PRIORITY_STEP_TOKENS, 0, PRIORITY_STEP_TOKENS]
    assert admit(q) == ["urgent", "plain", "late"]


def test_within_a_sender_a_short_request_passes_a_long_one() -> None:
    q = QueuePolicy(MAX_LEN)
    add(q, "long", "A", max_tokens=1000)
    add(q, "short", "A")
    add(q, "other", "B")
    # The sender keeps its place among senders (first), but its turn goes to the sample that
    # would finish first in its own share: the two swap tags.
    assert admit(q) == ["short", "other", "long"]


def test_a_promoted_sample_keeps_the_queue_sorted_past_an_equal_tag() -> None:
    q = QueuePolicy(MAX_LEN)
    add(q, "long", "A", max_tokens=1000)
    add(q, "other", "B")  # tagged as "long" (both senders were idle), arrived before "short"
    add(q, "short", "A")
    q.promote_within_sender()
    # "short" takes "long"'s tag; the arrival order breaks its tie with "other" (it was put
    # at the head, out of order, and a later promotion's lookup failed its assertion).
    assert [s.request_id for s in q.waiting] == ["other", "short", "long"]
    assert admit(q) == ["other", "short", "long"]


def test_priority_within_a_sender() -> None:
    """Two equal requests of one sender, each costing more than a step of priority across
    senders: the outer tags keep arrival order, the inner finish puts the urgent one first."""
    q = QueuePolicy(MAX_LEN)
    first = add(q, "first", "A", max_tokens=1992)[0]
    urgent = add(q, "urgent", "A", max_tokens=1992, priority=-1)[0]
    assert q.waiting == [first, urgent]  # tags 0 and 2000 - PRIORITY_STEP_TOKENS
    assert urgent.inner_start == -INNER_PRIORITY_STEP
    assert admit(q) == ["urgent", "first"]
    assert (urgent.tag, first.tag) == (0, 2000 - PRIORITY_STEP_TOKENS)  # swapped turns
    # Without the priority, arrival decides.
    q2 = QueuePolicy(MAX_LEN)
    add(q2, "first", "A", max_tokens=1992)
    add(q2, "second", "A", max_tokens=1992)
    assert admit(q2) == ["first", "second"]


def test_serving_moves_the_senders_virtual_time_by_its_share() -> None:
    q = QueuePolicy(MAX_LEN)
    a0, a1 = add(q, "a0", "A")[0], add(q, "a1", "A")[0]
    admit(q)
    step = PlannedStep(0, rows=[PlannedRow(seq=a0, seq_slot=0, token_ids=[1] * 6,
                                           context_len=6, do_sample=False),
                                PlannedRow(seq=a1, seq_slot=1, token_ids=[1] * 2,
                                           context_len=2, do_sample=False)])
    before = q.inner_vtime["A"]
    q.serve(step)
    assert q.inner_vtime["A"] == before + 8 / 2  # 8 tokens over the sender's 2 live samples
    # A request arriving now starts where the sender has got to.
    assert add(q, "a2", "A")[0].inner_start == q.inner_vtime["A"]


def test_the_waiting_cap_counts_held_samples_and_n() -> None:
    q = QueuePolicy(MAX_LEN, max_waiting=4)
    add(q, "a", "A", n=1)
    add(q, "b", "A", n=1)
    assert q.overload(num_held=1, n=1) is None  # 2 queued + 1 held + 1 = 4
    message = q.overload(num_held=1, n=2)
    assert message is not None and "3 sequences waiting, at most 4" in message
    assert QueuePolicy(MAX_LEN).overload(num_held=10_000, n=128) is None  # no cap


def test_a_sender_over_its_share_of_slots_gives_one_up() -> None:
    q = QueuePolicy(MAX_LEN)
    hog = [s for i in range(4) for s in add(q, f"h{i}", "H", status=SeqStatus.RUNNING)]
    waiting = add(q, "w", "W")[0]
    victim = q.share_slots(hog, max_num_seqs=4)
    assert victim is hog[-1]  # the hog's last, of its 4 slots over a share of 2
    assert victim.tag > waiting.tag  # re-tagged behind the one it makes room for
    # At its share, a sender keeps its slots.
    assert q.share_slots(hog[:2], max_num_seqs=4) is None


def test_within_a_sender_a_slot_goes_to_a_sample_that_finishes_sooner() -> None:
    q = QueuePolicy(MAX_LEN)
    long = add(q, "long", "A", max_tokens=1000, status=SeqStatus.RUNNING)[0]
    other = add(q, "other", "B", status=SeqStatus.RUNNING)[0]
    add(q, "short", "A")
    # A holds its share (1 of 2 slots): its own long sample makes room for its short one.
    assert q.share_slots([long, other], max_num_seqs=2) is long
    # Equal requests never preempt one another.
    q2 = QueuePolicy(MAX_LEN)
    mine = add(q2, "x", "A", status=SeqStatus.RUNNING)[0]
    theirs = add(q2, "y", "B", status=SeqStatus.RUNNING)[0]
    add(q2, "z", "A")
    assert q2.share_slots([mine, theirs], max_num_seqs=2) is None


def test_idle_senders_are_forgotten_past_max_senders() -> None:
    q = QueuePolicy(MAX_LEN)
    for i in range(MAX_SENDERS):
        add(q, f"r{i}", f"s{i}")
    for seq in admit(q):  # every one of them admitted, finished and released
        q.release_sample(f"s{seq[1:]}")
    assert not q.sender_samples and len(q.sender_end) == MAX_SENDERS
    add(q, "live", "busy")
    assert list(q.sender_end) == ["busy"]  # only the sender with work is kept
    assert q.sender_samples == {"busy": 1}
