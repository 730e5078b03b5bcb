"""The HTTP front end's ASGI pieces, beside its routes (app.py), in each API worker: the access
log, error answers in raw ASGI, a hang-up watch that aborts a request's engine work, and the
streaming response that aborts its requests however it ends."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pipeline.server.errors import ApiError
from pipeline.server.generation import Generation

access_logger = logging.getLogger("llm_pipeline.access")


class AccessLog:
    """One line per HTTP request: client, method and path, status, seconds (for a stream,
    until its last byte), and the request id of a generation."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status, rid = time.perf_counter(), 0, ""

        async def sending(message: Any) -> None:
            nonlocal status, rid
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = next((v.decode() for k, v in message.get("headers", ())
                            if k == b"x-request-id"), "")
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("?", 0)
            access_logger.info('%s "%s %s" %d %.3fs%s', client[0], scope["method"],
                               scope["path"], status, time.perf_counter() - start,
                               f" {rid}" if rid else "")


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


libc = _load_libc()  # (malloc_trim: None off glibc)


async def send_error(send: Any, error: ApiError) -> None:
    """An error answer in raw ASGI (no request read, no Starlette objects: cheap)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(work: Any, hangup: asyncio.Task[None], run: Generation) -> Any:
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
