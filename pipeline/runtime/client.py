"""A client of a running pipeline, usable from any Python program (and thread, or asyncio).

It PUSHes requests to the tokenizer workers (ZeroMQ round-robins across them), aborts to the
scheduler, and binds its own reply socket; one I/O thread routes outputs to each request and
keeps the latest status the launcher publishes (health, scheduler counters).

In the process that started the pipeline: `pipeline.client()`. From any other process:
`PipelineClient.connect(run_dir)`, with the run directory the launcher printed (it holds
`pipeline.json`, the addresses). Every front end, the HTTP server included, goes through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ipc import curve
from ipc.channels import PullChannel, PushChannel, SubChannel
from ipc.codec import Codec
from ipc.curve import CurveKeys
from ipc.keys import proof
from ipc.messages import (
    WHOLE_REQUEST,
    AbortRequest,
    AddRequest,
    ChatMessage,
    ErrorKind,
    PipelineStatus,
    Reconcile,
    RequestOutput,
    RequestOutputs,
    SamplingParams,
    SchedulerStats,
    ToolSpec,
)
from ipc.params import MAX_RECONCILE_IDS
from pipeline.runtime.completion import CompletionOutput

if TYPE_CHECKING:
    from ipc.endpoints import Endpoints

STATUS_STALE_S = 3.0  # no status for this long: the pipeline is not answering
ENGINE_STAGES = ("scheduler", "executor")  # the processes of a data-parallel engine


KEY_ENV = "LLM_PIPELINE_KEY"  # the client key, for PipelineClient.connect over tcp://


ENDPOINTS_REQUEST = b"endpoints"


def endpoints_request(key: str) -> list[bytes]:
    """A remote client's request for the endpoints: a fresh nonce and the proof that it holds
    the client key (the key itself never crosses the network)."""
    nonce = secrets.token_hex(16)
    return [ENDPOINTS_REQUEST, nonce.encode(), proof(key, "endpoints", nonce).encode()]


def endpoints_answer(frames: list[bytes], key: str, endpoints_json: str) -> bytes:
    """The bootstrap socket's answer to endpoints_request: the endpoints with the proof that
    they come from a holder of the key (so no one in the middle can hand out another server
    key), or b"" where the request proves nothing."""
    if len(frames) != 3 or not key:
        return b""
    nonce, their_proof = frames[1].decode(errors="replace"), frames[2]
    if not hmac.compare_digest(their_proof, proof(key, "endpoints", nonce).encode()):
        return b""
    return json.dumps({"answer": endpoints_json,
                       "proof": proof(key, "endpoints answer", nonce, endpoints_json)}).encode()


def fetch_endpoints(address: str, key: str, timeout: float = 10.0) -> Endpoints:
    """Ask a pipeline's bootstrap socket (tcp://host:port) for its tcp:// endpoints, proving
    the key the pipeline was started with (it answers nothing useful without it), over
    CURVE (ipc/curve.py); the answer must prove the key in turn."""
    from ipc.endpoints import Endpoints

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    request = endpoints_request(key)
    try:
        curve.connect_bootstrap(sock, address)
        # Not blocking: a peer that refuses the handshake at once drops the only pipe, and a
        # REQ socket without one would wait for ever.
        if not curve.send_now(sock, request):
            raise PipelineError(f"no pipeline answered at {address}: the peer refused the "
                                "encrypted handshake")
        if not sock.poll(int(timeout * 1000)):
            raise PipelineError(f"no pipeline answered at {address} within {timeout:g} s")
        answer = sock.recv()
    finally:
        sock.close()
    if not answer:
        raise PipelineError(f"the pipeline at {address} refused the key (give the one it "
                            "printed at start-up, or its --listen-key)")
    try:
        reply = json.loads(answer)
        body, their_proof = reply["answer"], reply["proof"]
    except (ValueError, KeyError, TypeError):
        raise PipelineError(f"{address} answered something that is not a pipeline's "
                            "endpoints") from None
    nonce = request[1].decode()
    if not hmac.compare_digest(str(their_proof), proof(key, "endpoints answer", nonce, body)):
        raise PipelineError(f"the answer from {address} does not prove it holds the key: "
                            "not the pipeline (or not the key it was started with)")
    remote = Endpoints.from_json(body)
    # Reach the launcher's host by the name this address reached (the pipeline's own name
    # for itself may be one only it resolves, or localhost); stages that joined from other
    # hosts by theirs.
    host, own = _host_of(address), _host_of(remote.status)

    def reach(a: str) -> str:
        return _with_host(a, host) if _host_of(a) == own else a

    return dataclasses.replace(
        remote, key=key, tokenizers=tuple(map(reach, remote.tokenizers)),
        schedulers=tuple(map(reach, remote.schedulers)), status=reach(remote.status))


def _host_of(address: str) -> str:
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


def _with_host(address: str, host: str) -> str:
    return f"tcp://{host}:{address.rsplit(':', 1)[1]}"


def reachable_from(address: str) -> str:
    """The local IPv4 address of the interface that routes to the host of a tcp:// address.
    The pipeline connects back to it: a client behind NAT or a firewall that blocks that
    cannot receive outputs (and gets no first output: see PipelineClient.generate timeout)."""
    host = socket.gethostbyname(_host_of(address))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks a route
        return str(s.getsockname()[0])

logger = logging.getLogger(__name__)
Prompt = str | list[int] | list[ChatMessage]


class PipelineError(RuntimeError):
    """The pipeline stopped or failed while a request was in flight."""


def make_add_request(request_id: str, reply_to: str, prompt: Prompt,
                     params: SamplingParams, tools: Sequence[ToolSpec] = (),
                     chat_template_kwargs: str = "") -> AddRequest:
    """tools: the functions a chat's model may call (shown to it through the template);
    chat_template_kwargs: a chat's extra template variables (JSON text of an object)."""
    now, tools = time.time(), list(tools)
    if isinstance(prompt, str):
        return AddRequest(request_id, reply_to, prompt, None, None, params, now, tools)
    if prompt and all(isinstance(m, ChatMessage) for m in prompt):
        return AddRequest(request_id, reply_to, None, None, list(prompt), params, now, tools,  # type: ignore[arg-type]
                          chat_template_kwargs)
    return AddRequest(request_id, reply_to, None, list(prompt), None, params, now, tools)  # type: ignore[arg-type]


# A request's route: called with its outputs of one message from the pipeline, in order.
Deliver = Callable[[list[RequestOutput]], Any]


@dataclass(frozen=True)
class Health:
    """What the latest published status says. ok: every stage alive and answering."""

    ok: bool
    stages: dict[str, bool]
    problem: str | None  # why not ok: a dead stage, a failure, or no status for a while
    age_s: float  # seconds since the status was published (inf: none received yet)
    stats: SchedulerStats | None
    # Data-parallel engines down while others serve (the pipeline is ok, with less room).
    engines_down: list[int] = field(default_factory=list)
    # Engines being started again after a death (down meanwhile).
    engines_restarting: list[int] = field(default_factory=list)


class PipelineClient:
    """Thread-safe. `generate` blocks; `stream` is an async iterator of one request's deltas."""

    def __init__(self, endpoints: Endpoints, is_alive: Callable[[], bool] | None = None) -> None:
        self._ctx = zmq.Context()
        self._is_alive = is_alive
        self.endpoints = endpoints
        self.model_name, self.max_model_len = endpoints.model_name, endpoints.max_model_len
        self.lora_names = endpoints.lora_names  # adapters a request's model may name
        if endpoints.server_key:  # (--listen) every tcp:// socket under CURVE
            curve.install(self._ctx, CurveKeys.for_client(endpoints.key,
                                                          endpoints.server_key.encode()))
        self._inbox, self.reply_to = self._bind_reply_socket(endpoints)
        self._status_sub = SubChannel(self._ctx, endpoints.status, Codec([PipelineStatus]))
        self.status: PipelineStatus | None = None
        # Local times (this host's clock only: the pipeline's may differ).
        self._connected_at = self._status_at = time.monotonic()
        # One socket per tokenizer worker, taken in turn: the client knows which one holds
        # each request, so when one is restarted it can ask which of its requests were lost.
        self._key = key = endpoints.key.encode()
        ranks = endpoints.tokenizer_ranks or range(len(endpoints.tokenizers))
        self._tokenizers = {rank: PushChannel(self._ctx, address, bind=False, secret=key)
                            for rank, address in zip(ranks, endpoints.tokenizers, strict=True)}
        self._turns = list(self._tokenizers)  # the ranks requests go to, in turn
        self._next_tokenizer = 0
        self._restarts: dict[str, int] | None = None  # as last seen: "tokenizer:k" -> count
        # An abort goes to every engine: only the tokenizer that routed a request knows which
        # holds it, and an engine that does not know the id remembers it for a while.
        # ("": an engine not started yet; a remote client follows each engine's abort inbox
        # as it starts: _follow_joined)
        self._aborts: list[PushChannel | None] = [
            PushChannel(self._ctx, address, bind=False, secret=key) if address else None
            for address in endpoints.schedulers]
        self._abort_addresses = list(endpoints.schedulers)
        self._joined: set[str] = set()  # stages from other hosts this client follows
        self._send_lock = threading.Lock()
        # request id -> (deliver, samples still running, the tokenizer it was sent to)
        self._routes: dict[str, tuple[Deliver, int, int]] = {}
        self._routes_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._route_outputs, name="client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ plumbing

    def _bind_reply_socket(self, endpoints: Endpoints) -> tuple[PullChannel, str]:
        """This client's reply socket and the address the pipeline sends outputs to."""
        codec = Codec([RequestOutputs])
        if not endpoints.reply.startswith("tcp://"):
            address = f"{endpoints.reply}{uuid.uuid4().hex[:12]}.sock"
            return PullChannel(self._ctx, address, codec, bind=True), address
        # A remote client: listen on the interface that reaches the pipeline, any port.
        host = reachable_from(endpoints.schedulers[0])
        chan = PullChannel(self._ctx, [], codec, bind=True)
        port = curve.bind_as_client(chan.socket, host)
        return chan, f"tcp://{host}:{port}"

    @classmethod
    def connect(cls, where: str | Path, key: str | None = None,
                timeout: float = 10.0) -> PipelineClient:
        """A client of a pipeline running in another process: `where` is its run directory
        (same host: the key is read from there), or the tcp:// address it printed when
        started with --listen, with the key it printed (or $LLM_PIPELINE_KEY)."""
        from ipc.endpoints import Endpoints

        if str(where).startswith("tcp://"):
            key = key or os.environ.get(KEY_ENV)
            if not key:
                raise PipelineError(f"connecting to {where} needs the pipeline's key: pass "
                                    f"key=... or set ${KEY_ENV}")
            return cls(fetch_endpoints(str(where), key, timeout))
        return cls(Endpoints.load(where))

    def wait_for_status(self, timeout: float = 10.0) -> Health:
        """Block until the first status arrives (it is published a few times a second)."""
        deadline = time.monotonic() + timeout
        while self.status is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.health()

    def health(self) -> Health:
        status = self.status
        if status is None:
            waited = time.monotonic() - self._connected_at
            return Health(False, {}, f"no status received from the pipeline in {waited:.1f} s",
                          math.inf, None)
        age = time.monotonic() - self._status_at
        dead = [name for name, alive in status.stages.items() if not alive]
        down = [e for e, alive in enumerate(status.engines_alive) if not alive]
        if down and len(down) < len(status.engines_alive):  # the others serve
            dead = [name for name in dead if name.split(":")[0] not in ENGINE_STAGES]
        problem = status.failure or (f"stage {', '.join(dead)} is not running" if dead else None)
        if problem is None and down and len(down) == len(status.engines_alive):
            problem = ("the engine is restarting after a death; retry shortly"
                       if len(down) == 1 else
                       f"engines {down} are down (restarting: {status.engines_restarting})")
        if problem is None and age > STATUS_STALE_S:
            problem = f"the pipeline has not answered for {age:.1f} s"
        return Health(problem is None, dict(status.stages), problem, age, status.scheduler,
                      down, list(status.engines_restarting))

    def _route_outputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox.socket, zmq.POLLIN)
        poller.register(self._status_sub.socket, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if self._status_sub.socket in events:
                while (status := self._status_sub.recv_valid(0)) is not None:
                    assert isinstance(status, PipelineStatus)
                    self.status, self._status_at = status, time.monotonic()
                    self._reconcile(status.restarts)
                    self._follow_joined(status)
            if self._inbox.socket not in events:
                continue
            msg = self._inbox.recv_valid(0)
            if msg is None:
                continue
            assert isinstance(msg, RequestOutputs)
            self._deliver(self._routed(msg.all_outputs()))

    @staticmethod
    def _deliver(routed: list[tuple[Deliver, RequestOutput]]) -> None:
        """Each callback once, with its outputs of this message in order: generate's one
        callback takes a whole step's in one queue put (Queue's Python condition per output
        had taken a third of the client's CPU at 256 outputs a step)."""
        batches: dict[int, tuple[Deliver, list[RequestOutput]]] = {}
        for deliver, out in routed:
            batches.setdefault(id(deliver), (deliver, []))[1].append(out)
        for deliver, outs in batches.values():
            try:
                deliver(outs)
            except RuntimeError:  # its event loop is closed: nobody is listening
                pass

    def _reconcile(self, restarts: dict[str, int]) -> None:
        """For each tokenizer restarted since the last status, send it a Reconcile naming the
        unfinished requests this client had sent it: the scheduler answers an error for each
        one it never received (ipc.messages.Reconcile)."""
        if self._restarts is None:  # the first status: restarts before this client began
            self._restarts = dict(restarts)
            return
        for name, count in restarts.items():
            if count <= self._restarts.get(name, 0) or not name.startswith("tokenizer:"):
                continue
            self._restarts[name] = count
            rank = int(name.split(":")[1])
            if rank not in self._tokenizers:
                continue
            with self._send_lock:  # no request is between its route and its send
                if self._stop.is_set():
                    return
                with self._routes_lock:
                    ids = [rid for rid, (_, _, r) in self._routes.items() if r == rank]
                logger.warning("%s was restarted: checking %d requests sent to it", name,
                               len(ids))
                for i in range(0, len(ids), MAX_RECONCILE_IDS):
                    self._tokenizers[rank].send(
                        Reconcile(self.reply_to, rank, ids[i:i + MAX_RECONCILE_IDS]))

    def _follow_joined(self, status: PipelineStatus) -> None:
        """Stages that joined from other hosts since this client connected: an engine's abort
        inbox; for a remote client, a tokenizer (a local client's ipc:// reply socket is out
        of its reach). A joined tokenizer that left: the requests this client sent it end
        with an error, and are aborted wherever they run."""
        for name, address in status.joined.items():
            stage, _, index = name.partition(":")
            if name in self._joined or not index.isdigit():
                continue
            self._joined.add(name)
            rank = int(index)
            if stage == "scheduler":
                self._follow_abort_inbox(rank, address)
                continue
            with self._send_lock:
                if (stage == "tokenizer" and self.reply_to.startswith("tcp://")
                        and rank not in self._tokenizers):
                    self._tokenizers[rank] = PushChannel(self._ctx, address, bind=False,
                                                         secret=self._key)
                    self._turns.append(rank)
        for rank in [r for r in self._turns if f"tokenizer:{r}" in status.left]:
            self._tokenizer_left(rank)
        if self.reply_to.startswith("tcp://"):  # the launcher's host's engines, as they run
            for index, address in status.abort_inboxes.items():
                self._follow_abort_inbox(int(index), address)

    def _follow_abort_inbox(self, engine: int, address: str) -> None:
        """Engine `engine` listens for aborts at `address` now: one that joined, or, for a
        remote client, one of the launcher's host that started (again) on a port of its
        own."""
        if engine < len(self._abort_addresses) and self._abort_addresses[engine] == address:
            return
        with self._send_lock:
            grow = engine + 1 - len(self._aborts)
            self._aborts += [None] * grow
            self._abort_addresses += [""] * grow
            if (old := self._aborts[engine]) is not None:
                old.close()
            self._aborts[engine] = PushChannel(self._ctx, address, bind=False,
                                               secret=self._key)
            self._abort_addresses[engine] = address

    def _tokenizer_left(self, rank: int) -> None:
        with self._send_lock:
            self._turns.remove(rank)
            self._next_tokenizer = 0
        with self._routes_lock:
            ids = [rid for rid, (_, _, r) in self._routes.items() if r == rank]
        logger.warning("tokenizer:%d (joined from another host) left: failing the %d "
                       "requests sent to it", rank, len(ids))
        for rid in ids:
            self._abort_everywhere(rid)
        failed = [RequestOutput.refusal(rid, ErrorKind.UNAVAILABLE, f"tokenizer:{rank} left "
                                        "the pipeline while it held this request; send it "
                                        "again", None) for rid in ids]
        self._deliver(self._routed(failed))

    def _routed(self, outputs: list[RequestOutput]) -> list[tuple[Deliver, RequestOutput]]:
        """Each output with the callback of its request, under one lock for the whole batch;
        a request's route goes once its last sample has finished."""
        routed = []
        with self._routes_lock:
            for out in outputs:
                route = self._routes.get(out.request_id)
                if route is None:
                    continue
                deliver, remaining, rank = route
                if out.finished:
                    remaining = 0 if out.index == WHOLE_REQUEST else remaining - 1
                    if remaining:
                        self._routes[out.request_id] = (deliver, remaining, rank)
                    else:
                        del self._routes[out.request_id]
                if deliver is not None:
                    routed.append((deliver, out))
        return routed

    def _submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None,
                deliver: Deliver, tools: Sequence[ToolSpec] = (),
                chat_template_kwargs: str = "") -> str:
        request_id = request_id or uuid.uuid4().hex
        self._check_open()
        msg = make_add_request(request_id, self.reply_to, prompt, params, tools,
                               chat_template_kwargs)
        # The route and the send under one lock: a Reconcile either follows this request on
        # its socket or does not name it (see _reconcile).
        with self._send_lock:
            turn = self._next_tokenizer % len(self._turns)
            rank = self._turns[turn]
            with self._routes_lock:
                if request_id in self._routes:
                    raise ValueError(f"request id {request_id!r} is already in flight")
                self._routes[request_id] = (deliver, params.n, rank)
            self._next_tokenizer = turn + 1
            self._send_or_unroute(request_id, rank, msg)
        return request_id

    def _send_or_unroute(self, request_id: str, rank: int, msg: AddRequest) -> None:
        try:
            self._tokenizers[rank].send(msg)
        except BaseException:
            with self._routes_lock:
                self._routes.pop(request_id, None)
            raise

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise PipelineError("this client is closed (its pipeline stopped)")

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its last output has finish_reason 'abort'."""
        self._check_open()
        self._abort_everywhere(request_id)

    def _abort_everywhere(self, request_id: str) -> None:
        status = self.status
        alive = status.engines_alive if status is not None else []
        with self._send_lock:
            if self._stop.is_set():
                return
            for engine, chan in enumerate(self._aborts):  # (a down engine reads nothing)
                if chan is not None and (engine >= len(alive) or alive[engine]):
                    chan.send(AbortRequest(request_id))

    def _check_alive(self) -> None:
        self._check_open()
        if self._is_alive is not None:
            if not self._is_alive():
                raise PipelineError("the pipeline is no longer running")
            return
        health = self.health()
        never = self.status is None and time.monotonic() - self._connected_at > STATUS_STALE_S
        if never or (self.status is not None and not health.ok):
            raise PipelineError(f"the pipeline is not running: {health.problem}")

    # ------------------------------------------------------------ blocking API

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 timeout: float | None = None,
                 on_finished: Callable[[CompletionOutput], Any] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None
                 ) -> list[CompletionOutput]:
        """Run all prompts concurrently; outputs in input order. Errors are per output.
        on_finished: called with each output as it finishes (a progress bar);
        chat_template_kwargs: the chat template's extra variables, for conversations."""
        template = json.dumps(chat_template_kwargs) if chat_template_kwargs else ""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        inbox: queue.SimpleQueue[list[RequestOutput]] = queue.SimpleQueue()
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, all_params, strict=True):
            rid = uuid.uuid4().hex
            results[rid] = CompletionOutput(rid, max(p.n, 1), arrival_time=time.monotonic())
            order.append(self._submit(prompt, p, rid, inbox.put, (), template))
        self._collect(inbox, results, timeout, on_finished)
        return [results[rid] for rid in order]

    def _collect(self, inbox: queue.SimpleQueue[list[RequestOutput]],
                 results: dict[str, CompletionOutput],
                 timeout: float | None,
                 on_finished: Callable[[CompletionOutput], Any] | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(results)
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                for rid in pending:
                    self.abort(rid)
                raise TimeoutError(f"{len(pending)} requests did not finish in {timeout} s")
            try:
                outs = inbox.get(timeout=0.25)
            except queue.Empty:
                self._check_alive()
                continue
            for out in outs:
                result = results[out.request_id]
                result.add(out)
                if result.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    if on_finished is not None:
                        on_finished(result)

    # ------------------------------------------------------------ streaming API

    async def stream(self, prompt: Prompt, params: SamplingParams,
                     request_id: str | None = None, tools: Sequence[ToolSpec] = (),
                     chat_template_kwargs: str = "") -> AsyncIterator[RequestOutput]:
        """Yield one request's deltas as they come (each names its sample: `index`), until
        every sample has finished. Leaving the loop early aborts the request. tools: the
        functions a chat's model may call."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def put(outs: list[RequestOutput]) -> None:
            for out in outs:
                inbox.put_nowait(out)

        rid = self._submit(prompt, params, request_id,
                           lambda outs: loop.call_soon_threadsafe(put, outs), tools,
                           chat_template_kwargs)
        remaining = max(params.n, 1)
        finished = False
        try:
            while not finished:
                # Not asyncio.wait_for: before Python 3.12 it can swallow a cancellation that
                # coincides with an output, and the request would run on for nobody.
                getter = asyncio.ensure_future(inbox.get())
                try:
                    await asyncio.wait({getter}, timeout=0.5)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.cancelled() or not getter.done():
                    self._check_alive()
                    continue
                out = getter.result()
                if out.finished:
                    remaining = 0 if out.index == WHOLE_REQUEST else remaining - 1
                finished = remaining == 0
                yield out
        finally:
            if not finished and not self._stop.is_set():
                self.abort(rid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._send_lock:  # no other thread is inside a send on these sockets
            curve.destroy(self._ctx, linger=0)
