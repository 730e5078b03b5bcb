"""A harness for the scheduler core: a fake executor that keeps a paged KV store and checks the
whole context of every sampled row, and a driver that plays the scheduler process and checks
the core's invariants after every move. A sample of a request is named by `sample_key`."""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from ipc.config import EngineLimits
from ipc.messages import RequestRejected, SamplingParams, TokenDelta, TokenizedRequest
from ipc.speculative import SpeculativeConfig
from stages.scheduler.core import Scheduler
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import NO_BLOCK, SeqStatus, Sequence

EOS = 2
STOP = 3
TokenFn = Callable[[str, int], int]


def plain_token(rid: str, index: int) -> int:
    """Output token `index` of request `rid`: never EOS nor STOP."""
    return 1000 + (zlib.crc32(rid.encode()) + 31 * index) % 500


def stops_at(table: dict[str, tuple[int, int]], base: TokenFn = plain_token) -> TokenFn:
    """base (plain_token), except that request rid emits token t at output index i for
    table[rid]."""

    def token(rid: str, index: int) -> int:
        if rid in table and table[rid][0] == index:
            return table[rid][1]
        return base(rid, index)

    return token


def sample_key(request_id: str, index: int) -> str:
    """How the harness names a sample: the request id for sample 0, 'id#i' for the others
    (so the fake executor gives each sample its own tokens)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(frozen=True)
class DriverLimits:
    """The engine's limits plus the cache size the executor would have reported."""

    num_blocks: int = 64
    block_size: int = 4
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32
    max_model_len: int = 64
    eos_token_ids: tuple[int, ...] = (EOS,)
    depth: int = 2
    priority_range: tuple[int, int] = (-100, 100)
    speculative: SpeculativeConfig | None = None  # n-gram drafts, verified by the executor
    window: int | None = None  # every layer's sliding window: blocks out of it go back
    # windowed layers beside layers that read every key (Gemma's): KV groups of each kind
    # (mixed_groups: how many of each), the windowed ones' blocks going back
    mixed_window: int | None = None
    mixed_groups: tuple[int, int] = (1, 1)
    pipeline_stages: int = 1  # P: up to P * depth steps in flight

    @property
    def windows(self) -> tuple[int | None, ...]:
        if self.mixed_window is None:
            return (self.window,)
        full, windowed = self.mixed_groups
        return (None,) * full + (self.mixed_window,) * windowed

    @property
    def max_inflight(self) -> int:
        return self.pipeline_stages * self.depth

    @property
    def engine(self) -> EngineLimits:
        return EngineLimits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size,
                            self.max_model_len, 1000, self.eos_token_ids, self.depth,
                            self.priority_range,
                            self.speculative.num_tokens if self.speculative else 0,
                            kv_windows=self.windows,
                            pipeline_stages=self.pipeline_stages)


def make_limits(**overrides: object) -> DriverLimits:
    return dataclasses.replace(DriverLimits(), **overrides)  # type: ignore[arg-type]


def prompt_of(rid: str, length: int) -> list[int]:
    seed = zlib.crc32(rid.encode())
    return [10 + (seed + 7 * i) % 90 for i in range(length)]


def make_request(rid: str, prompt_len: int, **params: object) -> TokenizedRequest:
    return TokenizedRequest(rid, "client", prompt_of(rid, prompt_len),
                            SamplingParams(**params), 0.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- fake executor


@dataclass(frozen=True)
class Row:
    """A step row as the executor sees it: copied when planned, like the step-input ring."""

    request_id: str
    prompt: tuple[int, ...]
    slot: int
    token_ids: tuple[int, ...]
    context_len: int
    do_sample: bool
    num_draft: int = 0


@dataclass(frozen=True)
class Step:
    step_id: int
    rows: tuple[Row, ...]
    block_updates: tuple[tuple[int, int, int], ...]
    new_slots: tuple[int, ...]
    # blocks a sliding window gave back while this step was planned, held by nobody else
    # now: the executor overwrites them before the step runs, as their next owner may
    poisoned: tuple[int, ...] = ()


def freeze(step: PlannedStep, poisoned: tuple[int, ...] = ()) -> Step:
    rows = tuple(Row(sample_key(r.seq.request_id, r.seq.index), tuple(r.seq.prompt_ids),
                     r.seq.slot, tuple(r.token_ids), r.context_len, r.do_sample,  # type: ignore[arg-type]
                     r.num_draft)
                 for r in step.rows)
    return Step(step.step_id, rows, tuple(step.block_updates),
                tuple(slot for slot, _ in step.new_slots), poisoned)


POISON = -7  # what a block given back holds once the step that gave it back runs


class FakeExecutor:
    """Writes each row's tokens into paged KV through each KV group's block table (a block id
    naming the same memory in every group: a block two groups held at once would show the
    other's tokens), resolves -1 to the slot's last sample, and checks the whole context
    read back through every group's table before it samples (with a sliding window, what
    the row's queries read: from its first one's window on; a page given back and written
    by another sequence shows its tokens). A row with drafts is sampled after each of its
    last num_draft + 1 tokens and keeps its drafts up to the first that differs from the
    token sampled before it, as the real one does."""

    def __init__(self, block_size: int, token_fn: TokenFn,
                 windows: tuple[int | None, ...] = (None,), max_num_seqs: int = 4) -> None:
        self.block_size, self.token_fn, self.windows = block_size, token_fn, windows
        self.rows = max_num_seqs + 1  # table rows of a group (a padding row past the slots')
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token
        self.tables: dict[int, dict[int, int]] = {}  # table row -> index -> block
        self.last: dict[int, int] = {}  # slot -> last sampled token
        self.owner: dict[int, str] = {}  # slot -> request id, set when a sequence takes it

    def execute(self, step: Step) -> tuple[list[int], list[int]]:
        """(sampled ids, one per sampled position; positions that stand per drafted row)"""
        for block in step.poisoned:
            for offset in range(self.block_size):
                self.kv[block, offset] = POISON
        for slot in step.new_slots:
            self.last.pop(slot, None)
            self.owner[slot] = ""
        for row, index, block in step.block_updates:
            self.tables.setdefault(row, {})[index] = block
        ids, accepted = [], []
        for row in step.rows:
            tokens, stand = self._run(row)
            ids += tokens
            if row.num_draft:
                accepted.append(stand)
        return ids, accepted

    def _where(self, group: int, slot: int, pos: int) -> tuple[int, int]:
        table = self.tables[group * self.rows + slot]
        return table[pos // self.block_size], pos % self.block_size

    def _run(self, row: Row) -> tuple[list[int], int]:
        assert self.owner.get(row.slot) in ("", row.request_id), "slot used before it was taken"
        self.owner[row.slot] = row.request_id
        start = row.context_len - len(row.token_ids)
        for i, tok in enumerate(row.token_ids):
            for group in range(len(self.windows)):
                self.kv[self._where(group, row.slot, start + i)] = (
                    self.last[row.slot] if tok == -1 else tok)
        if not row.do_sample:
            return [], 0
        first = row.context_len - row.num_draft  # the context of the first sampled position
        num_out = first - len(row.prompt)
        tokens = [self.token_fn(row.request_id, num_out + j) for j in range(row.num_draft + 1)]
        drafts = row.token_ids[len(row.token_ids) - row.num_draft:]
        stand = 1
        while stand <= row.num_draft and drafts[stand - 1] == tokens[stand - 1]:
            stand += 1
        # what the last standing sample saw: the prompt and the outputs before it
        seen = first + stand - 1
        want = [*row.prompt, *(self.token_fn(row.request_id, j)
                               for j in range(seen - len(row.prompt)))]
        for group, window in enumerate(self.windows):
            lo = 0 if window is None else max(0, start - window + 1)
            context = [self.kv[self._where(group, row.slot, p)] for p in range(lo, seen)]
            assert context == want[lo:], f"group {group}"
        self.last[row.slot] = tokens[stand - 1]
        return tokens, stand


# ---------------------------------------------------------------- driver


class Driver:
    """Plays the scheduler process: plans up to `max_inflight` steps ahead, reports the oldest
    step, collects outputs, and checks the core's invariants after every move."""

    def __init__(self, limits: DriverLimits, token_fn: TokenFn = plain_token) -> None:
        self.limits = limits
        self.core = Scheduler(limits.engine, limits.num_blocks,
                              speculative=limits.speculative)
        self.executor = FakeExecutor(limits.block_size, token_fn, limits.windows,
                                     limits.max_num_seqs)
        self.pending: deque[Step] = deque()
        self.history: list[Step] = []
        self.known: Counter[str] = Counter()  # output tokens reported to the core, per request
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, TokenDelta] = {}
        self.rejected: list[RequestRejected] = []
        self.seqs: dict[str, Sequence | None] = {}

    def add(self, req: TokenizedRequest) -> None:
        self.core.add_request(req)
        self.seqs.setdefault(req.request_id, (self.core.requests.get(req.request_id) or [None])[0])
        self.check()

    def abort(self, rid: str) -> None:
        self.core.abort(rid)
        self.check()

    def plan(self) -> list[Step]:
        planned = []
        while True:
            before = {seq: [list(p.blocks) for p in seq.pages] for seq in self.core.running}
            step = self.core.schedule()
            if step is None:
                break
            assert len(self.core.inflight) <= self.limits.max_inflight
            self.check_placeholders(step)
            planned.append(freeze(step, self.given_back(before, step)))
            self.check()
        self.pending.extend(planned)
        self.history.extend(planned)
        return planned

    def report(self) -> bool:
        if not self.pending:
            return False
        step = self.pending.popleft()
        ids, accepted = self.executor.execute(step)
        stands = iter(accepted)
        for row in (r for r in step.rows if r.do_sample):
            stand = next(stands) if row.num_draft else 1
            self.known[row.request_id] = (row.context_len - row.num_draft - len(row.prompt)
                                          + stand)
        self.core.on_sampled(step.step_id, ids, accepted=accepted or None)
        self.check()
        return True

    def collect(self) -> list[TokenDelta]:
        _, deltas, rejected, _ = self.core.take_outputs()
        for r in rejected:  # answered at once, with no state anywhere
            assert r.request_id not in self.core.requests or r.finish_reason == "error"
            self.rejected.append(r)
            if r.request_id not in self.core.requests:
                self.finished[r.request_id] = TokenDelta(r.request_id, [], r.finish_reason,
                                                         r.error)
        for d in deltas:
            key = sample_key(d.request_id, d.index)
            assert key not in self.finished, f"delta after the end: {d}"
            self.outputs.setdefault(key, []).extend(d.token_ids)
            if d.finish_reason is not None:
                self.finished[key] = d
        return deltas

    def tick(self) -> None:
        self.plan()
        self.report()
        self.collect()

    def run(self, arrivals: dict[int, list[TokenizedRequest]] | None = None,
            aborts: dict[int, list[str]] | None = None, max_ticks: int = 5000) -> None:
        arrivals, aborts = arrivals or {}, aborts or {}
        last = max([*arrivals, *aborts], default=0)
        tick = 0
        while tick <= last or self.core.requests or self.pending:
            assert tick < max_ticks, "the scheduler stopped making progress"
            for req in arrivals.get(tick, []):
                self.add(req)
            for rid in aborts.get(tick, []):
                self.abort(rid)
            self.tick()
            tick += 1
        self.collect()

    def given_back(self, before: dict[Sequence, list[list[int]]], step: PlannedStep
                   ) -> tuple[int, ...]:
        """The blocks of the pages a window gave back while `step` was planned (from each
        running sequence's blocks `before`, a list per KV group) that nobody else holds, or
        that step maps anew: any step from it on that reads one reads POISON."""
        mapped = {block for _, _, block in step.block_updates}
        gone = {old[g][j] for seq, old in before.items() for g in range(len(old))
                for j in range(min(len(old[g]), seq.pages[g].num_trimmed))
                if old[g][j] != NO_BLOCK and seq.pages[g].blocks[j] == NO_BLOCK}
        return tuple(sorted(b for b in gone
                            if b in mapped or self.core.allocator.ref_count(b) == 0))

    # ------------------------------------------------------------ checks

    def check_placeholders(self, step: PlannedStep) -> None:
        assert step.num_tokens <= self.limits.max_num_batched_tokens
        for row in step.rows:
            seq = row.seq
            start = row.context_len - len(row.token_ids)
            known = row.token_ids[:len(row.token_ids) - row.num_draft]
            assert all(t >= 0 for t in row.token_ids[len(known):]), "a draft must be an id"
            for i, tok in enumerate(known):
                pos = start + i
                key = sample_key(seq.request_id, seq.index)
                is_pending = pos >= len(seq.prompt_ids) + self.known[key]
                assert (tok == -1) == is_pending, (seq.request_id, pos, tok)
                if tok != -1:
                    num_out = pos - len(seq.prompt_ids)
                    want = seq.prompt_ids[pos] if num_out < 0 else seq.output_ids[num_out]
                    assert tok == want
            assert -1 not in known[:-1]

    def check(self) -> None:
        core, limits = self.core, self.limits
        groups = core.kv.groups
        held: list[int] = []
        all_seqs = [s for seqs in core.requests.values() for s in seqs]
        for seq in all_seqs:
            assert len(seq.pages) in (1, len(groups))  # (made per group at admission)
            for pages, window in zip(seq.pages, limits.windows, strict=False):
                assert pages.blocks[:pages.num_trimmed] == [NO_BLOCK] * pages.num_trimmed
                live = pages.blocks[pages.num_trimmed:]
                held.extend(live)
                assert len(live) == len(set(live)) and NO_BLOCK not in live
                assert len(pages.blocks) == len(seq.blocks)  # (as many pages in each)
                # Given back: only pages no query from the lowest position it may compute
                # next reads (drafts in flight may all be rejected).
                if window is not None:
                    rollback = (limits.speculative.num_tokens
                                if seq.num_drafted_inflight and limits.speculative else 0)
                    lowest = seq.num_computed - rollback
                    assert pages.num_trimmed <= (max(0, lowest - window + 1)
                                                 // limits.block_size)
                else:
                    assert pages.num_trimmed == 0
            if seq.status in (SeqStatus.WAITING, SeqStatus.HELD):
                assert not seq.blocks and seq.slot is None and seq.num_computed == 0
                assert seq.num_inflight == 0
                if seq.status is SeqStatus.WAITING:
                    assert seq in core.waiting
                else:
                    assert seq in core.book.held.get(seq.request_id, [])
            elif seq.status in (SeqStatus.RUNNING, SeqStatus.PREEMPTING):
                assert len(seq.blocks) == -(-seq.num_computed // limits.block_size)
                assert seq.slot is not None and seq in core.running
            else:
                assert seq.num_inflight > 0, "a finished sequence must be gone once idle"
        refs = Counter(held)  # a block shared through the prefix cache is held more than once
        assert all(core.allocator.ref_count(b) == n for b, n in refs.items())
        assert core.allocator.num_free + len(refs) == limits.num_blocks
        slots = [s.slot for s in all_seqs if s.slot is not None]
        assert sorted(slots + core.free_slots) == list(range(limits.max_num_seqs))
        counts = Counter(id(s) for step in core.inflight for s in step.members)
        assert all(s.num_inflight == counts[id(s)] for s in all_seqs)

    def check_idle(self) -> None:
        core = self.core
        assert core.allocator.num_free == self.limits.num_blocks
        assert sorted(core.free_slots) == list(range(self.limits.max_num_seqs))
        assert not core.inflight and not core.requests and not self.pending
        assert not core.waiting and not core.running
        assert not core.queue.sender_samples  # (the fair queueing's count of live samples)
        assert sorted(core.free_ring_slots) == list(range(self.limits.max_inflight + 1))


def expected_tokens(rid: str, count: int, token_fn: TokenFn = plain_token) -> list[int]:
    return [token_fn(rid, j) for j in range(count)]


def run_all(limits: DriverLimits, arrivals: dict[int, list[TokenizedRequest]],
            token_fn: TokenFn = plain_token, driver_type: type[Driver] | None = None) -> Driver:
    driver = (driver_type or Driver)(limits, token_fn)
    driver.run(arrivals)
    driver.check_idle()
    return driver


def results(driver: Driver) -> dict[str, tuple[list[int], str | None]]:
    return {rid: (driver.outputs.get(rid, []), d.finish_reason)
            for rid, d in driver.finished.items()}


