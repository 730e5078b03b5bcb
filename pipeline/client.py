"""A client of a running pipeline, usable from any Python program (and thread, or asyncio).

It PUSHes requests to the tokenizer workers (ZeroMQ round-robins across them), aborts to the
scheduler, and binds its own reply socket; one I/O thread routes outputs to each request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.messages import (
    AbortRequest,
    AddRequest,
    ChatMessage,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
)

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)
Prompt = str | list[int] | list[ChatMessage]


class PipelineError(RuntimeError):
    """The pipeline stopped or failed while a request was in flight."""


@dataclass
class CompletionOutput:
    """The whole result of one request."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def add(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.error, self.finish_time = out.finish_reason, out.error, now


def make_add_request(request_id: str, reply_to: str, prompt: Prompt,
                     params: SamplingParams) -> AddRequest:
    if isinstance(prompt, str):
        return AddRequest(request_id, reply_to, prompt, None, None, params, time.time())
    if prompt and all(isinstance(m, ChatMessage) for m in prompt):
        return AddRequest(request_id, reply_to, None, None, list(prompt), params, time.time())  # type: ignore[arg-type]
    return AddRequest(request_id, reply_to, None, list(prompt), None, params, time.time())  # type: ignore[arg-type]


class PipelineClient:
    """Thread-safe. `generate` blocks; `stream` is an async iterator of one request's deltas."""

    def __init__(self, cfg: PipelineConfig, is_alive: Callable[[], bool] = lambda: True) -> None:
        self._ctx = zmq.Context()
        self._is_alive = is_alive
        self.reply_to = cfg.address(f"client-{uuid.uuid4().hex[:12]}")
        self._inbox = PullChannel(self._ctx, self.reply_to, Codec([RequestOutputs]), bind=True)
        self._requests = PushChannel(self._ctx, cfg.tokenizer_address(0), bind=False)
        for rank in range(1, cfg.num_tokenizers):
            self._requests.socket.connect(cfg.tokenizer_address(rank))
        self._aborts = PushChannel(self._ctx, cfg.scheduler_address, bind=False)
        self._send_lock = threading.Lock()
        self._routes: dict[str, Callable[[RequestOutput], Any]] = {}
        self._routes_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._route_outputs, name="client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ plumbing

    def _route_outputs(self) -> None:
        while not self._stop.is_set():
            msg = self._inbox.recv_valid(50)
            if msg is None:
                continue
            assert isinstance(msg, RequestOutputs)
            for out in msg.outputs:
                with self._routes_lock:
                    deliver = self._routes.get(out.request_id)
                    if out.finished:
                        self._routes.pop(out.request_id, None)
                if deliver is not None:
                    try:
                        deliver(out)
                    except RuntimeError:  # its event loop is closed: nobody is listening
                        pass

    def _submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None,
                deliver: Callable[[RequestOutput], Any]) -> str:
        request_id = request_id or uuid.uuid4().hex
        self._check_open()
        with self._routes_lock:
            if request_id in self._routes:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._routes[request_id] = deliver
        try:
            with self._send_lock:
                self._requests.send(make_add_request(request_id, self.reply_to, prompt, params))
        except BaseException:
            with self._routes_lock:
                self._routes.pop(request_id, None)
            raise
        return request_id

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise PipelineError("this client is closed (its pipeline stopped)")

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its last output has finish_reason 'abort'."""
        self._check_open()
        with self._send_lock:
            self._aborts.send(AbortRequest(request_id))

    def _check_alive(self) -> None:
        self._check_open()
        if not self._is_alive():
            raise PipelineError("the pipeline is no longer running")

    # ------------------------------------------------------------ blocking API

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 timeout: float | None = None) -> list[CompletionOutput]:
        """Run all prompts concurrently; outputs in input order. Errors are per output."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        inbox: queue.Queue[RequestOutput] = queue.Queue()
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, all_params, strict=True):
            rid = uuid.uuid4().hex
            results[rid] = CompletionOutput(rid, arrival_time=time.monotonic())
            order.append(self._submit(prompt, p, rid, inbox.put))
        self._collect(inbox, results, timeout)
        return [results[rid] for rid in order]

    def _collect(self, inbox: queue.Queue[RequestOutput], results: dict[str, CompletionOutput],
                 timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(results)
        while pending:
            try:
                out = inbox.get(timeout=0.25)
            except queue.Empty:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    for rid in pending:
                        self.abort(rid)
                    raise TimeoutError(
                        f"{len(pending)} requests did not finish in {timeout} s") from None
                continue
            results[out.request_id].add(out)
            if out.finished:
                pending.discard(out.request_id)

    # ------------------------------------------------------------ streaming API

    async def stream(self, prompt: Prompt, params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield one request's deltas as they come. Leaving the loop early aborts it."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self._submit(prompt, params, request_id,
                           lambda out: loop.call_soon_threadsafe(inbox.put_nowait, out))
        finished = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(inbox.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    self._check_alive()
                    continue
                finished = out.finished
                yield out
        finally:
            if not finished and not self._stop.is_set():
                self.abort(rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)
