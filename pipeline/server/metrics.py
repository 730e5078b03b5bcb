"""Prometheus metrics of the HTTP front end, named `llm_pipeline_*`. Runs in each front-end
worker process.

Two sources. What the engine knows (requests running and waiting, finished by reason, tokens,
KV cache usage, prefix-cache queries and hits, preemptions, step duration, tokens per step,
device idle fraction) comes from the scheduler's counters in the status the launcher publishes:
one source for every worker, so any worker's scrape is right. What only a front end sees (time
to first token, inter-token latency, end-to-end latency, HTTP responses) is recorded by each
worker in prometheus_client's multiprocess mode and summed over the workers at scrape time.
PROMETHEUS_MULTIPROC_DIR must be set before this module is imported (the serve command does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector

from ipc.messages import STEP_SECONDS_BOUNDS, STEP_TOKENS_BOUNDS, PipelineStatus

P = "llm_pipeline_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)

TTFT = Histogram(P + "time_to_first_token_seconds", "Time from request to first token",
                 buckets=LATENCY_BUCKETS)
ITL = Histogram(P + "inter_token_latency_seconds", "Time between a sample's tokens (tokens "
                "that arrive together share the gap)", buckets=LATENCY_BUCKETS)
E2E = Histogram(P + "e2e_request_latency_seconds", "Time from request to its last token",
                buckets=LATENCY_BUCKETS)
HTTP = Counter(P + "http_responses", "HTTP responses by route and status", ["route", "status"])


class LatencyRecorder:
    """The latencies of one API request: time to first token, inter-token latency per choice
    (tokens that arrive together share the gap), end-to-end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_token_seen = False
        self.last_token_time: dict[int, float] = {}

    def tokens(self, choice: int, count: int) -> None:
        now = time.perf_counter()
        if not self.first_token_seen:
            self.first_token_seen = True
            TTFT.observe(now - self.start)
        last = self.last_token_time.get(choice)
        if last is not None:
            for _ in range(count):
                ITL.observe((now - last) / count)
        else:  # the first delta: its tokens after the first came with it
            for _ in range(count - 1):
                ITL.observe(0.0)
        self.last_token_time[choice] = now

    def finished(self) -> None:
        E2E.observe(time.perf_counter() - self.start)


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int],
               total: float) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=False):
        cumulative += count
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class StatusCollector:
    """The engine's metrics, from the latest published status."""

    def __init__(self, status: Callable[[], PipelineStatus | None]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        up = GaugeMetricFamily(P + "stage_up", "1 while the stage process runs", labels=["stage"])
        for stage, alive in sorted((status.stages if status else {}).items()):
            up.add_metric([stage], 1.0 if alive else 0.0)
        yield up
        s = status.scheduler if status is not None else None
        if s is None:
            return
        yield GaugeMetricFamily(P + "requests_running", "Sequences in the running batch",
                                value=s.num_running)
        yield GaugeMetricFamily(P + "requests_waiting", "Sequences waiting for admission",
                                value=s.num_waiting)
        finished = CounterMetricFamily(P + "requests_finished", "Finished sequences (samples) "
                                       "and refused requests, by finish reason", labels=["reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily(P + "prompt_tokens", "Prompt tokens of admitted requests",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily(P + "generation_tokens", "Generated tokens",
                                  value=s.generation_tokens)
        used = 1 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield GaugeMetricFamily(P + "kv_cache_usage", "Fraction of KV blocks held", value=used)
        yield CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the "
                                  "prefix cache", value=s.prefix_cache_queries)
        yield CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens found in the prefix "
                                  "cache", value=s.prefix_cache_hits)
        yield CounterMetricFamily(P + "preemptions", "Sequences preempted",
                                  value=s.num_preemptions)
        yield CounterMetricFamily(P + "steps", "Steps planned", value=s.num_steps)
        if s.step_seconds_buckets:
            yield _histogram(P + "step_duration_seconds", "Device time of each step",
                             STEP_SECONDS_BOUNDS, s.step_seconds_buckets, s.step_seconds_sum)
        if s.step_tokens_buckets:
            yield _histogram(P + "step_tokens", "Tokens computed in each step",
                             STEP_TOKENS_BOUNDS, s.step_tokens_buckets, s.step_tokens_sum)
        yield GaugeMetricFamily(P + "device_idle_fraction", "Fraction of the last seconds of "
                                "steps the device waited between steps",
                                value=s.device_idle_fraction)


def render(status: Callable[[], PipelineStatus | None]) -> bytes:
    """The text exposition of every metric, over all front-end workers."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(StatusCollector(status))  # type: ignore[arg-type]
    return generate_latest(registry)
