"""The server's options where they act, on the front end (FrontEnd.app(), the ASGI app a
worker runs) over httpx's ASGI transport, with a fake pipeline client instead of a server
process: rate limits answer 429 with Retry-After, a burst past the engine's room is refused
at once, the access log has a line per request or none; and `run_pipeline serve`'s flags
reach ServerOptions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ipc.config import ServerOptions
from ipc.messages import FinishReason, RequestOutput, SamplingParams, SchedulerStats

V = 1000
IDLE = SchedulerStats(*([0] * 12))


@dataclass
class Health:
    ok: bool = True
    problem: str | None = None
    stats: SchedulerStats | None = IDLE
    stages: Any = None


class FakePipeline:
    """What FrontEnd uses of a PipelineClient: every request gets two tokens, "ok"."""

    model_name = "m"
    max_model_len = 64
    status = None

    def __init__(self, stats: SchedulerStats = IDLE, seconds: float = 0.0) -> None:
        self.stats, self.seconds = stats, seconds  # what health says; how long a request runs
        self.submitted: list[str] = []

    def health(self) -> Health:
        return Health(stats=self.stats)

    async def stream(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                     tools: Any = (), chat_template_kwargs: str = ""
                     ) -> AsyncIterator[RequestOutput]:
        self.submitted.append(request_id or "")
        await asyncio.sleep(self.seconds)
        yield RequestOutput(request_id or "", "ok", [5, 6], True, FinishReason.LENGTH, None,
                            3, 2)

    def abort(self, request_id: str) -> None:
        pass


def front_end(tmp_path: Any, monkeypatch: Any, fake: FakePipeline | None = None,
              **options: Any) -> tuple[Any, FakePipeline]:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from pipeline.server.app import FrontEnd

    fake = fake or FakePipeline()
    return FrontEnd(fake, ServerOptions(**options), V).app(), fake  # type: ignore[arg-type]


def post(app: Any, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json=body, headers=headers)

    return asyncio.run(go())


BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def test_rate_limits_answer_429_with_retry_after(tmp_path: Any, monkeypatch: Any) -> None:
    app, fake = front_end(tmp_path, monkeypatch, rate_limit_rps=1.0, rate_limit_concurrent=1)
    codes = [post(app, BODY) for _ in range(3)]
    assert codes[0].status_code == 200 and codes[0].json()["choices"][0]["text"] == "ok"
    limited = [r for r in codes[1:] if r.status_code == 429]
    assert limited and int(limited[0].headers["retry-after"]) >= 1
    assert limited[0].json()["error"]["type"] == "rate_limit_error"
    assert len(fake.submitted) == 3 - len(limited)  # a refused request never reached it
    time.sleep(1.1)
    assert post(app, BODY).status_code == 200


def test_a_burst_past_the_engines_room_is_refused_at_once(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    """40 requests at once where the engine has 4 slots and 4 waiting places: the worker
    counts what it admits as they arrive (the published status, a few times a second, still
    says nothing waits), so 8 go in and the other 32 get 503 with Retry-After at once, while
    the 8 run; none is lost."""
    room = SchedulerStats(num_blocks=64, num_free_blocks=64, num_slots=4, num_free_slots=4,
                          num_ring_slots=3, num_free_ring_slots=3, num_inflight_steps=0,
                          num_waiting=0, num_running=0, num_requests=0, num_preemptions=0,
                          num_steps=0)
    app, fake = front_end(tmp_path, monkeypatch, FakePipeline(room, seconds=1.0),
                          max_waiting=4)

    async def burst() -> list[tuple[httpx.Response, float]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            async def one() -> tuple[httpx.Response, float]:
                start = time.monotonic()
                r = await client.post("/v1/completions", json=BODY)
                return r, time.monotonic() - start

            return list(await asyncio.gather(*(one() for _ in range(40))))

    answers = asyncio.run(burst())
    codes = [r.status_code for r, _ in answers]
    assert codes.count(200) == 8 and codes.count(503) == 32, codes
    for r, seconds in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and seconds < 0.5
            assert "overloaded" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 2 and seconds >= 1.0
    assert len(fake.submitted) == 8  # the refused never reached the engine


def test_an_access_line_per_request_or_none(tmp_path: Any, monkeypatch: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """The line's content (client, method and path, status, request id); with
    --no-access-log none. (A live worker printing it: test_server.py.)"""
    app, _ = front_end(tmp_path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="llm_pipeline.access"):
        r = post(app, BODY)
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "llm_pipeline.access"]
    assert line.startswith('10.0.0.7 "POST /v1/completions" 200 ')
    assert line.endswith(r.headers["x-request-id"])
    caplog.clear()
    quiet, _ = front_end(tmp_path, monkeypatch, access_log=False)
    with caplog.at_level(logging.INFO, logger="llm_pipeline.access"):
        assert post(quiet, BODY).status_code == 200
    assert [rec for rec in caplog.records if rec.name == "llm_pipeline.access"] == []


def test_serve_flags_reach_the_server_options(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import build_parser
    from pipeline.server.serve import EngineStatsLog, server_options

    args = build_parser().parse_args([
        "serve", "--rate-limit-rps", "1", "--rate-limit-concurrent", "1", "--no-access-log",
        "--stats-interval", "0", "--api-workers", "2", "--max-waiting", "4"])
    options = server_options(args)
    assert (options.rate_limit_rps, options.rate_limit_concurrent) == (1.0, 1)
    assert options.access_log is False and options.api_workers == 2
    assert options.max_waiting == 4
    assert server_options(build_parser().parse_args(["serve"])).access_log is True
    assert args.stats_interval == 0
    for interval in (args.stats_interval, 0.5):  # 0: never a line
        log = EngineStatsLog(interval)
        log.maybe_log(IDLE)
        log._last = (time.monotonic() - 60, IDLE)  # a minute since the last line
        log.maybe_log(IDLE)
    assert capsys.readouterr().err.count("engine: prompt") == 1  # the 0.5 s one's


def test_runtime_lora_routes_are_gated(tmp_path: Any, monkeypatch: Any) -> None:
    """Without --enable-lora-updating (or vLLM's env var) the routes answer 404 naming the
    flag; the flag takes one API worker."""
    from ipc.errors import ConfigError
    from pipeline.cli import build_parser
    from pipeline.server.serve import server_options

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app, fake = front_end(tmp_path, monkeypatch)

    async def go(route: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(f"/v1/{route}", json={"lora_name": "a", "lora_path": "/x"})

    for route in ("load_lora_adapter", "unload_lora_adapter"):
        r = asyncio.run(go(route))
        assert r.status_code == 404 and "--enable-lora-updating" in r.json()["error"]["message"]
    assert fake.submitted == []
    parse = build_parser().parse_args
    assert server_options(parse(["serve"])).lora_updating is False
    assert server_options(parse(["serve", "--enable-lora-updating"])).lora_updating is True
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert server_options(parse(["serve"])).lora_updating is True
    with pytest.raises(ConfigError, match="--api-workers 2"):
        server_options(parse(["serve", "--api-workers", "2"]))
