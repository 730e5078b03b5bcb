"""What the device holds for each running sample, in the scheduler process: its executor slot
and its KV blocks (over block_allocator.py) in each group of layers, the prefix cache at
admission, the room a step may grow into (preempting a running sample if need be), the room
drafts may take, and, in a group of layers with a sliding window, the blocks given back as
they fall out of it."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from ipc.sampling import uses_penalties
from stages.scheduler.block_allocator import BlockAllocator, BlockKey
from stages.scheduler.planned import PlannedStep
from stages.scheduler.queue_policy import victim_key
from stages.scheduler.sequence import NO_BLOCK, Pages, SeqStatus, Sequence

Preempt = Callable[[Sequence], None]  # makes a running sample a victim (Scheduler._preempt)


class KVGroup:
    """The blocks of one group of layers (EngineLimits.kv_windows): their window (None: a
    query reads every key before it), the first of their rows in the executor's block table
    (whose row for a slot is `rows + slot`), and their prefix-cache keys (a block's key
    salted with the group's index: each group caches its own blocks of a prefix).

    A query at position p of a layer with window w reads keys p - w + 1 .. p only, so in a
    windowed group a running sequence holds about w / block_size blocks however long it
    grows (KVManager.trim)."""

    def __init__(self, index: int, block_size: int, window: int | None, rows: int) -> None:
        self.index, self.block_size, self.window, self.rows = index, block_size, window, rows
        self._salt = b"" if index == 0 else index.to_bytes(2, "little")

    def key(self, key: BlockKey) -> BlockKey:
        """`key` as this group's blocks are cached under it."""
        return key + self._salt if self._salt else key

    def first_read_page(self, position: int) -> int:
        """The first page that a query at `position`, or at any later one, reads, counted
        from the start of position's page: flex's block masks take a query block's queries
        from its page's start, and read that page's table entry for every key page they
        may see (a page given back would leave a stale entry there)."""
        if self.window is None:
            return 0
        return max(0, position - position % self.block_size - self.window + 1) // self.block_size

    def pages_to_run(self, num_tokens: int) -> int:
        """The blocks a sequence of num_tokens tokens must be able to hold at once in this
        group to be computed: all its pages, or with a window at most those one token's
        window spans and its own page (the sequence computed in chunks that fit:
        KVManager.chunk_end)."""
        num_pages = -(-num_tokens // self.block_size)
        if self.window is None:
            return num_pages
        return min(num_pages, (self.window - 2) // self.block_size + 2)


def blocks_to_run(windows: Seq[int | None], block_size: int, num_tokens: int) -> int:
    """The blocks a sequence of num_tokens tokens must be able to hold at once, every KV group
    of `windows` (EngineLimits.kv_windows) together (KVManager.blocks_to_run, for a check
    made before any scheduler exists)."""
    return sum(KVGroup(i, block_size, w, 0).pages_to_run(num_tokens)
               for i, w in enumerate(windows))


@dataclass(frozen=True)
class PrefixHit:
    """What a sample may reuse of the prefix cache: its first num_blocks pages, whose blocks
    are cached in every group, and the blocks each group takes (a windowed group's: only
    those its window reads from position num_blocks * block_size on)."""

    num_blocks: int = 0
    blocks: tuple[list[int], ...] = ()

    def taken(self, group: int) -> list[int]:
        return self.blocks[group] if self.blocks else []


NO_HIT = PrefixHit()


class KVManager:
    """Invariant: a sample is in `running` exactly while it holds a slot; in each group its
    pages are blocks_for(num_computed) (Sequence.pages, as many in every group), each a block
    of the pool held once by it (shared ones through the prefix cache are reference counted)
    but its first num_trimmed, given back (NO_BLOCK). A step maps at most max_block_updates
    blocks, all groups together.

    windows: each group's window (EngineLimits.kv_windows): (None,) keeps every block of a
    sequence while it runs; (w,) gives back those out of window w (Mistral's, Phi-3's);
    (None, .., w, ..), a model whose windowed layers sit beside layers that read every key
    (Gemma 2/3's local and global ones), keeps every block of the first kind of group and
    gives back the windowed groups'. Every group takes its blocks from the one pool (a block
    id names the same memory in each: the executor's caches are shared by the groups,
    kv_places) with its own table rows (the slots' rows of group i start at
    i * (max_num_seqs + 1): the executor's table has a padding row after each group's), so
    what a group gives back serves any group."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_block_updates: int, windows: Seq[int | None] = (None,)) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.groups = [KVGroup(i, block_size, w, i * (max_num_seqs + 1))
                       for i, w in enumerate(windows)]
        self.windowed = [g for g in self.groups if g.window is not None]
        self.block_size = block_size
        self.max_seq_blocks = 0  # the most blocks one sequence held at once (last group)
        self.max_block_updates = max_block_updates
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.running: list[Sequence] = []
        # Preempted sequences whose blocks are not released yet (one may have finished since,
        # while its in-flight steps drain): while any is, no other victim is taken.
        self.victims: set[Sequence] = set()
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # tokens found

    def blocks_for(self, num_tokens: int) -> int:
        return self.allocator.blocks_for(num_tokens)

    def blocks_to_run(self, num_tokens: int) -> int:
        """The blocks a sequence of num_tokens tokens must be able to hold at once, all
        groups together (computed in chunks that fit: chunk_end)."""
        return sum(g.pages_to_run(num_tokens) for g in self.groups)

    def max_len(self, limit: int) -> int:
        """The longest sequence, up to `limit` tokens, whose blocks fit the pool at once
        (past it, a sequence could only preempt itself)."""
        bs, num_blocks = self.block_size, self.allocator.num_blocks
        if self.blocks_to_run(limit) <= num_blocks:
            return limit
        lo, hi = 0, self.blocks_for(limit)  # pages: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.blocks_to_run(mid * bs) <= num_blocks else (lo, mid)
        return lo * bs

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a sequence's next chunk [start, end), cut where its pages would
        outgrow the pool: every page in each group, but those before the window's first
        in a windowed one."""
        if not self.windowed:
            return end  # (the whole sequence fits: max_len)
        skipped = len(self.windowed) * self.windowed[0].first_read_page(start)
        pages = (self.allocator.num_blocks + skipped) // len(self.groups)
        return min(end, pages * self.block_size)

    def _updates_left(self, step: PlannedStep) -> int:
        return self.max_block_updates - len(step.block_updates)

    # ------------------------------------------------------------ admission

    def cached_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached full blocks that seq may reuse: the most pages n whose blocks every group
        has cached where its queries from position n * block_size on read them (a group
        without a window: pages 0 .. n - 1; a windowed one: those from the window's first
        page, the earlier ones having gone back as the window passed them); at least its
        last token is computed (for its logits). None with penalties (the executor counts a
        sequence's tokens as they are computed) nor with prompt logprobs (every prompt
        position's logits are needed) nor for a mean or cls embedding (every prompt
        position's hidden state is)."""
        if uses_penalties(seq.params) or seq.scores_prompt or seq.pools_every_token:
            return NO_HIT
        bs = self.block_size
        keys = seq.keys_for((seq.num_known - 1) // bs, bs)
        if not self.windowed:  # (one group, no window: the cached run from page 0)
            blocks = self.allocator.lookup(keys)
            return PrefixHit(len(blocks), (blocks,)) if blocks else NO_HIT
        find, window = self.allocator.find, self.windowed[0]  # (the windowed groups' one)
        full = [g for g in self.groups if g.window is None]
        missing = -1  # the last page some windowed group has not cached
        best = 0
        for i, key in enumerate(keys):
            if any(find(g.key(key)) is None for g in full):
                break  # (no longer prefix of those groups is cached)
            if any(find(g.key(key)) is None for g in self.windowed):
                missing = i
            elif missing < window.first_read_page((i + 1) * bs):
                best = i + 1
        if best == 0:
            return NO_HIT
        return PrefixHit(best, tuple(
            [find(g.key(k)) for k in keys[g.first_read_page(best * bs):best]]  # type: ignore[misc]
            for g in self.groups))

    def admits(self, step: PlannedStep, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a sample reusing `hit` can have blocks for num_tokens tokens now in every
        group, free ones and within the step's block updates."""
        new_blocks = (self.blocks_for(num_tokens) - hit.num_blocks) * len(self.groups)
        taken = [b for i in range(len(self.groups)) for b in hit.taken(i)]
        if new_blocks + self.allocator.num_free_among(taken) > self.allocator.num_free:
            return False
        return len(taken) + new_blocks <= self._updates_left(step)

    def admit(self, step: PlannedStep, seq: Sequence, hit: PrefixHit) -> None:
        """seq takes a slot and the cached blocks of `hit`: their tokens count as computed.
        A windowed group's pages before its window are not taken (NO_BLOCK, as if trimmed)."""
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
        seq.pages = [Pages() for _ in self.groups]
        for i, (g, pages) in enumerate(zip(self.groups, seq.pages, strict=True)):
            taken = hit.taken(i)
            skip = hit.num_blocks - len(taken)
            if skip:
                pages.blocks = [NO_BLOCK] * skip
                pages.num_trimmed = pages.num_registered = skip
            for block in taken:
                self.allocator.take(block)
                self.map_block(step, seq, g, pages, block)
        self._note_held(seq)
        num_hit = hit.num_blocks * self.block_size
        seq.num_computed = num_hit
        self.prefix_cache_queries += seq.num_known
        self.prefix_cache_hits += num_hit
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_hit

    # ------------------------------------------------------------ growth

    def grow(self, step: PlannedStep, seq: Sequence, num_tokens: int,
             preempt: Preempt | None) -> bool:
        """Give seq blocks for num_tokens tokens in every group, preempting another sequence
        if need be (not with preempt None: then only free blocks); in a windowed group,
        first give back its pages out of the window (trim)."""
        needed = self.blocks_for(num_tokens) - len(seq.blocks)
        if needed <= 0:
            return True
        if self.windowed:
            self.trim(seq)
        needed_all = needed * len(self.groups)
        if needed_all > self._updates_left(step):
            return False
        blocks = self.allocator.allocate(needed_all)
        while blocks is None:
            if preempt is None or not self._preempt_one(step, seq, preempt):
                return False
            blocks = self.allocator.allocate(needed_all)
        for i, (g, pages) in enumerate(zip(self.groups, seq.pages, strict=True)):
            for block in blocks[i * needed:(i + 1) * needed]:
                self.map_block(step, seq, g, pages, block)
        self._note_held(seq)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back seq's pages wholly before the window of num_computed, in each windowed
        group, as seq is planned.

        No step planned from now on reads them: seq's queries there are at num_computed or
        later (one with drafts in flight, whose rejection lowers num_computed, is not planned
        until they are verified: StepBuilder.fill), each reading `window` keys back. Steps
        in flight may still read them, but they were planned earlier and the executor runs
        steps in order (compute() applies a step's block-table updates, then its forward),
        so a block given back here may be mapped to another sequence in the very step being
        planned: its new owner writes it only after every step that could read it ran. The
        executor's table keeps the page's old entry, a valid block that no backend reads
        (each starts at the window's first page of a query's page start, first_read_page,
        or masks what it gathers before it).

        A block given back loses its prefix-cache key (allocator.free forget): otherwise
        each decoding sequence's passing blocks would queue in the cache's LRU behind the
        prefixes worth keeping and push them out first. A later prompt's lookup needs the
        pages its window reads, so no prefix is found through one, and a block another
        sample or request still holds (the allocator's reference counts) goes back only when
        the last of them gives it up; sample 0 keeps the pages its waiting siblings will
        take (Sequence.trim_floor)."""
        for g in self.windowed:
            pages = seq.pages[g.index]
            first = g.first_read_page(seq.num_computed)
            # Pages its waiting siblings will take are kept, but for a window's worth of
            # pages at most: siblings waiting longer compute their prompt, as any prompt.
            if seq.trim_floor is not None and (first - seq.trim_floor
                                               > g.pages_to_run(seq.num_computed)):
                seq.trim_floor = None
            if seq.trim_floor is not None:
                first = min(first, seq.trim_floor)
            done = pages.num_trimmed
            if first <= done:
                continue
            blocks = pages.blocks
            self.allocator.free(blocks[done:first], forget=True)
            blocks[done:first] = [NO_BLOCK] * (first - done)
            pages.num_trimmed = first
            # (pages not offered to the prefix cache yet never will be: gone)
            pages.num_registered = max(pages.num_registered, first)

    def _note_held(self, seq: Sequence) -> None:
        held = seq.pages[-1].num_held
        if held > self.max_seq_blocks:
            self.max_seq_blocks = held

    def _preempt_one(self, step: PlannedStep, needy: Sequence, preempt: Preempt) -> bool:
        """Preempt the first running sequence by victim_key not in this step (needy itself
        if it is that one). True if blocks were freed now; False if none were (they may be
        on their way)."""
        if self.victims:
            return False  # blocks are on their way back; wait for them
        candidates = [s for s in self.running if s not in step.members
                      and s.num_held_blocks and s.status is SeqStatus.RUNNING]
        if not candidates:
            return False
        victim = max(candidates, key=victim_key)
        step.has_preempted = True  # no admission in this step: the victim would come right back
        preempt(victim)
        return victim not in self.victims and victim is not needy

    def draft_room(self, step: PlannedStep, seq: Sequence, end: int) -> int:
        """Blocks for seq up to token `end` in every group as far as free blocks and the
        step's updates allow (a draft never preempts anything), a windowed group first
        giving back its pages out of the window (trim: its row's blocks may be there
        already, so grow took none); returns the tokens its pages now hold."""
        extra = self.blocks_for(end) - len(seq.blocks)
        if extra > 0:
            if self.windowed:
                self.trim(seq)
            can = max(0, min(extra, self._updates_left(step) // len(self.groups),
                             self.allocator.num_free // len(self.groups)))
            for g, pages in zip(self.groups, seq.pages, strict=True):
                for block in self.allocator.allocate(can) or []:
                    self.map_block(step, seq, g, pages, block)
            self._note_held(seq)
        return len(seq.blocks) * self.block_size

    @staticmethod
    def map_block(step: PlannedStep, seq: Sequence, group: KVGroup, pages: Pages,
                  block: int) -> None:
        """seq's next page in `group` is `block` (its table row: the group's row of seq's
        slot)."""
        step.block_updates.append((group.rows + seq.slot, len(pages.blocks), block))  # type: ignore[operator]
        pages.blocks.append(block)

    # ------------------------------------------------------------ results and release

    def register_blocks(self, seq: Sequence) -> None:
        """Offer seq's full blocks whose tokens are all known to each group's prefix cache.
        Their KV is written by a step already planned, so every step planned from now on can
        read it."""
        bs = self.block_size
        for g, pages in zip(self.groups, seq.pages, strict=True):
            if seq.num_computed < (pages.num_registered + 1) * bs:
                continue  # the common case, checked first: no new full block
            num_full = min(seq.num_computed, seq.num_known, len(pages.blocks) * bs) // bs
            if num_full <= pages.num_registered:
                continue
            keys = seq.keys_for(num_full, bs)
            for i in range(pages.num_registered, num_full):
                self.allocator.register(pages.blocks[i], g.key(keys[i]))
            pages.num_registered = num_full

    def drop_rejected(self, seq: Sequence, num_rejected: int) -> None:
        """Forget the KV of a row's rejected drafts, and give back the blocks only they
        filled: nothing else in flight writes them (the sequence was not planned again). They
        lie past the row's first position, so past every page a window gave back."""
        seq.num_computed -= num_rejected
        # (a draft model's row: the block its last sample lands in too, see DraftPlanner)
        keep = self.blocks_for(seq.num_computed + int(seq.draft_model_kv))
        if len(seq.blocks) > keep and seq.status is not SeqStatus.FINISHED:
            for pages in seq.pages:
                self.allocator.free(pages.blocks[keep:][::-1])
                del pages.blocks[keep:]

    def release(self, seq: Sequence) -> None:
        """seq gives back its blocks (last first: a shared prefix is evicted last) and slot;
        no in-flight step writes them any more."""
        self.victims.discard(seq)
        # Page by page from the last, each group's block of it in turn: a prefix's first
        # pages, which every hit needs, go back last in every group. (One never admitted has
        # one empty group of pages: Sequence's default.)
        self.allocator.free([p.blocks[j] for j in range(len(seq.blocks) - 1, -1, -1)
                             for p in seq.pages if j >= p.num_trimmed])
        seq.pages = [Pages() for _ in self.groups]
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
