"""stages/executor/host_memory.py: once the executor's process keeps freed memory, a block of
the size of a step's activations, freed and taken again, is not faulted in again page by page
(without it, glibc maps every block above 32 MiB afresh and unmaps it when freed)."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

import pytest

from stages.executor.host_memory import keep_freed_memory


def _faults_to_take_and_fill(libc: ctypes.CDLL, size: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    assert block
    ctypes.memset(block, 1, size)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_freed_block_is_taken_again_without_page_faults() -> None:
    threshold = keep_freed_memory()
    if threshold == 0:
        pytest.skip("the C library is not glibc (no mallopt)")
    assert keep_freed_memory() == threshold  # (once per process)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    # 48 MiB: above glibc's own largest threshold (32 MiB), below the one set (a C library
    # that caps it at 32 MiB gets half of that)
    size = min(48 << 20, threshold // 2)
    _faults_to_take_and_fill(libc, size)  # (the heap grows once)
    pages = size // resource.getpagesize()
    assert _faults_to_take_and_fill(libc, size) < pages // 20  # (mapped afresh: every page)
