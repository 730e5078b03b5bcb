"""The OpenAI-compatible HTTP front end: Starlette on uvicorn (uvloop, httptools). Runs in K
worker processes that accept on one listening socket and share one pipeline, each through
its own PipelineClient, so this module is one more client of the engine, not a way around it.

Routes: POST /v1/completions and /v1/chat/completions (plain JSON or server-sent events),
GET /v1/models, GET /health (200 only while every stage runs and answers), GET /metrics
(Prometheus). A request whose client disconnects is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ipc.messages import WHOLE_REQUEST, RequestOutput
from pipeline.client import PipelineClient, PipelineError
from pipeline.openai_api import (
    ApiError,
    Choice,
    ParsedRequest,
    bad,
    chunk_json,
    new_id,
    output_error,
    parse_chat,
    parse_completion,
    response_json,
    usage_chunk,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_workers: int = 1
    max_body_bytes: int = 4 << 20
    rate_limit_rps: float = 0.0  # per API key and per client address; 0: off
    rate_limit_concurrent: int = 0  # requests at once, per key and per address; 0: off
    max_waiting: int = 1024  # sequences waiting in the scheduler before new requests get 503


# ---------------------------------------------------------------- rate limiting


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


# ---------------------------------------------------------------- the app


class FrontEnd:
    """The handlers, around one PipelineClient."""

    def __init__(self, client: PipelineClient, options: ServerOptions, vocab_size: int) -> None:
        from pipeline import metrics  # after PROMETHEUS_MULTIPROC_DIR is set

        self.client, self.options, self.vocab_size = client, options, vocab_size
        self.metrics: Any = metrics
        workers = max(1, options.api_workers)
        self.limiter = RateLimiter(options.rate_limit_rps / workers,
                                   math.ceil(options.rate_limit_concurrent / workers))
        self.model = client.model_name
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ], exception_handlers={ApiError: self._api_error})  # type: ignore[dict-item]

    async def _api_error(self, request: Request, exc: ApiError) -> Response:
        self.metrics.HTTP.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    # ------------------------------------------------------------ plain routes

    async def health(self, request: Request) -> Response:
        h = self.client.health()
        body = {"status": "ok" if h.ok else "unavailable", "problem": h.problem,
                "stages": h.stages}
        return JSONResponse(body, 200 if h.ok else 503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(lambda: self.client.status),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created,
            "owned_by": "llm-pipeline", "max_model_len": self.client.max_model_len}]})

    # ------------------------------------------------------------ generation routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        key = self._authorize(request)
        identities = [f"addr:{request.client.host if request.client else '?'}"]
        if key is not None:
            identities.append(f"key:{key}")
        taken: list[str] = []
        try:
            for identity in identities:
                wait = self.limiter.acquire(identity)
                if wait is not None:
                    raise ApiError(429, f"rate limit reached for {identity.split(':')[0]}; "
                                   f"retry in {wait:.1f} s", None, "rate_limit_error",
                                   headers={"Retry-After": str(max(1, math.ceil(wait)))})
                taken.append(identity)
            response = await self._run(request, chat)
        except BaseException:
            for identity in taken:
                self.limiter.release(identity)
            raise
        if isinstance(response, AbortingStreamingResponse):  # released when the stream ends
            response.on_close.append(lambda: [self.limiter.release(i) for i in taken])
        else:
            for identity in taken:
                self.limiter.release(identity)
        return response

    def _authorize(self, request: Request) -> str | None:
        expected = self.options.api_key
        if expected is None:
            return None
        header = request.headers.get("authorization", "")
        given = header[7:] if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise ApiError(401, "invalid or missing API key (use the header "
                                "'Authorization: Bearer KEY')", None, "authentication_error",
                           "invalid_api_key")
        return given

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.options.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body has {length} bytes; the limit is {limit}")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes")
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise bad("body", f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad("body", "the body must be a JSON object")
        return body

    def _check_capacity(self) -> None:
        h = self.client.health()
        if not h.ok:
            raise ApiError(503, f"the engine is unavailable: {h.problem}", None,
                           "service_unavailable", headers={"Retry-After": "5"})
        if h.stats is not None and h.stats.num_waiting >= self.options.max_waiting:
            raise ApiError(503, f"the engine is overloaded ({h.stats.num_waiting} sequences "
                                f"waiting); retry shortly", None, "service_unavailable",
                           headers={"Retry-After": "1"})

    async def _run(self, request: Request, chat: bool) -> Response:
        body = await self._read_json(request)
        model = body.get("model")
        if not isinstance(model, str):
            raise bad("model", "model must be a string naming the model (see GET /v1/models)")
        if model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server has "
                                f"{self.model!r}", "model", "invalid_request_error",
                           "model_not_found")
        parsed = (parse_chat if chat else parse_completion)(body, self.vocab_size)
        self._check_capacity()
        run = Generation(self, parsed, new_id(chat))
        # Until the response streams (Starlette then listens itself), a hang-up aborts here.
        hangup = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await _unless_hung_up(run.start(), hangup, run)
            if parsed.stream:
                hangup.cancel()
                self.metrics.HTTP.labels(request.url.path, "200").inc()
                return AbortingStreamingResponse(run, run.sse(), media_type="text/event-stream",
                                                 headers={"x-request-id": run.rid})
            result = await _unless_hung_up(run.collect(), hangup, run)
        finally:
            hangup.cancel()
        self.metrics.HTTP.labels(request.url.path, "200").inc()
        return JSONResponse(result, headers={"x-request-id": run.rid})


async def _wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_hung_up(work: Any, hangup: asyncio.Task[None], run: Generation) -> Any:
    """Await `work`, unless the client disconnects first: then abort everything it started."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        run.cancel()  # the engine aborts the requests
        raise ApiError(499, "the client closed the connection")
    return task.result()


class AbortingStreamingResponse(StreamingResponse):
    """A stream whose requests are aborted however it ends. Starlette cancels the streaming
    task on a disconnect, which can leave the body generator suspended (not closed) until it
    is garbage collected; so the requests are cancelled here, not in the generator."""

    def __init__(self, run: Generation, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run = run
        self.on_close: list[Callable[[], object]] = []  # run however the response ends

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel()
            for callback in self.on_close:
                callback()


class Generation:
    """One API request: its prompts (each with n samples) running in the engine, merged into
    one stream of (choice index, output). Leaving before the end aborts what still runs."""

    def __init__(self, front: FrontEnd, parsed: ParsedRequest, rid: str) -> None:
        self.front, self.parsed, self.rid = front, parsed, rid
        self.n = parsed.params.n
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self._early: list[tuple[int, RequestOutput]] = []  # read by start(), yielded first
        self._done_feeds = 0
        self.prompt_tokens = [0] * len(parsed.prompts)
        self.cached_tokens = [0] * len(parsed.prompts)  # of each prompt, from the prefix cache
        self.start_time = time.perf_counter()
        self.last_token_time: dict[int, float] = {}
        self.first_token_seen = False

    async def _feed(self, i: int) -> None:
        stream = self.front.client.stream(self.parsed.prompts[i], self.parsed.params,
                                          f"{self.rid}-{i}")
        try:
            async with contextlib.aclosing(stream):  # closed (so aborted) however this ends
                async for out in stream:
                    self.queue.put_nowait((i, out))
        except PipelineError as exc:
            self.queue.put_nowait((i, _whole_error(f"{self.rid}-{i}",
                                                   f"{UNAVAILABLE}: {exc}")))
        except Exception as exc:  # never leave the request waiting for an output
            logger.exception("request %s-%d failed in the front end", self.rid, i)
            self.queue.put_nowait((i, _whole_error(f"{self.rid}-{i}",
                                                   f"front-end error: {exc}")))
        finally:
            self.queue.put_nowait(None)

    async def start(self) -> None:
        """Submit every prompt and wait for each one's first output, so that a request the
        engine refuses (a prompt too long, say) is answered with an HTTP error, not a stream."""
        self.tasks = [asyncio.create_task(self._feed(i)) for i in range(len(self.parsed.prompts))]
        unanswered = set(range(len(self.parsed.prompts)))
        try:
            while unanswered:
                item = await self._next()
                if item is None:  # cannot happen: every feed reports before it ends
                    raise ApiError(500, "the request ended without an answer", None,
                                   "server_error")
                i, out = item
                unanswered.discard(i)
                self._early.append(item)
                if out.index == WHOLE_REQUEST or (out.finished and out.error):
                    param = "messages" if self.parsed.chat else "prompt"
                    raise output_error(out, param)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, output), or None once every feed has ended."""
        while self._done_feeds < len(self.tasks):
            item = await self.queue.get()
            if item is not None:
                return item
            self._done_feeds += 1
        return None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every sample of every prompt has finished."""
        try:
            for i, out in self._early:
                yield self._record(i, out)
            while (item := await self._next()) is not None:
                yield self._record(*item)
            self.front.metrics.E2E.observe(time.perf_counter() - self.start_time)
        finally:
            self.cancel()

    def _record(self, i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        self.prompt_tokens[i] = out.num_prompt_tokens
        if out.index == 0:
            self.cached_tokens[i] = out.num_cached_tokens
        choice = i * self.n + max(out.index, 0)
        if out.token_ids:
            now = time.perf_counter()
            if not self.first_token_seen:
                self.first_token_seen = True
                self.front.metrics.TTFT.observe(now - self.start_time)
            last = self.last_token_time.get(choice)
            if last is not None:  # tokens that came together share the gap: one each
                k = len(out.token_ids)
                for _ in range(k):
                    self.front.metrics.ITL.observe((now - last) / k)
            elif len(out.token_ids) > 1:
                for _ in range(len(out.token_ids) - 1):
                    self.front.metrics.ITL.observe(0.0)
            self.last_token_time[choice] = now
        return choice, out

    async def collect(self) -> dict[str, Any]:
        """The whole response (the caller aborts it if the client goes away meanwhile)."""
        choices = [Choice(c) for c in range(len(self.parsed.prompts) * self.n)]
        errors: list[str] = []
        async for c, out in self.outputs():
            ch = choices[c]
            ch.text += out.text
            ch.token_ids += out.token_ids
            ch.logprobs += out.logprobs or []
            if out.finished:
                ch.finish_reason, ch.stop_reason = out.finish_reason, out.stop_reason
                if out.error:
                    errors.append(out.error)
        if errors:
            raise ApiError(500, f"the engine failed the request: {errors[0]}", None,
                           "server_error")
        p = self.parsed
        return response_json(self.rid, self.front.model, p.chat, choices, sum(self.prompt_tokens),
                             p.params.logprobs is not None, sum(self.cached_tokens))

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        p = self.parsed
        created = int(time.time())
        want_lp = p.params.logprobs is not None
        completion_tokens = 0
        offsets: dict[int, int] = {}
        try:
            if p.chat:
                for c in range(len(p.prompts) * self.n):
                    yield _event(chunk_json(self.rid, self.front.model, True, c, None, want_lp,
                                            created, role=True))
            async for c, out in self.outputs():
                completion_tokens += len(out.token_ids)
                if out.finished and out.error:
                    yield _event({"error": {"message": out.error, "type": "server_error",
                                            "param": None, "code": None}})
                    continue
                if not (out.text or out.token_ids or out.finished):
                    continue
                yield _event(chunk_json(self.rid, self.front.model, p.chat, c, out, want_lp,
                                        created, text_offset=offsets.get(c, 0)))
                offsets[c] = offsets.get(c, 0) + len(out.text)
            if p.include_usage:
                yield _event(usage_chunk(self.rid, self.front.model, p.chat, created,
                                         sum(self.prompt_tokens), completion_tokens,
                                         sum(self.cached_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()  # a disconnected client lands here: its requests are aborted


UNAVAILABLE = "engine unavailable"


def _whole_error(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, "", [], True, "error", message, 0, 0, WHOLE_REQUEST)


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- worker processes


def listening_socket(host: str, port: int) -> socket.socket:
    """The one listening socket, bound by the serving process and handed to every worker,
    which all accept on it. Not SO_REUSEPORT: a second server on the same port fails to
    start instead of silently taking half of the connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart past TIME_WAIT
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _exit_with_parent(parent_pid: int, server: Any) -> None:
    while os.getppid() == parent_pid and not server.should_exit:
        time.sleep(0.25)
    server.should_exit = True


def run_api_worker(run_dir: str, options: ServerOptions, vocab_size: int, rank: int,
                   parent_pid: int, sock: socket.socket) -> None:
    """Entry of one front-end worker process (spawned by `run_pipeline serve`)."""
    import uvicorn

    try:
        from setproctitle import setproctitle

        setproctitle(f"llm-pipeline:api:{rank}")
    except ImportError:
        pass
    client = PipelineClient.connect(run_dir)
    client.wait_for_status()  # so that /health and the first requests know how things stand
    front = FrontEnd(client, options, vocab_size)
    config = uvicorn.Config(front.app(), loop="uvloop", http="httptools", lifespan="off",
                            log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    threading.Thread(target=_exit_with_parent, args=(parent_pid, server), daemon=True).start()
    ready_file(run_dir, rank).write_text(str(os.getpid()))  # the socket already listens
    try:
        server.run(sockets=[sock])
    finally:
        client.close()


def ready_file(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / f"api-{rank}.ready"
