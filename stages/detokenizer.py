"""Detokenizer worker (one of M processes, sharded by request): incremental detokenization,
correct for multi-byte characters and merges, streamed as per-step batches to each client."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ipc.channels import PullChannel, ReplySockets
from ipc.codec import Codec
from ipc.messages import DetokBatch, DetokRequestInfo, RequestOutput, RequestOutputs, TokenDelta
from stages.process import stage_process
from stages.trace import now_ns

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    info: DetokRequestInfo
    stream: DecodeStream  # holds back bytes of an unfinished character; O(1) per token
    num_output_tokens: int = 0
    held: list[int] = field(default_factory=list)  # ids the stream has not turned into text yet
    context: list[int] = field(default_factory=list)  # ids of its last emitted piece


class Detokenizer:
    """Pure core: feed(batch) -> outputs grouped by client reply address."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def feed(self, batch: DetokBatch) -> dict[str, list[RequestOutput]]:
        for info in batch.new_requests:
            self.requests[info.request_id] = _RequestState(
                info, DecodeStream(skip_special_tokens=info.skip_special_tokens))
        by_client: dict[str, list[RequestOutput]] = {}
        for rej in batch.rejected:
            by_client.setdefault(rej.reply_to, []).append(RequestOutput(
                rej.request_id, "", [], True, rej.finish_reason, rej.error,
                rej.num_prompt_tokens, 0))
        for delta in batch.deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                logger.error("token delta for unknown request %s", delta.request_id)
                continue
            by_client.setdefault(state.info.reply_to, []).append(self._output(state, delta))
            if delta.finish_reason is not None:
                del self.requests[delta.request_id]
        return by_client

    def _output(self, state: _RequestState, delta: TokenDelta) -> RequestOutput:
        pieces: list[str] = []
        for t in delta.token_ids:
            state.held.append(t)
            try:
                piece = state.stream.step(self.tokenizer, t)
            except Exception as exc:  # e.g. "Invalid prefix encountered": restart the stream
                logger.warning("request %s: incremental decode failed (%s); resyncing",
                               delta.request_id, exc)
                piece = self._flush(state)
                state.stream = DecodeStream(skip_special_tokens=state.info.skip_special_tokens)
            if piece is not None:
                pieces.append(piece)
                state.context, state.held = state.held, []
        if delta.finish_reason is not None and state.held:
            pieces.append(self._flush(state))
        state.num_output_tokens += len(delta.token_ids)
        return RequestOutput(
            delta.request_id, "".join(pieces), delta.token_ids,
            delta.finish_reason is not None, delta.finish_reason, delta.error,
            state.info.num_prompt_tokens, state.num_output_tokens)

    def _flush(self, state: _RequestState) -> str:
        """The text the stream still holds back (a cut-off character decodes to U+FFFD), so
        that a finished request's deltas add up to decode(all ids). Decodes only a few ids."""
        skip = state.info.skip_special_tokens
        prefix = self.tokenizer.decode(state.context, skip_special_tokens=skip)
        text = self.tokenizer.decode(state.context + state.held, skip_special_tokens=skip)
        if text.startswith(prefix):
            return text[len(prefix):]
        return self.tokenizer.decode(state.held, skip_special_tokens=skip)


def run_detokenizer(cfg: PipelineConfig, rank: int, parent_pid: int) -> None:
    with stage_process("detokenizer", rank, cfg, parent_pid) as ctx:
        core = Detokenizer(Tokenizer.from_file(f"{cfg.model.path}/tokenizer.json"))
        inbox = PullChannel(ctx.zmq, cfg.detokenizer_address(rank), Codec([DetokBatch]),
                            bind=True)
        replies = ReplySockets(ctx.zmq)
        ctx.ready()
        while not ctx.stop.is_set():
            batch = inbox.recv_valid(100)
            if batch is None:
                continue
            assert isinstance(batch, DetokBatch)
            start = now_ns()
            for address, outputs in core.feed(batch).items():
                replies.send(address, RequestOutputs(outputs))
            ctx.tracer.span("detokenize", start, now_ns(), args={"deltas": len(batch.deltas)})
        replies.close()
