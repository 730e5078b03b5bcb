"""The step builder alone (stages/scheduler/step_builder.py), over a real queue policy and KV
manager but no Scheduler: the rows of one step (decodes first, then prompt chunks, then
admissions in the queue's order, within the token budget), the slots it hands out, the prompt
positions whose logprobs a step computes, and drafts' room."""

from __future__ import annotations

from ipc.config import EngineLimits
from ipc.messages import SamplingParams
from ipc.speculative import SpeculativeConfig
from stages.scheduler.drafts import DraftCounts, DraftPlanner
from stages.scheduler.kv_manager import KVManager
from stages.scheduler.planned import PlannedStep
from stages.scheduler.queue_policy import QueuePolicy
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.step_builder import StepBuilder

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                      max_model_len=64, vocab_size=1000, eos_token_ids=(2,), depth=2)


def make_builder(num_blocks: int = 32) -> StepBuilder:
    def preempt(seq: Sequence) -> None:
        raise AssertionError(f"{seq.request_id} preempted")

    return StepBuilder(LIMITS, 64, QueuePolicy(64),
                       KVManager(num_blocks, LIMITS.block_size, LIMITS.max_num_seqs,
                                 LIMITS.max_block_updates), None, preempt)


def add(b: StepBuilder, rid: str, prompt: int, sender: str | None = None,
        **params: object) -> Sequence:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    sender = sender or rid
    tags = b.queue.tag_request(p, prompt, sender)
    seq = Sequence(rid, [10 + i for i in range(prompt)], p, 0.0, order=tags.order,
                   tag=tags.start, sender=sender, inner_start=tags.inner,
                   inner_finish=tags.inner + tags.cost)
    b.queue.enqueue(seq)
    return seq


def plan(b: StepBuilder, step_id: int = 0) -> PlannedStep:
    step = PlannedStep(step_id)
    b.fill(step)
    return step


def rows(step: PlannedStep) -> list[tuple[str, int, int, bool]]:
    return [(r.seq.request_id, len(r.token_ids), r.context_len, r.do_sample) for r in step.rows]


def test_prompts_are_admitted_in_order_and_chunked_to_the_budget() -> None:
    b = make_builder()
    a, c = add(b, "a", 12), add(b, "c", 12)
    step = plan(b)
    assert rows(step) == [("a", 12, 12, True), ("c", 4, 4, False)]
    assert step.num_tokens == 16 and [s for s, _ in step.new_slots] == [a.slot, c.slot]
    assert a.status is c.status is SeqStatus.RUNNING and not b.queue.waiting
    assert a.num_pending == 1 and c.num_pending == 0
    # Next step: a's decode first (its token is still being sampled: a placeholder), then
    # the rest of c's prompt.
    step = plan(b, 1)
    assert rows(step) == [("a", 1, 13, True), ("c", 8, 12, True)]
    assert step.rows[0].token_ids == [-1] and not step.new_slots


def test_admission_stops_at_the_first_that_does_not_fit() -> None:
    b = make_builder(num_blocks=2)
    add(b, "big", 12)
    add(b, "small", 4)
    step = plan(b)
    assert not step.rows  # big needs 3 blocks; small does not overtake it
    assert [s.request_id for s in b.queue.waiting] == ["big", "small"]


def test_admission_stops_when_the_slots_run_out() -> None:
    b = make_builder()
    for i in range(6):
        add(b, f"r{i}", 2)
    step = plan(b)
    assert [r.seq.request_id for r in step.rows] == ["r0", "r1", "r2", "r3"]
    assert len(b.queue.waiting) == 2 and not b.kv.free_slots


def test_a_sample_at_its_length_limit_is_not_planned_again() -> None:
    b = make_builder()
    seq = add(b, "a", 4, max_tokens=1)
    plan(b)
    assert seq.num_pending == 1 and not b.wants_step(seq)  # its one token is in flight
    assert not plan(b, 1).rows


def test_prompt_logprob_positions_follow_the_chunks() -> None:
    b = make_builder()
    add(b, "x", 10)
    seq = add(b, "p", 12, prompt_logprobs=1)
    step = plan(b)  # x's 10 tokens, then 6 of p's
    prompt = seq.prompt_ids
    assert step.prompt_logprobs == [(10 + i, prompt[i + 1]) for i in range(6)]
    assert step.plp_owners == [(seq, 6)]
    step = plan(b, 1)  # x decodes (1 token), then p's positions 6..10 score tokens 7..11
    assert step.prompt_logprobs == [(1 + i, prompt[7 + i]) for i in range(5)]
    assert step.plp_owners == [(seq, 5)] and seq.num_plp_planned == 11


def test_draft_room_stops_at_max_tokens_and_the_context() -> None:
    planner = DraftPlanner(SpeculativeConfig("ngram", 3), max_len=64, max_num_seqs=4,
                           counts=DraftCounts(accepted_per_pos=[0] * 3))
    seq = Sequence("a", [1] * 10, SamplingParams(max_tokens=6), 0.0)
    seq.output_ids = [1, 1]
    assert planner.room(seq) == 6 - 2 - 1  # each row samples one more token itself
    # A row of 1 draft that all stands leaves 4 outputs: room for 1 more draft; of 2, none.
    assert not planner.is_last(seq, 1) and planner.is_last(seq, 2)
    long = Sequence("b", [1] * 60, SamplingParams(), 0.0)
    assert planner.room(long) == 64 - 60 - 1
    planner.count_accepted(seq, 2)
    assert planner.counts.num_accepted_tokens == 2
    assert planner.counts.accepted_per_pos == [1, 1, 0]
