"""How the executor's process takes memory from the C library on the CPU.

glibc's malloc serves a block above its mmap threshold (128 KiB, raised as such blocks are
freed, to at most 32 MiB) with a fresh mmap and gives it back with munmap when freed, and it
trims the heap's free top back to the kernel. A step's activations are such blocks: each
2048-token prefill step faulted every page of its activations in again (the kernel zeroes
each page first). The prefill of 64 prompts of 128 tokens in 2048-token steps (the default
model in bf16, in process): 2.9 million page faults and a median 2.76 s a round before, 0.16
million and 1.7-2.0 s with the thresholds raised. vLLM's CPU backend preloads tcmalloc for
the same reason. With the thresholds raised, freed blocks stay in the heap and the next step
reuses them: the process keeps the memory of its largest step (the activations, not the
weights or the KV cache, which are allocated once). ModelRunner.from_dir calls this on the
CPU, so the executor, the in-process engine and the benchmarks' own forward all run so.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
# Blocks up to this size come from the heap (a 1B-parameter model's 2048-token MLP activations
# are ~130 MB); a C library that refuses it (newer glibc caps the threshold at 32 MiB on
# 64-bit) gets its cap.
THRESHOLDS = (1 << 30, 32 << 20)

_kept: int | None = None


def keep_freed_memory() -> int:
    """Raise glibc's mmap and trim thresholds, once per process; returns the mmap threshold
    set (0 where the C library is not glibc, or refuses both)."""
    global _kept
    if _kept is not None:
        return _kept
    _kept = 0
    try:  # (the process's own symbols: find_library would run `ldconfig -p` at every start)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt; macOS's libc neither)
        return _kept
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for threshold in THRESHOLDS:
        if mallopt(M_MMAP_THRESHOLD, threshold) == 1:
            mallopt(M_TRIM_THRESHOLD, 2 * threshold if 2 * threshold < 1 << 31 else (1 << 31) - 1)
            _kept = threshold
            break
    logger.debug("malloc: blocks up to %d bytes from the heap, kept when freed", _kept)
    return _kept
