"""Paged KV blocks with reference counts and a prefix cache. Runs in the scheduler process.

The scheduler owns block ids; the executor owns the memory they name.

A block whose tokens are all known and whose KV is written (or being written by a step that the
device runs before any later one) is registered under its key, a digest of its tokens and the
previous block's key (stages/scheduler/sequence.py block_key). A new sequence whose prompt
starts with the same tokens takes those blocks instead of computing them (reference counted).
A block nobody holds is free; if it has a key it stays reusable until allocation evicts it,
least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

BlockKey = bytes  # a digest of the block's tokens and of its prefix


class BlockAllocator:
    """Invariant: a block is free (ref count 0) or held; num_free counts free blocks, keyed
    (reusable) or not. Uncached free blocks are handed out before cached ones are evicted."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache must have at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._uncached: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_key: dict[BlockKey, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._uncached) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (ref count 1, no key), or None and nothing taken."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._uncached:
                block = self._uncached.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                key = self._keys[block]
                assert key is not None
                del self._by_key[key]
                self._keys[block] = None
                self.num_evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int], forget: bool = False) -> None:
        """Drop one reference to each block; pass a sequence's blocks last first, so that the
        start of a prefix, which more requests share, is evicted last. forget: a block that
        nobody holds any more loses its key too (it is no prefix-cache hit: it is handed out
        again before any cached block is evicted)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                key = self._keys[b]
                if key is not None and forget:
                    del self._by_key[key]
                    self._keys[b] = None
                    key = None
                if key is None:
                    self._uncached.append(b)
                else:
                    self._cached_free[b] = None

    # ------------------------------------------------------------ prefix cache

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """Blocks holding the longest cached run of `keys` from the first; takes nothing."""
        found = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def find(self, key: BlockKey) -> int | None:
        """The block holding `key`'s KV, if one is cached; takes nothing."""
        return self._by_key.get(key)

    def take(self, block: int) -> None:
        """Add a reference to a cached block found by lookup()."""
        if self._refs[block] == 0:
            del self._cached_free[block]
        self._refs[block] += 1

    def register(self, block: int, key: BlockKey) -> None:
        """`block` (held) now holds the KV of `key`. If another block already holds it, that
        one stays the cached copy and this one is freed as uncached when released."""
        if self._keys[block] is None and key not in self._by_key:
            self._keys[block] = key
            self._by_key[key] = block

    def num_free_among(self, blocks: list[int]) -> int:
        return sum(self._refs[b] == 0 for b in blocks)
