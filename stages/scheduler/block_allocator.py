"""Paged KV block allocator: a free list of fixed-size blocks. Runs in the scheduler process.

The scheduler owns block ids; the executor owns the memory they name.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1. Invariant: num_free + blocks held == num_blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache must have at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) if there are not enough."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)
