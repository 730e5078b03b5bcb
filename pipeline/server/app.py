"""The routes of the OpenAI-compatible HTTP front end (Starlette): authorization, rate limits,
admission, and plain or streamed answers. Runs in each of K worker processes that accept on one
listening socket and share one pipeline, each through its own PipelineClient, so the server is
one more client of the engine, not a way around it.

Routes: POST /v1/completions, /v1/chat/completions and /v1/responses (plain JSON or
server-sent events; a response kept with store: true is read back by GET /v1/responses/{id},
and forgotten by DELETE), POST /v1/embeddings (embeddings.py),
GET /v1/models, POST /tokenize and /detokenize (vLLM's), GET /version, GET /health (200 only
while every stage runs and answers), GET /metrics (Prometheus). A request whose client
disconnects is aborted in the engine. With allowed_origins, browsers may call it (CORS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.config import ServerOptions
from ipc.params import RequestError
from pipeline.runtime.client import PipelineClient
from pipeline.server.answers import AnswerReading
from pipeline.server.asgi import (
    AbortingStreamingResponse,
    AccessLog,
    libc,
    send_error,
    unless_hung_up,
    wait_for_disconnect,
)
from pipeline.server.embeddings import (
    collect_embeddings,
    model_pooling,
    new_embedding_id,
    parse_embeddings,
)
from pipeline.server.errors import ApiError, bad, shutting_down
from pipeline.server.generation import Generation
from pipeline.server.limits import RateLimiter
from pipeline.server.lora_updates import RuntimeLoras
from pipeline.server.openai_parse import (
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from pipeline.server.openai_render import new_id
from pipeline.server.responses import ResponseStore, parse_responses
from pipeline.server.responses_render import (
    ResponsesStream,
    new_response_id,
    response_sse,
    whole_response,
)
from stages.chat_template import template_kwargs

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the app


MAX_JSON_DEPTH = 64  # no field of the API nests deeper than a handful of levels


def parse_json_body(data: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400: not JSON, not an object, or nested deeper
    than MAX_JSON_DEPTH (json's own recursion limit is turned into the same 400)."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise bad("body", f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad("body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("body", "the body must be a JSON object")
    stack = [(body, 1)]
    while stack:  # an explicit stack: the check itself never recurses
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad("body", f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        stack += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
    return body


class FrontEnd:
    """The handlers, around one PipelineClient."""

    def __init__(self, client: PipelineClient, options: ServerOptions, vocab_size: int,
                 model_dir: str | None = None) -> None:
        """model_dir: the model's folder, for /tokenize and /detokenize (its tokenizer is
        loaded on their first use)."""
        from pipeline.server import metrics  # after PROMETHEUS_MULTIPROC_DIR is set

        self.client, self.options, self.vocab_size = client, options, vocab_size
        self.model_dir = model_dir
        self._tokenizer: Any = None
        self._tokenizer_lock = asyncio.Lock()
        self.reading = AnswerReading(options, model_dir, self.core)
        self.metrics: Any = metrics
        workers = max(1, options.api_workers)
        self.limiter = RateLimiter(options.rate_limit_rps / workers,
                                   math.ceil(options.rate_limit_concurrent / workers))
        self.model = client.model_name
        self.created = int(time.time())
        self.generations: set[Generation] = set()  # requests running in this worker
        self.kept = ResponseStore()  # /v1/responses with store: true, in this worker
        self.runtime_loras = RuntimeLoras(options.max_lora_rank, model_dir)  # (at run time)
        self.is_stopping = False
        self.num_admitted = 0  # generation requests this worker has taken and not answered
        self._trim_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop_soon(self) -> None:
        """The worker got SIGTERM: refuse new requests and end every running one with a final
        answer (an error event and [DONE] for a stream; a 503 for a plain request). Safe to
        call from a signal handler."""
        self.is_stopping = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_generations)

    def _stop_generations(self) -> None:
        for run in list(self.generations):
            run.stop()

    def app(self) -> Callable[[Any, Any, Any], Awaitable[None]]:
        """The ASGI app: generation requests are admitted (or refused, before their body is
        read or anything else is done: refusals stay fast under a flood) and counted here,
        the rest is Starlette's."""
        routes = self._routes()

        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            path = scope.get("path") if scope["type"] == "http" else None
            if path not in GENERATION_PATHS:
                await routes(scope, receive, send)
                return
            refusal = self._refusal()
            if refusal is not None:
                self.metrics.HTTP.labels(path, str(refusal.status)).inc()
                await send_error(send, refusal)
                return
            self.num_admitted += 1
            try:
                await routes(scope, receive, send)
            finally:
                self.num_admitted -= 1
                if not self.num_admitted and not self._trim_pending and libc is not None:
                    self._trim_pending = True  # once the connections have closed too
                    asyncio.get_running_loop().call_later(1.0, self._trim_memory)

        app: Any = asgi  # refusals too are logged, and carry CORS headers
        if self.options.access_log:
            app = AccessLog(app)
        if self.options.allowed_origins:  # answers preflights before anything else sees them
            app = CORSMiddleware(app, allow_origins=list(self.options.allowed_origins),
                                 allow_methods=["GET", "POST"], allow_headers=["*"],
                                 expose_headers=["x-request-id"])
        return app  # type: ignore[no-any-return]

    def _trim_memory(self) -> None:
        """Idle after a burst: hand the freed heap back to the system (glibc keeps it
        otherwise, and the worker's memory would stay at the burst's peak). A few
        milliseconds, at most once a second."""
        self._trim_pending = False
        if not self.num_admitted:
            libc.malloc_trim(0)

    def _routes(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.kept_response, methods=["GET", "DELETE"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.lora_update, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.lora_update, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ], exception_handlers={ApiError: self._api_error})  # type: ignore[dict-item]

    async def _api_error(self, request: Request, exc: ApiError) -> Response:
        self.metrics.HTTP.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    # ------------------------------------------------------------ plain routes

    async def health(self, request: Request) -> Response:
        h = self.client.health()
        state = "ok" if h.ok else "unavailable"
        if not h.ok and h.engines_restarting:  # no engine serves meanwhile
            state = "restarting"
        body = {"status": state, "problem": h.problem, "stages": h.stages,
                "engines_restarting": h.engines_restarting}
        return JSONResponse(body, 200 if h.ok else 503)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(lambda: self.client.status, self.model),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        """The model, then each LoRA adapter with the model as its parent and root (vLLM's
        listing): those of --lora-modules, then those loaded at run time."""
        self._authorize(request)
        card = {"object": "model", "created": self.created, "owned_by": "llm-pipeline",
                "max_model_len": self.client.max_model_len}
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, **card, "root": self.model, "parent": None},
            *({"id": name, **card, "root": self.model, "parent": self.model}
              for name in (*self.client.lora_names, *self.runtime_loras.folders))]})

    async def lora_update(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
        {"lora_name"} (vLLM's), served only with --enable-lora-updating (vLLM's gate is
        VLLM_ALLOW_RUNTIME_LORA_UPDATING, also honoured; without it vLLM has no such routes:
        404). A load checks the PEFT folder (read_adapter) and answers once a one-token
        request under the adapter has run: the scheduler gave it a slot and an id, the
        executor loaded its weights. An unload hides the name from new requests at once;
        requests already running under it finish (the scheduler evicts its weights once idle
        and its slot is wanted)."""
        self._authorize(request)
        path = request.url.path
        if not self.options.lora_updating:
            raise ApiError(404, f"{path}: loading and unloading LoRA adapters at run time is "
                                "off; start the server with --enable-lora-updating (or "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
                           None, "invalid_request_error", "not_found")
        body = await self._read_json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad("lora_name", "lora_name must be a non-empty string naming the adapter")
        if path.endswith("/unload_lora_adapter"):
            return Response(self.runtime_loras.unload(self.client.lora_names, name))
        return Response(await self.runtime_loras.load(
            self.client, (self.model, *self.client.lora_names), name, body.get("lora_path")))

    async def version(self, request: Request) -> Response:
        import pipeline

        return JSONResponse({"version": pipeline.__version__})

    async def core(self) -> Any:
        """The tokenizer stage's core (the same template and checks), loaded on first use."""
        if self.model_dir is None:
            raise ApiError(501, "this front end has no tokenizer (no model folder given)",
                           None, "server_error")
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                from stages.tokenizer import TokenizerCore

                self._tokenizer = await asyncio.to_thread(
                    TokenizerCore, self.model_dir, self.client.max_model_len, self.vocab_size)
        return self._tokenizer

    async def tokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._read_json(request)
        self._check_model(body)
        req = parse_tokenize(body)
        core = await self.core()
        try:
            if req.messages is not None:
                ids = core.chat_ids(req.messages, None,
                                    template_kwargs(req.chat_template_kwargs))
            else:
                ids = list(core.tokenizer(req.prompt,
                                          add_special_tokens=req.add_special_tokens)["input_ids"])
        except RequestError as exc:
            raise bad(exc.param or ("messages" if req.messages else "prompt"),
                      exc.message) from None
        return JSONResponse({"count": len(ids), "max_model_len": self.client.max_model_len,
                             "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await self._read_json(request)
        self._check_model(body)
        tokens = parse_detokenize(body, self.vocab_size)
        core = await self.core()
        return JSONResponse({"prompt": core.tokenizer.decode(tokens)})

    def _check_model(self, body: dict[str, Any]) -> str:
        """`model` may be left out (one model is served); if given it must be this one or
        one of its LoRA adapters. Returns the adapter's name ("": the model itself)."""
        model = body.get("model")
        if model is None or model == self.model:
            return ""
        if not isinstance(model, str):
            raise bad("model", "model must be a string naming the model (see GET /v1/models)")
        if model in self.client.lora_names or model in self.runtime_loras.folders:
            return model
        served = ", ".join(repr(m) for m in (self.model, *self.client.lora_names,
                                             *self.runtime_loras.folders))
        raise ApiError(404, f"the model {model!r} does not exist; this server has {served}",
                       "model", "invalid_request_error", "model_not_found")

    # ------------------------------------------------------------ generation routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, chat=True, responses=True)

    async def kept_response(self, request: Request) -> Response:
        self._authorize(request)
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            self.kept.delete(rid)
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        return JSONResponse(self.kept.get(rid, "response_id").response)

    async def embeddings(self, request: Request) -> Response:
        return await self._generate(request, chat=False, embed=True)

    async def _embed(self, request: Request) -> Response:
        """POST /v1/embeddings: one pooling request per input, through a Generation."""
        body = await self._read_json(request)
        if self._check_model(body):
            raise bad("model", "embeddings are served for the model itself, not under a LoRA "
                               "adapter")
        pooling = model_pooling(self.model_dir)
        req = parse_embeddings(body, self.vocab_size, pooling)
        host = request.client.host if request.client else "?"
        req.parsed.params = dataclasses.replace(req.parsed.params,
                                                user=f"{host}/{req.parsed.params.user}")
        self._loop = asyncio.get_running_loop()
        run = Generation(self, req.parsed, new_embedding_id())
        hangup = asyncio.create_task(wait_for_disconnect(request))
        try:
            try:
                await unless_hung_up(run.start(), hangup, run)
            except ApiError as exc:  # (the engine's names: the prompt is the input here,
                renamed = {"prompt": "input", "pooling": "model"}  # and pooling the model's)
                exc.param = renamed.get(exc.param or "", exc.param)
                raise
            result = await unless_hung_up(collect_embeddings(run, req, pooling, self.model),
                                           hangup, run)
        finally:
            hangup.cancel()
        self.metrics.HTTP.labels(request.url.path, "200").inc()
        return JSONResponse(result, headers={"x-request-id": run.rid})

    async def _generate(self, request: Request, chat: bool, responses: bool = False,
                        embed: bool = False) -> Response:
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
            response = await (self._embed(request) if embed
                              else self._run(request, chat, responses))
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
        return parse_json_body(bytes(data))

    def _refusal(self) -> ApiError | None:
        """Why a generation request cannot be taken now, if it cannot: this worker is
        stopping, the engine is down, or it is overloaded. Overload is counted here, as
        requests arrive (this worker's share of the engine's slots and waiting room), not
        only from the status the scheduler publishes a few times a second, which a burst
        outruns; the scheduler still refuses sequences past --max-waiting exactly."""
        if self.is_stopping:
            return shutting_down()
        h = self.client.health()
        if not h.ok:  # (an engine starting again serves within seconds: retry sooner)
            return ApiError(503, f"the engine is unavailable: {h.problem}", None,
                            "service_unavailable",
                            headers={"Retry-After": "2" if h.engines_restarting else "5"})
        waiting = h.stats.num_waiting if h.stats is not None else 0
        slots = h.stats.num_slots if h.stats is not None else 0  # of every engine serving
        status = self.client.status
        engines = sum(status.engines_alive) if status is not None and status.engines_alive else 1
        room = self.options.max_waiting * engines  # --max-waiting is each engine's
        share = math.ceil((slots + room) / max(1, self.options.api_workers))
        if waiting >= room or self.num_admitted >= share:
            return ApiError(503, f"the engine is overloaded ({waiting} sequences waiting, "
                                 f"{self.num_admitted} requests in this worker); retry "
                                 "shortly", None, "service_unavailable",
                            headers={"Retry-After": "1"})
        return None

    async def _run(self, request: Request, chat: bool, responses: bool = False) -> Response:
        body = await self._read_json(request)
        lora_name = self._check_model(body)
        asked = None
        if responses:  # the Responses API runs as a chat, rendered as Responses items
            asked = parse_responses(body, self.vocab_size, self.kept, self.options.api_workers)
            parsed = asked.parsed
        else:
            parsed = (parse_chat if chat else parse_completion)(body, self.vocab_size)
        # The scheduler shares the engine fairly between senders: here, each client address
        # and the user it names (OpenAI's `user`).
        host = request.client.host if request.client else "?"
        parsed.params = dataclasses.replace(parsed.params, user=f"{host}/{parsed.params.user}",
                                            lora_name=lora_name,
                                            lora_path=self.runtime_loras.path_of(lora_name))
        try:
            await self.reading.prepare(parsed, chat)
        except ApiError as exc:  # (a Responses request hears of its own fields)
            if asked is not None:
                asked.renamed(exc)
            raise
        self._loop = asyncio.get_running_loop()
        run = Generation(self, parsed, new_response_id() if asked else new_id(chat))
        # Until the response streams (Starlette then listens itself), a hang-up aborts here.
        hangup = asyncio.create_task(wait_for_disconnect(request))
        try:
            try:
                await unless_hung_up(run.start(), hangup, run)
            except ApiError as exc:  # (a refused prompt names the Responses field too)
                if asked is not None:
                    asked.renamed(exc)
                raise
            if parsed.stream:
                hangup.cancel()
                self.metrics.HTTP.labels(request.url.path, "200").inc()
                events = run.sse() if asked is None else response_sse(
                    run.chunks(), ResponsesStream(run.rid, run.model, asked.echo),
                    lambda response: self.kept.keep(asked, response))
                return AbortingStreamingResponse(run, events, media_type="text/event-stream",
                                                 headers={"x-request-id": run.rid})
            result = await unless_hung_up(run.collect(), hangup, run)
        finally:
            hangup.cancel()
        if asked is not None:
            result = whole_response(run.rid, run.model, asked.echo, result)
            self.kept.keep(asked, result)
        self.metrics.HTTP.labels(request.url.path, "200").inc()
        return JSONResponse(result, headers={"x-request-id": run.rid})


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                    "/v1/embeddings")
