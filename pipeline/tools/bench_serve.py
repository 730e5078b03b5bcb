"""`scripts/bench serve`: an online load generator. Requests of the synthetic-chat workload
arrive by a Poisson process (or all at once) through the pipeline's Python client; it reports
TTFT, TPOT, inter-token latency and end-to-end latency, throughput and goodput under SLOs."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc.messages import ChatMessage, SamplingParams, SchedulerStats
from pipeline.runtime.client import PipelineClient
from pipeline.tools.datasets import WORDS, ChatSample, synthetic_chat

if TYPE_CHECKING:
    pass


@dataclass
class RequestRecord:
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per token (a delta's tokens
    num_prompt_tokens: int = 0                              # share its arrival time)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` requests/s (all at 0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        times.append(t)
    return times


Sender = Callable[[ChatSample, str, RequestRecord], Awaitable[None]]


def via_client(client: PipelineClient) -> Sender:
    """Requests through the Python client, straight into the pipeline."""

    async def send(sample: ChatSample, system: str, rec: RequestRecord) -> None:
        params = SamplingParams(max_tokens=sample.output_tokens, temperature=0.0,
                                ignore_eos=True)
        messages = [ChatMessage("system", system)] if system else []
        messages.append(ChatMessage("user", sample.text))
        async for out in client.stream(messages, params):
            now = time.perf_counter()
            rec.token_times += [now] * len(out.token_ids)
            rec.num_prompt_tokens = out.num_prompt_tokens
            rec.error = out.error

    return send


def via_http(http: Any, base_url: str, model: str) -> Sender:
    """Requests to an OpenAI-compatible server (ours, or any other), streamed chat
    completions. A chunk's arrival time stands for its tokens; the usage chunk gives counts."""

    async def send(sample: ChatSample, system: str, rec: RequestRecord) -> None:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": sample.text})
        body = {"model": model, "messages": messages, "max_tokens": sample.output_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.stream("POST", f"{base_url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    rec.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    missing = chunk["usage"]["completion_tokens"] - len(rec.token_times)
                    rec.token_times += rec.token_times[-1:] * max(0, missing)
                elif chunk.get("error"):
                    rec.error = chunk["error"]["message"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    rec.token_times.append(time.perf_counter())

    return send


async def _one(send: Sender, sample: ChatSample, delay: float, t0: float,
               sem: asyncio.Semaphore | None, rec: RequestRecord, system: str) -> None:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    async with sem if sem is not None else _nothing():
        rec.submitted = time.perf_counter()
        await send(sample, system, rec)


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


async def drive(send: Sender, samples: list[ChatSample], rate: float,
                max_concurrency: int | None, seed: int, system: str = ""
                ) -> tuple[list[RequestRecord], float]:
    delays = arrival_times(len(samples), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord() for _ in samples]
    t0 = time.perf_counter()
    await asyncio.gather(*(_one(send, s, d, t0, sem, r, system)
                           for s, d, r in zip(samples, delays, records, strict=True)))
    return records, time.perf_counter() - t0


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    arr = np.array(values) * 1000  # ms
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def scheduler_delta(before: SchedulerStats, after: SchedulerStats) -> dict[str, Any]:
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "num_steps": after.num_steps - before.num_steps}


def summarize(records: list[RequestRecord], seconds: float, args: argparse.Namespace
              ) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times[:-1], r.token_times[1:], strict=True)]
    out_tokens = sum(len(r.token_times) for r in ok)
    good = [r for r in ok if r.ttft * 1000 <= args.slo_ttft_ms
            and (r.tpot is None or r.tpot * 1000 <= args.slo_tpot_ms)]
    return {
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": seconds, "request_throughput": len(ok) / seconds,
        "output_token_throughput": out_tokens / seconds,
        "total_token_throughput": (out_tokens + sum(r.num_prompt_tokens for r in ok)) / seconds,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats(itl), "e2e_ms": _stats([r.e2e for r in ok]),
        "goodput": {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                    "requests_per_s": len(good) / seconds, "fraction": len(good) / len(records)},
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"serve: rate={s['request_rate']} req/s, concurrency cap={s['max_concurrency']}, "
          f"{s['completed']}/{s['num_requests']} completed in {s['duration_s']:.1f} s")
    for error in s["errors"]:
        print(f"  failed request: {error}")
    print(f"  throughput: {s['request_throughput']:.2f} req/s, "
          f"{s['output_token_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s")
    print(f"  {'ms':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = s[key]
        print(f"  {key[:-3]:8}" + "".join(f"{row[k]:>10.1f}" for k in ("mean", "p50", "p90",
                                                                         "p99")))
    g = s["goodput"]
    print(f"  goodput (TTFT <= {g['slo_ttft_ms']} ms, TPOT <= {g['slo_tpot_ms']} ms): "
          f"{g['requests_per_s']:.2f} req/s ({g['fraction']:.0%} of requests)")
    if "scheduler" in s:
        c = s["scheduler"]
        print(f"  scheduler: {c['num_steps']} steps, {c['num_preemptions']} preemptions, "
              f"prefix cache {c['prefix_cache_hits']}/{c['prefix_cache_queries']} prompt "
              f"tokens hit ({c['prefix_cache_hit_rate']:.1%})")


def _serve_http(args: argparse.Namespace, samples: list[ChatSample],
                system: str) -> list[dict[str, Any]]:
    """The same load against a running OpenAI-compatible server at args.base_url."""
    import httpx

    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    model = args.served_model or httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
    summaries = []
    for rate in args.request_rate:
        args_one = argparse.Namespace(**{**vars(args), "request_rate": rate})

        async def run(rate: float = rate) -> tuple[list[RequestRecord], float]:
            async with httpx.AsyncClient(timeout=None, limits=limits) as http:
                return await drive(via_http(http, base, model), samples, rate,
                                   args.max_concurrency, args.seed, system)

        records, seconds = asyncio.run(run())
        summaries.append(summarize(records, seconds, args_one))
        print_summary(summaries[-1])
    return summaries


def serve(args: argparse.Namespace) -> int:
    from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
    from ipc.model_info import ModelInfo
    from pipeline.runtime.launcher import Pipeline

    samples = synthetic_chat(args.num_prompts, seed=args.seed)
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_prompt_words))
    if args.base_url:
        summaries = _serve_http(args, samples, system)
    else:
        from pipeline.tools.model_source import resolve_model

        args.model_dir = str(resolve_model(args.model_dir))
        cfg = PipelineConfig(
            model=ModelInfo.from_dir(args.model_dir, args.max_model_len),
            scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
            executor=ExecutorConfig.for_device(args.device, args.dtype, args.kv_cache_memory,
                                               args.compile))
        summaries = []
        with Pipeline(cfg) as pipe:
            client = pipe.client()
            client.generate([[ChatMessage("user", "warm up")]], SamplingParams(max_tokens=2))
            for rate in args.request_rate:
                args_one = argparse.Namespace(**{**vars(args), "request_rate": rate})
                before = pipe.idle_stats()
                records, seconds = asyncio.run(drive(via_client(client), samples, rate,
                                                     args.max_concurrency, args.seed, system))
                summaries.append(summarize(records, seconds, args_one))
                summaries[-1]["scheduler"] = scheduler_delta(before, pipe.idle_stats())
                print_summary(summaries[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(summaries if len(summaries) > 1 else summaries[0],
                                              indent=2))
    if args.plot:
        from pipeline.tools.bench_plots import plot_latency_vs_rate

        print(f"plot: {plot_latency_vs_rate(summaries, args.plot)}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
