"""Prometheus metrics of the HTTP front end: vLLM's names and labels (`vllm:*`, with
`model_name`) for everything vLLM also measures, so the dashboards people run for vLLM show
this engine too; `llm_pipeline_*` for our own (stage liveness, step time, device idle, the
run-ahead, HTTP responses). Runs in each front-end worker process.

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

from ipc.messages import (
    REQUEST_PHASES,
    REQUEST_SECONDS_BOUNDS,
    STEP_SECONDS_BOUNDS,
    STEP_TOKENS_BOUNDS,
    PipelineStatus,
)

P = "llm_pipeline_"  # our own metrics, beside vLLM's
V = "vllm:"  # what vLLM also measures, under its names and labels (model_name)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, ... 500,000
MODEL = ["model_name"]

TTFT = Histogram(V + "time_to_first_token_seconds", "Time from request to its first token",
                 MODEL, buckets=TTFT_BUCKETS)
ITL = Histogram(V + "inter_token_latency_seconds", "Time between a sample's tokens (tokens "
                "that arrive together share the gap)", MODEL, buckets=TOKEN_GAP_BUCKETS)
# vLLM's older name of the same measure, which its stock Grafana dashboard reads.
TPOT = Histogram(V + "time_per_output_token_seconds", "Time between a sample's tokens (as "
                 "inter_token_latency_seconds)", MODEL, buckets=TOKEN_GAP_BUCKETS)
REQUEST_TPOT = Histogram(V + "request_time_per_output_token_seconds", "Per request: (end - "
                         "first token) / (output tokens - 1)", MODEL, buckets=TOKEN_GAP_BUCKETS)
E2E = Histogram(V + "e2e_request_latency_seconds", "Time from request to its last token",
                MODEL, buckets=REQUEST_SECONDS_BOUNDS)
PROMPT_TOKENS = Histogram(V + "request_prompt_tokens", "Prompt tokens of each finished request",
                          MODEL, buckets=COUNT_BUCKETS)
GENERATION_TOKENS = Histogram(V + "request_generation_tokens", "Generated tokens of each "
                              "finished request (all its samples)", MODEL, buckets=COUNT_BUCKETS)
MAX_GENERATION_TOKENS = Histogram(V + "request_max_num_generation_tokens", "The most tokens "
                                  "one sample of a finished request generated", MODEL,
                                  buckets=COUNT_BUCKETS)
PARAMS_N = Histogram(V + "request_params_n", "n of each finished request", MODEL,
                     buckets=(1, 2, 5, 10, 20))
HTTP = Counter(P + "http_responses", "HTTP responses by route and status", ["route", "status"])


class LatencyRecorder:
    """The latencies and sizes of one API request: time to first token, inter-token latency
    per choice (tokens that arrive together share the gap), end-to-end, and per prompt (an
    engine request) its tokens."""

    def __init__(self, model: str = "") -> None:
        self.model = model
        self.start = time.perf_counter()
        self.first_token_seen = False
        self.first_token_time = 0.0
        self.last_token_time: dict[int, float] = {}

    def tokens(self, choice: int, count: int) -> None:
        now = time.perf_counter()
        if not self.first_token_seen:
            self.first_token_seen = True
            self.first_token_time = now
            TTFT.labels(self.model).observe(now - self.start)
        last = self.last_token_time.get(choice)
        # (the first delta: its tokens after the first came with it)
        gaps = [(now - last) / count] * count if last is not None else [0.0] * (count - 1)
        for gap in gaps:
            ITL.labels(self.model).observe(gap)
            TPOT.labels(self.model).observe(gap)
        self.last_token_time[choice] = now

    def finished(self, prompt_tokens: list[int] | None = None,
                 choice_tokens: list[list[int]] | None = None) -> None:
        """prompt_tokens: each prompt's; choice_tokens: each prompt's samples' token counts."""
        now = time.perf_counter()
        model = self.model
        E2E.labels(model).observe(now - self.start)
        for prompt, samples in zip(prompt_tokens or [], choice_tokens or [], strict=False):
            generated = sum(samples)
            PROMPT_TOKENS.labels(model).observe(prompt)
            GENERATION_TOKENS.labels(model).observe(generated)
            MAX_GENERATION_TOKENS.labels(model).observe(max(samples, default=0))
            PARAMS_N.labels(model).observe(len(samples))
            if self.first_token_seen and generated > len(samples):
                REQUEST_TPOT.labels(model).observe(
                    (now - self.first_token_time) / (generated / len(samples) - 1))


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int],
               total: float, labels: list[str] | None = None) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=False):
        cumulative += count
        buckets.append((bound, cumulative))
    if labels is None:
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)
    family = HistogramMetricFamily(name, doc, labels=MODEL)
    family.add_metric(labels, buckets, sum_value=total)
    return family


class StatusCollector:
    """The engine's metrics, from the latest published status: vLLM's names (with its
    model_name label) for what vLLM also measures, ours for the rest."""

    def __init__(self, status: Callable[[], PipelineStatus | None], model: str = "") -> None:
        self._status, self.model = status, model

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        up = GaugeMetricFamily(P + "stage_up", "1 while the stage process runs", labels=["stage"])
        for stage, alive in sorted((status.stages if status else {}).items()):
            up.add_metric([stage], 1.0 if alive else 0.0)
        yield up
        s = status.scheduler if status is not None else None
        if s is None:
            return
        m = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=MODEL)
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=MODEL)
            c.add_metric(m, value)
            return c

        yield gauge(V + "num_requests_running", "Sequences in the running batch", s.num_running)
        yield gauge(V + "num_requests_waiting", "Sequences waiting for admission", s.num_waiting)
        used = 1 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield gauge(V + "kv_cache_usage_perc", "Fraction of KV blocks held (1 = all)", used)
        yield gauge(V + "gpu_cache_usage_perc", "Fraction of KV blocks held (vLLM's older "
                    "name, on any device)", used)
        info = GaugeMetricFamily(V + "cache_config_info", "The KV cache's configuration (its "
                                 "labels; the value is 1)",
                                 labels=["block_size", "cache_dtype", "num_gpu_blocks"])
        info.add_metric([str(s.block_size), s.cache_dtype, str(s.num_blocks)], 1.0)
        yield info
        finished = CounterMetricFamily(V + "request_success", "Finished sequences (samples) "
                                       "and refused requests, by finish reason",
                                       labels=[*MODEL, "finished_reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([self.model, reason], count)
        yield finished
        yield counter(V + "prompt_tokens", "Prompt tokens of admitted requests", s.prompt_tokens)
        yield counter(V + "generation_tokens", "Generated tokens", s.generation_tokens)
        yield counter(V + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_cache_queries)
        yield counter(V + "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_cache_hits)
        yield counter(V + "num_preemptions", "Sequences preempted", s.num_preemptions)
        if s.spec_accepted_per_pos:  # speculative decoding is on (--speculative)
            yield counter(V + "spec_decode_num_drafts", "Rows planned with draft tokens",
                          s.spec_num_drafts)
            yield counter(V + "spec_decode_num_draft_tokens", "Draft tokens proposed",
                          s.spec_num_draft_tokens)
            yield counter(V + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily(V + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the row",
                                          labels=[*MODEL, "position"])
            for pos, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([self.model, str(pos)], count)
            yield per_pos
        if s.step_tokens_buckets:
            yield _histogram(V + "iteration_tokens_total", "Tokens computed in each step",
                             STEP_TOKENS_BOUNDS, s.step_tokens_buckets, s.step_tokens_sum, m)
        docs = {"queue": "Time from arrival to first admission",
                "prefill": "Time from admission to the first token",
                "decode": "Time from the first token to the end",
                "inference": "Time from admission to the end"}
        for phase in REQUEST_PHASES:
            h = s.request_phases.get(phase)
            if h is not None:
                yield _histogram(V + f"request_{phase}_time_seconds", docs[phase] + " (finished "
                                 "requests)", REQUEST_SECONDS_BOUNDS, h.buckets, h.sum, m)
        # Ours alone.
        yield CounterMetricFamily(P + "steps", "Steps planned", value=s.num_steps)
        if s.step_seconds_buckets:
            yield _histogram(P + "step_duration_seconds", "Device time of each step",
                             STEP_SECONDS_BOUNDS, s.step_seconds_buckets, s.step_seconds_sum)
        yield GaugeMetricFamily(P + "device_idle_fraction", "Fraction of the last seconds of "
                                "steps the device waited between steps",
                                value=s.device_idle_fraction)
        yield GaugeMetricFamily(P + "steps_in_flight", "Steps planned and not yet reported "
                                "(the run-ahead)", value=s.num_inflight_steps)
        yield GaugeMetricFamily(P + "ring_slots_free", "Free slots of the step rings",
                                value=s.num_free_ring_slots)


def render(status: Callable[[], PipelineStatus | None], model: str = "") -> bytes:
    """The text exposition of every metric, over all front-end workers."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(StatusCollector(status, model))  # type: ignore[arg-type]
    return generate_latest(registry)
