"""Per-process timeline recorder, written as Chrome-trace events (viewable in Perfetto).

Each stage records spans on the system-wide monotonic clock (time.perf_counter_ns is
CLOCK_MONOTONIC on Linux), so the launcher can merge the files of all stages into one trace.
Disabled, it costs one attribute check per span.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


def now_ns() -> int:
    return time.perf_counter_ns()


class Tracer:
    def __init__(self, path: str | None, stage: str, rank: int) -> None:
        self.path, self.enabled = path, path is not None
        self.stage, self.rank = stage, rank
        self._events: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
        self._lock = threading.Lock()

    def span(self, name: str, start_ns: int, end_ns: int, track: str = "main",
             args: dict[str, Any] | None = None) -> None:
        """A complete event on `track` (a thread of this stage in the viewer)."""
        if self.enabled:
            with self._lock:
                self._events.append((name, track, start_ns, end_ns, args))

    def dump(self) -> None:
        """Write this process's events (once, at exit) as a JSON list of trace events."""
        if not self.enabled or self.path is None:
            return
        pid = os.getpid()
        tids: dict[str, int] = {}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid,
             "args": {"name": f"{self.stage}:{self.rank}"}}]
        for name, track, start, end, args in self._events:
            tid = tids.setdefault(track, len(tids))
            event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": start / 1000,
                     "dur": (end - start) / 1000}
            if args:
                event["args"] = args
            events.append(event)
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": track}} for track, tid in tids.items()]
        with open(self.path, "w") as f:
            json.dump(events, f)


def merge_traces(paths: list[str], out_path: str) -> int:
    """Merge per-stage event files into one Chrome trace; returns the number of events."""
    events: list[dict[str, Any]] = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                events += json.load(f)
    with open(out_path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
