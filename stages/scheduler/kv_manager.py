"""What the device holds for each running sample, in the scheduler process: its executor slot
and its KV blocks (over block_allocator.py), the prefix cache at admission, the room a step
may grow into (preempting a running sample if need be), the room drafts may take, and, with a
sliding window on every layer, the blocks given back as they fall out of it."""

from __future__ import annotations

from collections.abc import Callable

from ipc.sampling import uses_penalties
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.planned import PlannedStep
from stages.scheduler.queue_policy import victim_key
from stages.scheduler.sequence import NO_BLOCK, SeqStatus, Sequence

Preempt = Callable[[Sequence], None]  # makes a running sample a victim (Scheduler._preempt)


class KVManager:
    """Invariant: a sample is in `running` exactly while it holds a slot; its pages are
    blocks_for(num_computed), each a block of the allocator's held once by it (shared ones
    through the prefix cache are reference counted) but its first num_trimmed, given back
    (NO_BLOCK). A step maps at most max_block_updates blocks.

    window: the sliding window every layer of the model has (EngineLimits.uniform_window). A
    query at position p reads keys p - window + 1 .. p only, so a running sequence holds
    about window / block_size blocks however long it grows (trim), and one longer than the
    cache runs while its window fits (blocks_to_run, chunk_end). None (no window, or layers
    with different ones, as Gemma 2/3's local and global layers: a global layer reads every
    key) keeps every block of a sequence while it runs."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_block_updates: int, window: int | None = None) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.window = window
        self.max_seq_blocks = 0  # the most blocks one sequence held at once
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

    def first_read_page(self, position: int) -> int:
        """The first page that a query at `position`, or at any later one, reads."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def blocks_to_run(self, num_tokens: int) -> int:
        """The blocks a sequence of num_tokens tokens must be able to hold at once to be
        computed: all its pages, or with a window at most those one token's window spans
        and its own page (the sequence computed in chunks that fit: chunk_end)."""
        num_pages = self.blocks_for(num_tokens)
        if self.window is None:
            return num_pages
        return min(num_pages, (self.window - 2) // self.block_size + 2)

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a sequence's next chunk [start, end), cut where its pages from the
        first its window reads would outgrow the whole cache (only with a window: without,
        the whole sequence fits, Scheduler.max_len)."""
        if self.window is None:
            return end
        return min(end, (self.first_read_page(start) + self.allocator.num_blocks)
                   * self.block_size)

    def _updates_left(self, step: PlannedStep) -> int:
        return self.max_block_updates - len(step.block_updates)

    # ------------------------------------------------------------ admission

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached full blocks that seq may reuse; at least its last token is computed (for
        its logits). None with penalties (the executor counts a sequence's tokens as they
        are computed) nor with prompt logprobs (every prompt position's logits are needed)
        nor for a mean or cls embedding (every prompt position's hidden state is)."""
        if uses_penalties(seq.params) or seq.scores_prompt or seq.pools_every_token:
            return []
        bs = self.block_size
        return self.allocator.lookup(seq.keys_for((seq.num_known - 1) // bs, bs))

    def admits(self, step: PlannedStep, hits: list[int], num_tokens: int) -> bool:
        """Whether a sample reusing `hits` can have blocks for num_tokens tokens now, free
        ones and within the step's block updates (of the hits, those its window reads)."""
        taken = hits[self.first_read_page(len(hits) * self.block_size):]
        new_blocks = self.blocks_for(num_tokens) - len(hits)
        if new_blocks + self.allocator.num_free_among(taken) > self.allocator.num_free:
            return False
        return len(taken) + new_blocks <= self._updates_left(step)

    def admit(self, step: PlannedStep, seq: Sequence, hits: list[int]) -> None:
        """seq takes a slot and the cached blocks `hits`: their tokens count as computed.
        Those before its window are not taken (their pages NO_BLOCK, as if trimmed)."""
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
        num_hit = len(hits) * self.block_size
        skip = self.first_read_page(num_hit)
        if skip:
            seq.blocks = [NO_BLOCK] * skip
            seq.num_trimmed = seq.num_registered = skip
        for block in hits[skip:]:
            self.allocator.take(block)
            self.map_block(step, seq, block)
        self._note_held(seq)
        seq.num_computed = num_hit
        self.prefix_cache_queries += seq.num_known
        self.prefix_cache_hits += num_hit
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_hit

    # ------------------------------------------------------------ growth

    def grow(self, step: PlannedStep, seq: Sequence, num_tokens: int,
             preempt: Preempt | None) -> bool:
        """Give seq blocks for num_tokens tokens, preempting another sequence if need be
        (not with preempt None: then only free blocks); with a window, first give back its
        pages out of it (trim)."""
        needed = self.blocks_for(num_tokens) - len(seq.blocks)
        if needed <= 0:
            return True
        if self.window is not None:
            self.trim(seq)
        if needed > self._updates_left(step):
            return False
        blocks = self.allocator.allocate(needed)
        while blocks is None:
            if preempt is None or not self._preempt_one(step, seq, preempt):
                return False
            blocks = self.allocator.allocate(needed)
        for block in blocks:
            self.map_block(step, seq, block)
        self._note_held(seq)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back seq's pages wholly before the window of num_computed, as seq is planned.

        No step planned from now on reads them: seq's queries there are at num_computed or
        later (one with drafts in flight, whose rejection lowers num_computed, is not planned
        until they are verified: StepBuilder.fill), each reading `window` keys back. Steps
        in flight may still read them, but they were planned earlier and the executor runs
        steps in order (compute() applies a step's block-table updates, then its forward),
        so a block given back here may be mapped to another sequence in the very step being
        planned: its new owner writes it only after every step that could read it ran. The
        executor's table keeps the page's old entry, a valid block that no backend reads
        unmasked (each starts at the window's first page or masks what it gathers before it).

        A block given back loses its prefix-cache key (allocator.free forget): otherwise
        each decoding sequence's passing blocks would queue in the cache's LRU behind the
        prefixes worth keeping and push them out first. A later prompt's lookup stops at the
        first page without a key, so what is left of the sequence is no hit either, and a
        block another sample or request still holds (the allocator's reference counts) goes
        back only when the last of them gives it up."""
        first = self.first_read_page(seq.num_computed)
        done = seq.num_trimmed
        if first <= done:
            return
        blocks = seq.blocks
        self.allocator.free(blocks[done:first], forget=True)
        blocks[done:first] = [NO_BLOCK] * (first - done)
        seq.num_trimmed = first
        # (pages not offered to the prefix cache yet never will be: gone)
        seq.num_registered = max(seq.num_registered, first)

    def _note_held(self, seq: Sequence) -> None:
        held = seq.num_held_blocks
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
        """Blocks for seq up to token `end` as far as free blocks and the step's updates
        allow (a draft never preempts anything), with a window first giving back its pages
        out of it (trim: its row's blocks may be there already, so grow took none); returns
        the tokens its pages now hold."""
        extra = self.blocks_for(end) - len(seq.blocks)
        if extra > 0:
            if self.window is not None:
                self.trim(seq)
            can = min(extra, self.allocator.num_free, self._updates_left(step))
            for block in self.allocator.allocate(max(can, 0)) or []:
                self.map_block(step, seq, block)
            self._note_held(seq)
        return len(seq.blocks) * self.block_size

    def map_block(self, step: PlannedStep, seq: Sequence, block: int) -> None:
        step.block_updates.append((seq.slot, len(seq.blocks), block))  # type: ignore[arg-type]
        seq.blocks.append(block)

    # ------------------------------------------------------------ results and release

    def register_blocks(self, seq: Sequence) -> None:
        """Offer seq's full blocks whose tokens are all known to the prefix cache. Their KV is
        written by a step already planned, so every step planned from now on can read it."""
        bs = self.block_size
        if seq.num_computed < (seq.num_registered + 1) * bs:
            return  # the common case, checked first: no new full block
        num_full = min(seq.num_computed, seq.num_known, len(seq.blocks) * bs) // bs
        if num_full <= seq.num_registered:
            return
        keys = seq.keys_for(num_full, bs)
        for i in range(seq.num_registered, num_full):
            self.allocator.register(seq.blocks[i], keys[i])
        seq.num_registered = num_full

    def drop_rejected(self, seq: Sequence, num_rejected: int) -> None:
        """Forget the KV of a row's rejected drafts, and give back the blocks only they
        filled: nothing else in flight writes them (the sequence was not planned again). They
        lie past the row's first position, so past every page a window gave back."""
        seq.num_computed -= num_rejected
        # (a draft model's row: the block its last sample lands in too, see DraftPlanner)
        keep = self.blocks_for(seq.num_computed + int(seq.draft_model_kv))
        if len(seq.blocks) > keep and seq.status is not SeqStatus.FINISHED:
            self.allocator.free(seq.blocks[keep:][::-1])
            del seq.blocks[keep:]

    def release(self, seq: Sequence) -> None:
        """seq gives back its blocks (last first: a shared prefix is evicted last) and slot;
        no in-flight step writes them any more."""
        self.victims.discard(seq)
        self.allocator.free(seq.blocks[seq.num_trimmed:][::-1])
        seq.blocks = []
        seq.num_trimmed = seq.num_registered = 0
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
