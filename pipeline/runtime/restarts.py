"""When the launcher (tokenizers, detokenizers) and `serve` (its HTTP workers) start a dead
process again, and when they give up. Runs in the process that owns the pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable

RESTARTABLE = ("tokenizer", "detokenizer")
MAX_RESTARTS = 5  # of one stage within RESTART_WINDOW_S; one more death fails the pipeline
RESTART_WINDOW_S = 60.0


class RestartPolicy:
    """When a dead process is started again: at once the first time, then after 0.5, 1, 2,
    4 s; one that dies MAX_RESTARTS times within RESTART_WINDOW_S is not (the launcher for
    tokenizers and detokenizers, `serve` for its HTTP workers)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.counts: dict[str, int] = {}  # name -> restarts in all
        self._recent: dict[str, list[float]] = {}  # name -> times within the window

    def _prune(self, name: str, now: float) -> list[float]:
        recent = [t for t in self._recent.get(name, []) if now - t < RESTART_WINDOW_S]
        self._recent[name] = recent
        return recent

    def delay(self, name: str) -> float | None:
        """Seconds to wait before starting `name` again (recording the restart), or None:
        it died too often; give up."""
        now = self._clock()
        recent = self._prune(name, now)
        if len(recent) >= MAX_RESTARTS:
            return None
        recent.append(now)
        self.counts[name] = self.counts.get(name, 0) + 1
        return 0.0 if len(recent) == 1 else 0.5 * 2 ** (len(recent) - 2)
