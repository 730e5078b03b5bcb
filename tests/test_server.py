"""The HTTP front end, started as users start it (`run_pipeline serve`, a real process tree),
driven by the official `openai` package and plain HTTP: completions and chat, streaming or
not, n, stop, logprobs, usage; 64 concurrent streams; a disconnect aborts in the engine; the
400/401/404/413 answers; /health going 503 when a stage dies; /metrics that parse and move,
summed over two API workers; the access and engine lines. Tests that need options of their
own start their own server; the rest share one (rate limits, a burst past the engine's room
and the other options' effects on the front end alone: test_front_end.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from live import alive, kill_pids
from prometheus_client.parser import text_string_to_metric_families

from stages.executor import kernels

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-0123456789"
SERVED_CACHE = "int8" if kernels.available() else "auto"  # (the server fixture's KV format)
pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]


class Server:
    def __init__(self, proc: subprocess.Popen[str], url: str, model_dir: Path) -> None:
        self.proc, self.url, self.model = proc, url, model_dir.name
        self.model_dir = model_dir
        self.log: list[str] = []  # what it printed after "serving" (drained, so it never blocks)
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: self.log.extend(stdout), daemon=True).start()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus_client: name{labels} -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(model: Path, *args: str) -> Iterator[Server]:
    port = free_port()
    cmd = [str(ROOT / "scripts" / "run_pipeline"), "--model", str(model), "serve", "--port",
           str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        said: list[str] = []  # (what it printed before, for a failure to show)
        for line in proc.stdout:  # the CLI prints one line once it serves
            if line.startswith("serving "):
                break
            said.append(line)
            assert time.monotonic() < deadline, f"the server did not start: {''.join(said[-20:])}"
        else:
            raise AssertionError(f"the server exited with {proc.wait()}: {''.join(said[-20:])}")
        server = Server(proc, f"http://127.0.0.1:{port}", model)
        pids = [p.pid for p in server.descendants()]
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker leaves on EOF
        while (left := alive(pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        described = describe(left)
        kill_pids(left)
    assert left == [], f"processes of the server outlived it: {described}"


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    # With speculative decoding on (1-gram lookup: the tiny model's outputs repeat tokens
    # often enough to propose, seldom to accept), so every test here also runs rows with
    # drafts through the served path and must see what it would see without them. Its KV
    # cache is int8 (--kv-cache-dtype) where the CPU kernels are built (the format is
    # theirs): every served path runs over a quantized cache too.
    with serve(tiny_model_dir, "--api-key", KEY, "--api-workers", "2",
               "--stats-interval", "0.5", "--speculative", "ngram:3:2:1",
               "--kv-cache-dtype", SERVED_CACHE) as s:
        yield s


def openai_client(server: Server, key: str = KEY):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


# ---------------------------------------------------------------- the openai package


FOX = "The quick brown fox jumps over the lazy dog by the river bank this morning"


def test_models_and_completions(server: Server) -> None:
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == [server.model]
    out = client.completions.create(model=server.model, prompt=FOX,
                                    max_tokens=7, temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    again = client.completions.create(model=server.model, prompt=FOX,
                                      max_tokens=7, temperature=0)
    assert again.choices[0].text == choice.text
    cached = again.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert cached is not None and cached.cached_tokens > 0  # the same prompt ran just before
    assert cached.cached_tokens == (out.usage.prompt_tokens - 1) // 16 * 16
    chunks = list(client.completions.create(model=server.model, prompt=FOX,
                                            max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_n_stop_logprobs(server: Server) -> None:
    client = openai_client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    free = client.chat.completions.create(model=server.model, messages=messages,
                                          max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True})
    text = free.choices[0].message.content or ""
    assert free.choices[0].message.role == "assistant" and len(text) > 6
    stop = text[3:6]
    stopped = client.chat.completions.create(model=server.model, messages=messages,
                                             max_tokens=30, temperature=0, stop=[stop],
                                             extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    multi = client.chat.completions.create(model=server.model, messages=messages, n=3,
                                           max_tokens=5, temperature=1.0, seed=4,
                                           logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1, 2]
    for c in multi.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert multi.usage is not None and multi.usage.completion_tokens == 15
    streamed = client.chat.completions.create(model=server.model, messages=messages, n=2,
                                              max_tokens=5, temperature=1.0, seed=4,
                                              stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {i: multi.choices[i].message.content for i in (0, 1)}  # same seed


def test_completion_logprobs_and_several_prompts(server: Server) -> None:
    client = openai_client(server)
    out = client.completions.create(model=server.model, prompt=["one two", "three four"],
                                    max_tokens=4, temperature=0, logprobs=3)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == 4
        # {token text: logprob}: ids that decode alike (lone bytes) share a key
        assert all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs or [])
        assert "".join(c.logprobs.tokens or []) == c.text


def test_64_concurrent_streams_complete_with_the_right_text(server: Server) -> None:
    from openai import AsyncOpenAI

    prompts = [f"Request number {i} asks about {w}" for i, w in
               enumerate(["rivers", "code", "tea", "maps", "light", "bees", "rain", "glass"])]
    client = openai_client(server)
    expected = [client.completions.create(model=server.model, prompt=p, max_tokens=12,
                                          temperature=0).choices[0].text for p in prompts]

    async def run() -> list[str]:
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                              timeout=120)

        async def one(i: int) -> str:
            text = ""
            stream = await aclient.completions.create(model=server.model,
                                                      prompt=prompts[i % 8], max_tokens=12,
                                                      temperature=0, stream=True)
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        try:
            return list(await asyncio.gather(*(one(i) for i in range(64))))
        finally:
            await aclient.close()

    got = asyncio.run(run())
    assert got == [expected[i % 8] for i in range(64)]


# ---------------------------------------------------------------- errors


def post(server: Server, path: str, body: object, key: str | None = KEY,
         raw: bytes | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def test_errors_a_client_can_act_on(server: Server) -> None:
    ok = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    r = post(server, "/v1/completions", {**ok, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert "temperature must be" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {**ok, "top_p": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": [
        {"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": [
        {"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(server, "/v1/completions", {**ok, "prompt": "word " * 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "this model's context holds 512" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {**ok, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(server, "/v1/completions", ok, key=None).status_code == 401
    r = post(server, "/v1/completions", ok, key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    r = post(server, "/v1/completions", None, raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = post(server, "/v1/completions", None, raw=b'{"x": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413
    assert post(server, "/v1/completions", ok).status_code == 200  # all that left no trace


# ---------------------------------------------------------------- engine effects


GRAFANA_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]


def stat(server: Server, name: str) -> float:
    """A sample of /metrics; a vLLM metric named without labels gets the model's."""
    if name.startswith("vllm:") and "{" not in name:
        name += f"{{model_name={server.model}}}"
    return server.metrics().get(name, 0.0)


def aborted_name(server: Server) -> str:
    return f"vllm:request_success_total{{finished_reason=abort,model_name={server.model}}}"


def test_a_disconnect_mid_stream_aborts_in_the_engine(server: Server) -> None:
    aborted = aborted_name(server)
    before = stat(server, aborted)
    body = {"model": server.model, "prompt": "Tell me everything", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 10
    while stat(server, aborted) <= before:
        assert time.monotonic() < deadline, f"the engine never aborted: {server.metrics()}"
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while stat(server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert stat(server, "vllm:kv_cache_usage_perc") == 0.0  # its blocks were freed


def test_a_disconnect_before_a_plain_answer_aborts_too(server: Server) -> None:
    aborted = aborted_name(server)
    before = stat(server, aborted)
    # 16 samples of 490 tokens: seconds of work for the tiny model, cut short by the hang-up
    body = {"model": server.model, "prompt": "Tell me everything", "max_tokens": 490, "n": 16,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and hangs up
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.15,
                   headers={"authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 10
    while stat(server, aborted) < before + 16:
        assert time.monotonic() < deadline, f"the engine never aborted: {server.metrics()}"
        time.sleep(0.1)


def test_metrics_parse_and_move_across_two_workers(server: Server) -> None:
    time.sleep(0.6)  # (an earlier test's last status in first: once, 19 tokens moved, not 18)
    before = server.metrics()
    client = openai_client(server)
    for i in range(6):  # spread over the two workers by the kernel
        client.completions.create(model=server.model, prompt=f"count {i}", max_tokens=3,
                                  temperature=0)
    time.sleep(0.6)  # one more status from the scheduler
    after = server.metrics()

    model = f"model_name={server.model}"

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved(f"vllm:time_to_first_token_seconds_count{{{model}}}") == 6
    assert moved(f"vllm:e2e_request_latency_seconds_count{{{model}}}") == 6
    assert moved(f"vllm:inter_token_latency_seconds_count{{{model}}}") == 12
    assert moved(f"vllm:time_per_output_token_seconds_count{{{model}}}") == 12
    assert moved(f"vllm:request_time_per_output_token_seconds_count{{{model}}}") == 6
    assert moved(f"vllm:generation_tokens_total{{{model}}}") == 18
    assert moved(f"vllm:request_success_total{{finished_reason=length,{model}}}") == 6
    assert moved(f"vllm:request_prompt_tokens_count{{{model}}}") == 6
    assert moved(f"vllm:request_generation_tokens_sum{{{model}}}") == 18
    assert moved(f"vllm:request_max_num_generation_tokens_sum{{{model}}}") == 18
    assert moved(f"vllm:prompt_tokens_total{{{model}}}") > 0
    assert moved(f"vllm:iteration_tokens_total_count{{{model}}}") > 0
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"vllm:request_{phase}_time_seconds_count{{{model}}}") == 6
    assert moved("llm_pipeline_http_responses_total{route=/v1/completions,status=200}") == 6
    assert f"vllm:prefix_cache_queries_total{{{model}}}" in after
    assert f"vllm:num_preemptions_total{{{model}}}" in after
    assert f"vllm:gpu_cache_usage_perc{{{model}}}" in after
    # vLLM's cache_config_info, as its Grafana dashboard reads it: the format and the blocks
    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and f"cache_dtype={SERVED_CACHE}" in info[0]
    assert "block_size=16" in info[0]
    assert int(info[0].split("num_gpu_blocks=")[1].split(",")[0].rstrip("}")) > 0
    assert "llm_pipeline_device_idle_fraction{}" in after
    assert "llm_pipeline_steps_in_flight{}" in after
    # speculative decoding's counters, under vLLM's names (the server runs with drafts: a
    # long output repeats enough of its tokens to be drafted)
    client.completions.create(model=server.model, prompt=FOX, max_tokens=120, temperature=0,
                              extra_body={"ignore_eos": True})
    time.sleep(0.6)
    after = server.metrics()
    drafts = moved(f"vllm:spec_decode_num_draft_tokens_total{{{model}}}")
    assert drafts > 0 and moved(f"vllm:spec_decode_num_drafts_total{{{model}}}") > 0
    assert 0 <= moved(f"vllm:spec_decode_num_accepted_tokens_total{{{model}}}") <= drafts
    per_pos = [k for k in after
               if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(per_pos) == 3 and all("position=" in k for k in per_pos)  # K = 3
    # every series the stock vLLM Grafana dashboard (examples/online_serving/
    # prometheus_grafana/grafana.json) queries, with its model_name label
    for name in GRAFANA_SERIES:
        assert any(k.startswith(name + "{") and model in k for k in after), name
    assert after["llm_pipeline_stage_up{stage=executor:0}"] == 1.0
    pids = {p.pid for p in server.descendants() if "llm-pipeline:api" in " ".join(p.cmdline())}
    assert len(pids) == 2


def test_health_says_restarting_while_a_killed_engine_comes_back(tiny_model_dir: Path) -> None:
    """kill -9 of the executor: /health answers 503 "restarting" and requests get 503 with
    Retry-After while the engine is started again; then both are 200 again and serve goes on
    (a pipeline that fails, a crash loop, still exits 1: tests/test_restarts.py)."""
    with serve(tiny_model_dir) as s:
        assert httpx.get(f"{s.url}/health", timeout=10).json()["status"] == "ok"
        (executor,) = [p for p in s.descendants()
                       if "llm-pipeline:executor:0" in " ".join(p.cmdline())]
        os.kill(executor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while (r := httpx.get(f"{s.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200"
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "restarting", r.json()
        assert r.json()["engines_restarting"] == [0]
        body = {"model": s.model, "prompt": "hi", "max_tokens": 2}
        r = post(s, "/v1/completions", body, key=None)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.headers
        while (r := httpx.get(f"{s.url}/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline + 30, r.json()
            time.sleep(0.1)
        r = post(s, "/v1/completions", body, key=None)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert s.proc.poll() is None


def test_a_stage_that_keeps_dying_fails_the_pipeline_and_serve_exits_1(
        tiny_model_dir: Path) -> None:
    """A tokenizer killed again each time it comes back: after the restart policy's last
    restart the pipeline fails; /health names the stage (503), requests get 503 with
    Retry-After, then serve exits 1 so that a process supervisor sees it."""
    from pipeline.runtime.restarts import MAX_RESTARTS

    def tokenizer(s: Server, killed: set[int]) -> int | None:
        for p in s.descendants():
            with contextlib.suppress(psutil.Error):
                if p.pid not in killed and "llm-pipeline:tokenizer:0" in " ".join(p.cmdline()):
                    return p.pid
        return None

    with serve(tiny_model_dir) as s:
        deadline = time.monotonic() + 60
        killed: set[int] = set()
        for _ in range(MAX_RESTARTS + 1):
            while (pid := tokenizer(s, killed)) is None:  # (started again after the backoff)
                assert time.monotonic() < deadline, "tokenizer:0 was not started again"
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        while (r := httpx.get(f"{s.url}/health", timeout=10)).status_code == 200 \
                or "tokenizer:0" not in (r.json()["problem"] or ""):
            assert time.monotonic() < deadline, r.json()
            time.sleep(0.02)
        assert r.status_code == 503 and "died" in r.json()["problem"], r.json()
        body = {"model": s.model, "prompt": "hi", "max_tokens": 2}
        r = post(s, "/v1/completions", body, key=None)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert s.proc.wait(timeout=30) == 1


def test_a_killed_api_worker_comes_back_and_its_requests_are_aborted(
        tiny_model_dir: Path) -> None:
    """kill -9 of the API worker holding most of 32 open streams: serve keeps running and
    starts it again within 2 s; the other worker's streams end with [DONE]; the dead one's
    streams see their connection cut (an error, never a hang) and the engine aborts their
    requests instead of running them for nobody."""
    import threading

    with serve(tiny_model_dir, "--api-workers", "2", "--device", "timed:10,0") as s:
        aborted = aborted_name(s)
        before = stat(s, aborted)
        ends: list[str] = []
        opened = threading.Barrier(33, timeout=60)

        def stream() -> None:
            body = {"model": s.model, "prompt": "count", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            last, first = "", True
            try:
                with httpx.stream("POST", f"{s.url}/v1/completions", json=body,
                                  timeout=60) as r:
                    for line in r.iter_lines():
                        last = line or last
                        if first:
                            first = False
                            opened.wait()
                ends.append("done" if last == "data: [DONE]" else f"cut after {last[:40]}")
            except httpx.HTTPError as exc:
                ends.append(f"error {type(exc).__name__}")

        threads = [threading.Thread(target=stream) for _ in range(32)]
        for t in threads:
            t.start()
        opened.wait()  # every stream has its first event
        workers = [p for p in s.descendants() if "llm-pipeline:api:" in " ".join(p.cmdline())]
        victim = max(workers, key=lambda p: len(p.net_connections(kind="tcp")))
        title = " ".join(victim.cmdline())
        known = {p.pid for p in s.descendants()}
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2  # started again (a new process) ...
        while not [p for p in s.descendants() if p.pid not in known]:
            assert time.monotonic() < deadline, "the worker was not started again in 2 s"
            time.sleep(0.02)
        deadline = time.monotonic() + 30  # ... which names itself once it has imported
        while not [p for p in s.descendants() if p.pid != victim.pid and cmdline(p) == title]:
            assert time.monotonic() < deadline, "the new process is not the dead worker's"
            time.sleep(0.02)
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        cut = [e for e in ends if e != "done"]
        assert cut and len(cut) < 32, ends
        assert s.proc.poll() is None  # serve runs on
        deadline = time.monotonic() + 30
        while stat(s, aborted) < before + len(cut):
            assert time.monotonic() < deadline, f"aborted {stat(s, aborted) - before}: {ends}"
            time.sleep(0.1)
        while stat(s, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = post(s, "/v1/completions", {"model": s.model, "prompt": "hi", "max_tokens": 2},
                 key=None)
        assert r.status_code == 200, r.text


def test_sigterm_ends_every_stream_with_a_final_event(tiny_model_dir: Path) -> None:
    """A graceful stop: streams open when serve gets SIGTERM end with a final event and
    [DONE], not a cut connection."""
    import threading

    with serve(tiny_model_dir, "--api-workers", "2") as s:
        lines: list[list[str]] = [[] for _ in range(4)]
        started = threading.Barrier(5, timeout=60)

        def stream(i: int) -> None:
            body = {"model": s.model, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
                    "stream": True}  # far longer than the stop takes
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines[i].append(line)
                    if len(lines[i]) == 1 and line:
                        started.wait()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its first event
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        for got in lines:
            assert got[-1] == "data: [DONE]", got[-3:]
            last = json.loads(got[-2][len("data: "):])
            assert "shutting down" in last["error"]["message"], last  # ended now, and said so



def test_fuzzed_requests_get_4xx_never_5xx(server: Server) -> None:
    """1,000 malformed or mutated requests over HTTP: deeply nested bodies, bytes that are
    not JSON, odd chat message shapes, valid requests with a field replaced by junk. Every
    answer is 2xx or 4xx, and the server still answers a plain request afterwards."""
    import random

    rng = random.Random(11)
    junk = [None, True, -1, 0, 2**70, 1e308, "", "x" * 300, [], [1, "a"], {}, {"a": [None]},
            [[[]]], [{"role": "user"}], {"type": "text"}, [{"type": "image"}]]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop",
              "seed", "logprobs", "top_logprobs", "stream", "stream_options", "top_k",
              "stop_token_ids", "priority", "echo", "response_format", "tools", "tool_choice",
              "structured_outputs", "guided_regex", "prompt_logprobs"]

    def body(i: int) -> tuple[str, bytes]:
        chat = i % 2 == 0
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kind = i % 5
        if kind == 0:
            depth = rng.choice([70, 3000, 60_000])
            return path, b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        if kind == 1:
            return path, rng.randbytes(rng.randrange(1, 200))
        base: dict[str, object] = {"model": server.model, "max_tokens": 2}
        if chat:
            base["messages"] = [{"role": "user", "content": "hi"}]
        else:
            base["prompt"] = "hi"
        if kind == 2 and chat:
            base["messages"] = [rng.choice(junk) for _ in range(rng.randrange(1, 3))]
        elif kind == 3 and chat:
            base["messages"] = [{"role": rng.choice(junk + ["user"]),
                                 "content": rng.choice(junk + ["hi"])}]
        else:
            base[rng.choice(fields)] = rng.choice(junk)
        return path, json.dumps(base).encode()

    statuses: dict[int, int] = {}
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
        for i in range(1000):
            path, data = body(i)
            status = http.post(path, content=data).status_code
            statuses[status] = statuses.get(status, 0) + 1
        plain = http.post("/v1/completions", json={"model": server.model, "prompt": "hi",
                                                   "max_tokens": 2})
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.get(400, 0) > 500, statuses  # most of them are refused as malformed
    assert plain.status_code == 200


def test_an_access_line_per_request_and_a_periodic_engine_line(server: Server) -> None:
    """Printed by a live worker and by serve (--stats-interval 0.5 on the shared server);
    their absence with --no-access-log and --stats-interval 0: test_front_end.py."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while not (any(rid in line for line in server.log)
               and any("engine: prompt" in line for line in server.log)):
        assert time.monotonic() < deadline, server.log[-20:]
        time.sleep(0.1)
    access = next(line for line in server.log if rid in line)
    assert '"POST /v1/completions" 200' in access and "127.0.0.1" in access
    engine = next(line for line in server.log if "engine: prompt" in line)
    assert "generation" in engine and "KV cache" in engine and "device idle" in engine


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
