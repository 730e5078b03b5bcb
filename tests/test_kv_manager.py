"""The KV manager alone (stages/scheduler/kv_manager.py) with small, fake block counts: slots
and blocks taken and given back, a step's block updates, the prefix cache at admission, the
room a step grows into (preempting by priority and order, one victim at a time), and the room
drafts may take without preempting anything."""

from __future__ import annotations

from ipc.messages import SamplingParams
from stages.scheduler.kv_manager import NO_HIT, KVManager
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import SeqStatus, Sequence

BS = 4  # tokens a block


def make_kv(num_blocks: int = 8, max_num_seqs: int = 4, max_updates: int = 64) -> KVManager:
    return KVManager(num_blocks, BS, max_num_seqs, max_updates)


def make_seq(rid: str, prompt: list[int] | int, order: int = 0, **params: object) -> Sequence:
    ids = prompt if isinstance(prompt, list) else [10 + i for i in range(prompt)]
    return Sequence(rid, ids, SamplingParams(**params), 0.0,  # type: ignore[arg-type]
                    order=order, tag=order)


def run(kv: KVManager, step: PlannedStep, seq: Sequence, num_tokens: int) -> None:
    """seq is admitted with no cache hits and computes num_tokens tokens in step."""
    seq.move_to(SeqStatus.RUNNING)
    kv.admit(step, seq, NO_HIT)
    assert kv.grow(step, seq, num_tokens, never)
    seq.num_computed = num_tokens


def never(seq: Sequence) -> None:
    raise AssertionError(f"{seq.request_id} preempted")


class Preempter:
    """Scheduler._preempt as the KV manager sees it: the victim's blocks come back at once
    (no step in flight), unless `drain` keeps them until release_all."""

    def __init__(self, kv: KVManager, drain: bool = False) -> None:
        self.kv, self.drain, self.victims = kv, drain, []

    def __call__(self, seq: Sequence) -> None:
        seq.move_to(SeqStatus.PREEMPTING)
        self.kv.victims.add(seq)
        self.victims.append(seq.request_id)
        if not self.drain:
            self.kv.release(seq)


def test_blocks_and_slot_are_taken_mapped_and_given_back() -> None:
    kv = make_kv()
    step = PlannedStep(0)
    seq = make_seq("a", 10)
    run(kv, step, seq, 10)
    assert seq.slot == 0 and kv.running == [seq] and len(seq.blocks) == 3
    assert step.block_updates == [(0, i, b) for i, b in enumerate(seq.blocks)]
    assert kv.allocator.num_free == 5 and kv.free_slots == [3, 2, 1]
    assert kv.grow(step, seq, 12, never) and len(seq.blocks) == 3  # (the third has room)
    kv.release(seq)
    assert kv.allocator.num_free == 8 and sorted(kv.free_slots) == [0, 1, 2, 3]
    assert seq.slot is None and not seq.blocks and not kv.running


def test_a_step_maps_at_most_max_block_updates() -> None:
    kv = make_kv(max_updates=2)
    step = PlannedStep(0)
    seq = make_seq("a", 12)
    seq.move_to(SeqStatus.RUNNING)
    kv.admit(step, seq, NO_HIT)
    assert not kv.grow(step, seq, 12, never)  # 3 blocks: over the step's 2 updates
    assert not seq.blocks and kv.allocator.num_free == 8  # and nothing taken
    assert kv.grow(step, seq, 8, never) and len(step.block_updates) == 2


def test_admission_counts_free_blocks_and_cached_ones_it_would_revive() -> None:
    kv = make_kv(num_blocks=4)
    step = PlannedStep(0)
    assert kv.admits(step, NO_HIT, 16) and not kv.admits(step, NO_HIT, 17)
    hog = make_seq("hog", 8)
    run(kv, step, hog, 8)
    assert kv.admits(step, NO_HIT, 8) and not kv.admits(step, NO_HIT, 9)


def test_a_prompt_reuses_the_cached_full_blocks_of_the_same_prefix() -> None:
    kv = make_kv()
    step = PlannedStep(0)
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    first = make_seq("first", prompt)
    run(kv, step, first, 10)
    kv.register_blocks(first)
    assert first.num_registered == 2
    again = make_seq("again", prompt + [7])
    hit = kv.cached_prefix(again)
    hits = hit.taken(0)
    assert hit.num_blocks == 2 and hits == first.blocks[:2]
    again.move_to(SeqStatus.RUNNING)
    kv.admit(step, again, hit)
    assert again.num_computed == 8 and again.num_cached_tokens == 8
    assert [kv.allocator.ref_count(b) for b in hits] == [2, 2]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)  # both looked up
    # The last token is always computed (its logits are needed): the same prompt finds one.
    assert kv.cached_prefix(make_seq("same", prompt)).taken(0) == first.blocks[:2]
    assert kv.cached_prefix(make_seq("eight", prompt[:8])).taken(0) == first.blocks[:1]
    # Penalties and prompt logprobs need every position computed.
    assert kv.cached_prefix(make_seq("p", prompt + [7], repetition_penalty=1.2)) == NO_HIT
    assert kv.cached_prefix(make_seq("l", prompt + [7], prompt_logprobs=1)) == NO_HIT


def test_growth_preempts_the_lowest_priority_then_the_latest() -> None:
    kv = make_kv(num_blocks=6)
    step = PlannedStep(0)
    urgent = make_seq("urgent", 8, order=2, priority=-1)
    early = make_seq("early", 8, order=0)
    late = make_seq("late", 8, order=1)
    for seq in (urgent, early, late):
        run(kv, step, seq, 8)
    preempt = Preempter(kv)
    needy = PlannedStep(1)
    needy.members.add(urgent)
    assert kv.grow(needy, urgent, 16, preempt)
    assert preempt.victims == ["late"] and needy.has_preempted
    assert late.status is SeqStatus.PREEMPTING and not late.blocks
    assert kv.grow(needy, urgent, 24, preempt)
    assert preempt.victims == ["late", "early"]


def two_running(num_blocks: int = 4) -> tuple[KVManager, PlannedStep, Sequence, Sequence]:
    """a, then b, each with 8 tokens in blocks of the step that planned them."""
    kv = make_kv(num_blocks=num_blocks)
    step = PlannedStep(0)
    a, b = make_seq("a", 8, order=0), make_seq("b", 8, order=1)
    run(kv, step, a, 8)
    run(kv, step, b, 8)
    return kv, step, a, b


def test_one_victim_at_a_time_while_its_blocks_drain() -> None:
    kv, _, a, b = two_running()
    preempt = Preempter(kv, drain=True)
    needy = PlannedStep(1)
    assert not kv.grow(needy, a, 12, preempt)  # b preempted; its blocks are not back yet
    assert preempt.victims == ["b"]
    assert not kv.grow(needy, a, 12, preempt)  # and nobody else goes meanwhile
    assert preempt.victims == ["b"]
    kv.release(b)
    assert not kv.victims and kv.grow(needy, a, 12, preempt)


def test_samples_in_the_step_are_not_victims() -> None:
    kv, step, a, b = two_running()
    step.members.update((a, b))
    assert not kv.grow(step, a, 12, never)


def test_a_sample_may_preempt_itself_and_then_waits() -> None:
    kv = make_kv(num_blocks=2)
    step = PlannedStep(0)
    a = make_seq("a", 8)
    run(kv, step, a, 8)
    preempt = Preempter(kv)
    assert not kv.grow(PlannedStep(1), a, 12, preempt)  # the latest is itself
    assert preempt.victims == ["a"] and kv.allocator.num_free == 2


def test_drafts_take_only_free_blocks() -> None:
    kv = make_kv(num_blocks=3)
    step = PlannedStep(0)
    seq = make_seq("a", 6)
    run(kv, step, seq, 6)  # 2 blocks, room for 8 tokens
    assert kv.draft_room(step, seq, 7) == 8 and len(seq.blocks) == 2
    assert kv.draft_room(step, seq, 20) == 12  # one more block was free, no more
    assert kv.allocator.num_free == 0


def test_rejected_drafts_give_back_the_blocks_only_they_filled() -> None:
    kv = make_kv()
    step = PlannedStep(0)
    seq = make_seq("a", 7)
    run(kv, step, seq, 7)
    assert kv.draft_room(step, seq, 11) == 12
    seq.num_computed = 11  # 1 token and 3 drafts planned
    kv.drop_rejected(seq, 3)
    assert seq.num_computed == 8 and len(seq.blocks) == 2 and kv.allocator.num_free == 6
    seq.draft_model_kv = True  # a draft model's row keeps the block its last sample lands in
    assert kv.draft_room(step, seq, 12) == 12
    seq.num_computed = 11
    kv.drop_rejected(seq, 3)
    assert len(seq.blocks) == 3
