"""Tokenizer worker (one of N processes): validates each request, applies the chat template,
tokenizes, checks the length against the context and forwards it to the scheduler of the
engine its router picks (stages/dispatch.py). A bad request gets its error straight back to
its client; nothing else is disturbed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from ipc.channels import PullChannel, ReplySockets, SubChannel, listen_tcp, stage_listen
from ipc.codec import Codec, ProtocolError
from ipc.config import PipelineConfig
from ipc.messages import (
    AddRequest,
    ChatMessage,
    ErrorKind,
    Members,
    Message,
    PipelineStatus,
    Reconcile,
    ReconcileAnswer,
    TokenizedRequest,
    ToolSpec,
)
from ipc.params import (
    DEFAULT_PRIORITY_RANGE,
    MAX_RECONCILE_IDS,
    RequestError,
    room_for,
    validate_params,
)
from stages.chat_template import render, template_kwargs
from stages.dispatch import Dispatcher, error_output
from stages.file_tokenizer import load_tokenizer
from stages.grammar import Grammars
from stages.peers import Peers, local_members
from stages.process import StageContext, stage_process
from stages.router import EngineRouter
from stages.trace import now_ns

logger = logging.getLogger(__name__)


class TokenizerCore:
    """Turns an AddRequest into a TokenizedRequest or raises RequestError."""

    def __init__(self, model_dir: str, max_model_len: int, vocab_size: int,
                 priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE,
                 eos_token_ids: tuple[int, ...] = (),
                 embedding_refusal: str | None = None) -> None:
        """embedding_refusal: why this run refuses pooling requests (None: it serves them;
        PipelineConfig.embedding_refusal)."""
        self.tokenizer: Any = load_tokenizer(model_dir)
        self.embedding_refusal = embedding_refusal
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.priority_range = priority_range
        self.eos_token_ids = eos_token_ids
        self.grammars = (Grammars(model_dir, vocab_size, eos_token_ids[0], self.tokenizer)
                         if eos_token_ids else None)

    def process(self, req: AddRequest) -> TokenizedRequest:
        validate_params(req.params, self.vocab_size, self.priority_range)
        if req.params.pooling and self.embedding_refusal is not None:
            raise RequestError(self.embedding_refusal, "pooling")
        ids = self._prompt_ids(req)
        if not ids:
            raise RequestError("the prompt is empty")
        if max(ids) >= self.vocab_size:  # a tokenizer larger than the model's embedding
            raise RequestError(f"the prompt has token id {max(ids)}, outside this model's "
                               f"vocabulary of {self.vocab_size}")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's context holds "
                               f"{limit}, which must leave room for {room_for(req.params)}")
        max_tokens = req.params.max_tokens
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                               f"exceeds this model's context of {limit} tokens")
        return TokenizedRequest(req.request_id, req.reply_to, ids, req.params, req.arrival_time,
                                self._grammar(req))

    def _grammar(self, req: AddRequest) -> str:
        """The request's structured output as grammar text ("" for none), or RequestError."""
        so = req.params.structured_outputs
        if so is None:
            return ""
        if self.grammars is None:
            raise RequestError("this model has no EOS token, so a structured output could "
                               "never end", "structured_outputs")
        return self.grammars.grammar(so)

    def _prompt_ids(self, req: AddRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, prompt_token_ids, messages")
        if req.tools and req.messages is None:
            raise RequestError("tools come with messages (a chat), not with a prompt", "tools")
        if req.prompt is not None:
            return list(self.tokenizer(req.prompt)["input_ids"])
        if req.prompt_token_ids is not None:
            bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt_token_ids {bad[:5]} are outside the vocabulary")
            return list(req.prompt_token_ids)
        return self._chat_ids(req)

    def _chat_ids(self, req: AddRequest) -> list[int]:
        assert req.messages is not None
        return self.chat_ids(req.messages, req.tools, template_kwargs(req.chat_template_kwargs))

    def chat_ids(self, messages: list[ChatMessage], tools: list[ToolSpec] | None = None,
                 kwargs: dict[str, Any] | None = None) -> list[int]:
        """A conversation (and the tools it may call) through the model's chat template,
        ready for the assistant's turn (stages/chat_template.py); kwargs: the template's
        extra variables."""
        text = render(self.tokenizer, messages, tools or [], kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _reject_malformed(replies: ReplySockets, exc: ProtocolError) -> None:
    """A request that does not decode still gets an answer if we can tell who sent it."""
    raw = exc.raw
    if (isinstance(raw, list) and len(raw) > 2 and raw[0] == AddRequest.TAG
            and isinstance(raw[1], str) and isinstance(raw[2], str)):
        replies.send(raw[2], error_output(raw[1], ErrorKind.INVALID_REQUEST,
                                          f"invalid request: {exc}"))
    else:
        logger.error("dropped a malformed message with no reply address: %s", exc)


def forward_reconcile(msg: Reconcile, rank: int, dispatcher: Dispatcher,
                      is_client: Callable[[str], bool]) -> None:
    """Pass a client's Reconcile on to the engines, behind the requests this worker has
    forwarded, if it names a client's address, this rank and a bounded number of ids."""
    if not is_client(msg.reply_to) or msg.rank != rank or len(msg.request_ids) > MAX_RECONCILE_IDS:
        logger.warning("refused a Reconcile for %r (rank %d, %d ids)", msg.reply_to, msg.rank,
                       len(msg.request_ids))
        return
    dispatcher.reconcile(msg)


class TokenizerShell:
    """The sockets around a TokenizerCore: clients' requests in; tokenized ones out to the
    engines (a Dispatcher); the engines' answers, the launcher's roster (Members) and, with
    several engines (or room for more), the launcher's status (their loads and liveness) in."""

    def __init__(self, ctx: StageContext, cfg: PipelineConfig, rank: int, tcp_port: int,
                 members: Members | None = None, stage_port: int = 0) -> None:
        self.cfg, self.rank, self.ctx = cfg, rank, ctx
        self.core = TokenizerCore(cfg.model.path, cfg.model.max_model_len, cfg.model.vocab_size,
                                  cfg.scheduler.priority_range, cfg.model.eos_token_ids,
                                  cfg.embedding_refusal)
        self.inbox = PullChannel(ctx.zmq, cfg.tokenizer_address(rank),
                                 Codec([AddRequest, Reconcile]), bind=True,
                                 secret=cfg.keys.client_key.encode())
        self.answers = PullChannel(ctx.zmq, cfg.tokenizer_stage_address(rank),
                                   Codec([ReconcileAnswer, Members]), bind=True,
                                   secret=cfg.keys.run_secret)
        self.engines = Peers(ctx.zmq, cfg.keys.run_secret, members or local_members(cfg))
        self.replies = ReplySockets(ctx.zmq, is_client=cfg.is_client_address)
        router = EngineRouter(self.engines.num_engines, cfg.scheduler.block_size, cfg.router,
                              lora_names=cfg.lora.names)
        self.dispatcher = Dispatcher(router, rank, self.engines.to_engine, self.replies.send)
        self.dispatcher.set_engines([self.engines.engine_up(e)
                                     for e in range(self.engines.num_engines)])
        self.poller = zmq.Poller()
        for chan in (self.inbox, self.answers):
            self.poller.register(chan.socket, zmq.POLLIN)
        self.status: SubChannel | None = None
        if cfg.data_parallel_size > 1 or cfg.accepts_stages:  # the router balances by load
            self.status = SubChannel(ctx.zmq, cfg.status_address, Codec([PipelineStatus]))
            self.poller.register(self.status.socket, zmq.POLLIN)
        ctx.ready(**listen_tcp(self.inbox, cfg.remote.listen_host, tcp_port),
                  stage_port=stage_listen(self.answers, cfg, stage_port))

    def run_once(self) -> None:
        events = dict(self.poller.poll(100))
        if self.status is not None and self.status.socket in events:
            while (status := self.status.recv_valid(0)) is not None:
                assert isinstance(status, PipelineStatus)
                self.dispatcher.set_status(status.engine_loads, status.engines_alive,
                                           status.engines_down_why)
        if self.answers.socket in events:
            while (answer := self.answers.recv_valid(0)) is not None:
                if isinstance(answer, Members):
                    if self.engines.update(answer):
                        self.dispatcher.set_engines([bool(a) for a in answer.engines],
                                                    answer.engines_down_why)
                    continue
                assert isinstance(answer, ReconcileAnswer)
                self.dispatcher.on_answer(answer)
        self.dispatcher.expire()
        if self.inbox.socket in events:
            while (req := self.inbox.recv_valid(0, self._reject_malformed)) is not None:
                self._handle(req)

    def _reject_malformed(self, exc: ProtocolError) -> None:
        _reject_malformed(self.replies, exc)

    def _handle(self, req: Message) -> None:
        if isinstance(req, Reconcile):
            forward_reconcile(req, self.rank, self.dispatcher, self.cfg.is_client_address)
            return
        assert isinstance(req, AddRequest)
        start = now_ns()
        try:
            self.dispatcher.forward(self.core.process(req))
        except RequestError as exc:
            self.replies.send(req.reply_to, error_output(
                req.request_id, ErrorKind.INVALID_REQUEST, exc.message, exc.param))
        except Exception as exc:  # a tokenizer bug must not kill the stage
            logger.exception("request %s failed in the tokenizer", req.request_id)
            self.replies.send(req.reply_to, error_output(req.request_id, ErrorKind.INTERNAL,
                                                         f"tokenizer error: {exc}"))
        self.ctx.tracer.span("tokenize", start, now_ns())


def run_tokenizer(cfg: PipelineConfig, rank: int, parent_pid: int, tcp_port: int = 0,
                  members: Members | None = None, stage_port: int = 0) -> None:
    """tcp_port, stage_port: with --listen, the ports to take remote clients and stages on
    (a restarted worker's predecessor's; 0: any). members: the stages to send to, when
    others joined from other hosts (default: the run's own)."""
    with stage_process("tokenizer", rank, cfg, parent_pid) as ctx:
        shell = TokenizerShell(ctx, cfg, rank, tcp_port, members, stage_port)
        if shell.core.grammars is not None:
            shell.core.grammars.warm()
        while not ctx.stop.is_set():
            shell.run_once()
        shell.replies.close()
        shell.engines.close()
