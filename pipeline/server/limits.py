"""Rate limiting of the HTTP front end: a token bucket and a concurrency count per identity
(API key, client address). Runs in each front-end worker process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    tokens: float
    updated: float
    active: int = 0


@dataclass
class RateLimiter:
    """A token bucket (rate rps, burst max(1, rps)) and a concurrency count per identity.
    Limits hold per front-end worker: with K workers each takes 1/K of them (rounded up)."""

    rps: float
    concurrent: int
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    _pruned_at: float = 0.0

    MAX_IDLE_BUCKETS = 10_000

    def acquire(self, identity: str, now: float | None = None) -> float | None:
        """None if the request may go (release() it when done), else seconds to wait."""
        if not self.rps and not self.concurrent:
            return None
        now = time.monotonic() if now is None else now
        if len(self.buckets) > self.MAX_IDLE_BUCKETS and now - self._pruned_at > 1.0:
            self._prune(now)
            self._pruned_at = now
        burst = max(1.0, self.rps)
        b = self.buckets.setdefault(identity, _Bucket(burst, now))
        if self.concurrent and b.active >= self.concurrent:
            return 1.0
        if self.rps:
            b.tokens = min(burst, b.tokens + (now - b.updated) * self.rps)
            b.updated = now
            if b.tokens < 1:
                return (1 - b.tokens) / self.rps
            b.tokens -= 1
        b.active += 1
        return None

    def release(self, identity: str) -> None:
        b = self.buckets.get(identity)
        if b is not None:
            b.active -= 1

    def _prune(self, now: float) -> None:
        """Forget identities with nothing running and a bucket that has refilled."""
        burst = max(1.0, self.rps)
        self.buckets = {k: b for k, b in self.buckets.items()
                        if b.active or (self.rps and b.tokens + (now - b.updated) * self.rps
                                        < burst)}
