"""The tokenizer worker's side of the engines (runs in each tokenizer process): sends each
tokenized request to the engine the router picks, passes a client's Reconcile to every engine
and answers the client for the ids none holds, and fails what it sent to an engine that died."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ipc.messages import (
    AbortRequest,
    EngineReconcile,
    ErrorKind,
    Message,
    Reconcile,
    ReconcileAnswer,
    RequestOutput,
    RequestOutputs,
    TokenizedRequest,
)
from stages.router import EngineRouter, NoEngine

logger = logging.getLogger(__name__)

RECENT_ROUTE_S = 10.0  # an engine announces a request to its detokenizer well within this
# An engine that has not answered by then holds none of the ids (a dead one is known dead
# from the status well before; this is for one that hangs).
RECONCILE_TIMEOUT_S = 30.0


def error_output(request_id: str, kind: ErrorKind, message: str,
                 param: str | None = None) -> RequestOutputs:
    return RequestOutputs([RequestOutput.refusal(request_id, kind, message, param)])


@dataclass
class _PendingReconcile:
    reply_to: str
    request_ids: list[str]
    waiting: set[int]  # engines that have not answered
    deadline: float
    known: set[str] = field(default_factory=set)


class Dispatcher:
    """Pure: sockets are the callables. send(engine, msg) reaches an engine's scheduler;
    reply(address, outputs) reaches a client."""

    def __init__(self, router: EngineRouter, rank: int, send: Callable[[int, Message], object],
                 reply: Callable[[str, RequestOutputs], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router, self.rank = router, rank
        self._send, self._reply, self._clock = send, reply, clock
        self.alive = [True] * router.num_engines  # as the status says
        self.up = [True] * router.num_engines  # the roster names its address
        self.serving = [True] * router.num_engines  # both: it is routed to
        self._why: dict[str, str] = {}  # engine -> why it is down, as the status says
        # (time, engine, request id, reply address) of each request sent lately: what an
        # engine that dies may hold before its detokenizer knows of it (EngineDown).
        self._recent: deque[tuple[float, int, str, str]] = deque()
        self._pending: dict[int, _PendingReconcile] = {}
        # Random: answers to a predecessor's reconcile may reach this worker (its address).
        self._nonces = itertools.count(secrets.randbits(62))

    def forward(self, req: TokenizedRequest) -> None:
        try:
            engine = self.router.route(req.prompt_token_ids,
                                       len(req.prompt_token_ids) * req.params.n,
                                       req.params.lora_name)
        except NoEngine as exc:  # (with why each is down, as the status says)
            why = "; ".join(f"engine {e}: {w}" for e, w in sorted(self._why.items()))
            self._reply(req.reply_to, error_output(req.request_id, ErrorKind.UNAVAILABLE,
                                                   f"{exc}" + (f" ({why})" if why else "")))
            return
        now = self._clock()
        self._recent.append((now, engine, req.request_id, req.reply_to))
        while self._recent and now - self._recent[0][0] > RECENT_ROUTE_S:
            self._recent.popleft()
        self._send(engine, req)

    def set_engines(self, up: Sequence[bool], why: Mapping[str, str] | None = None) -> None:
        """The engines the roster names (Members): one that joined from another host is
        routed to once its address is known; one that left is down (why: as set_status's,
        which the roster may bring first)."""
        self._why.update(why or {})
        extra = len(up) - len(self.alive)
        if extra > 0:
            self.router.grow(len(up))
            self.alive += [True] * extra
            self.serving += [False] * extra
        self.up = [bool(x) for x in up] + [False] * (len(self.alive) - len(up))
        self._apply(list(self.router.loads))

    def set_status(self, loads: Sequence[int], alive: Sequence[bool],
                   why: Mapping[str, str] | None = None) -> None:
        """The engines' published loads and liveness (and why those down are: "E" -> the
        death); an engine seen dead for the first time fails the requests sent to it lately.
        (An engine the status names before this worker's roster does waits for the roster:
        its address comes with it.)"""
        n = len(self.alive)
        if len(alive) < n or len(loads) < n:
            return  # a stale status, from before an engine joined
        # (An engine started again after its death serves again: the status says when.)
        self.alive = [bool(b) for b in alive[:n]]
        self._why = dict(why or {})
        self._apply(loads[:n])

    def _apply(self, loads: Sequence[int]) -> None:
        """An engine serves while it is alive and the roster has its address."""
        serving = [a and u for a, u in zip(self.alive, self.up, strict=True)]
        self.router.set_loads(loads, serving)
        for engine, now_serving in enumerate(serving):
            if self.serving[engine] and not now_serving:
                self._engine_down(engine)
        self.serving = serving

    def _engine_down(self, engine: int) -> None:
        logger.warning("engine %d is down: failing the requests sent to it lately", engine)
        why = self._why.get(str(engine), "its scheduler or executor died")
        for _, e, rid, reply_to in self._recent:
            if e == engine:
                self._reply(reply_to, error_output(
                    rid, ErrorKind.UNAVAILABLE,
                    f"engine {engine} stopped ({why}) while it held this request; send it "
                    "again"))
        self._recent = deque(r for r in self._recent if r[1] != engine)
        for nonce, pending in list(self._pending.items()):
            pending.waiting.discard(engine)  # its requests fail anyway
            self._maybe_conclude(nonce)

    def reconcile(self, msg: Reconcile) -> None:
        """Ask every live engine which of the ids it holds, behind every request this worker
        forwarded to it first; the answers decide which ids were lost."""
        nonce = next(self._nonces)
        waiting = {e for e, serving in enumerate(self.serving) if serving}
        self._pending[nonce] = _PendingReconcile(msg.reply_to, list(msg.request_ids), waiting,
                                                 self._clock() + RECONCILE_TIMEOUT_S)
        for engine in waiting:
            self._send(engine, EngineReconcile(nonce, self.rank, list(msg.request_ids)))
        self._maybe_conclude(nonce)

    def on_answer(self, answer: ReconcileAnswer) -> None:
        pending = self._pending.get(answer.nonce)
        if pending is None:
            return
        pending.known.update(answer.known_ids)
        pending.waiting.discard(answer.engine)
        self._maybe_conclude(answer.nonce)

    def expire(self) -> None:
        """Conclude the reconciles some engine never answered."""
        now = self._clock()
        for nonce, pending in list(self._pending.items()):
            if now >= pending.deadline:
                logger.warning("engines %s did not answer a reconcile", sorted(pending.waiting))
                pending.waiting.clear()
                self._maybe_conclude(nonce)

    def _maybe_conclude(self, nonce: int) -> None:
        pending = self._pending[nonce]
        if pending.waiting:
            return
        del self._pending[nonce]
        for rid in pending.request_ids:
            if rid not in pending.known:
                self._reply(pending.reply_to, error_output(
                    rid, ErrorKind.UNAVAILABLE, f"tokenizer:{self.rank} stopped while it held "
                    "this request, which was not run; send it again"))
                for engine, serving in enumerate(self.serving):  # should one hold it after all
                    if serving:
                        self._send(engine, AbortRequest(rid))
