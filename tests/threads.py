"""Running a kernel at several thread counts, for tests whose result must not depend on how
many threads shared the work (csrc/work_queue.h)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def at_thread_counts(run: Callable[[], torch.Tensor],
                     counts: tuple[int, ...] = (1, 2, 3)) -> list[torch.Tensor]:
    """run() once at each of torch's thread counts `counts`; the count is set back after."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append(run())
        return results
    finally:
        torch.set_num_threads(threads)
