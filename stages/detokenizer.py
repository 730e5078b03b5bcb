"""Detokenizer worker (one of M processes, sharded by request): incremental detokenization,
correct for multi-byte characters and merges, streamed as per-step batches to each client."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ipc.channels import PullChannel, ReplySockets
from ipc.codec import Codec, ProtocolError
from ipc.messages import DetokBatch, DetokRequestInfo, RequestOutput, RequestOutputs, TokenDelta
from stages.process import stage_process

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    info: DetokRequestInfo
    stream: DecodeStream  # holds back bytes of an unfinished character; O(1) per token
    num_output_tokens: int = 0


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
        pieces = [state.stream.step(self.tokenizer, t) for t in delta.token_ids]
        state.num_output_tokens += len(delta.token_ids)
        return RequestOutput(
            delta.request_id, "".join(p for p in pieces if p), delta.token_ids,
            delta.finish_reason is not None, delta.finish_reason, delta.error,
            state.info.num_prompt_tokens, state.num_output_tokens)


def run_detokenizer(cfg: PipelineConfig, rank: int, parent_pid: int) -> None:
    with stage_process("detokenizer", rank, cfg.control_address, parent_pid) as ctx:
        core = Detokenizer(Tokenizer.from_file(f"{cfg.model.path}/tokenizer.json"))
        inbox = PullChannel(ctx.zmq, cfg.detokenizer_address(rank), Codec([DetokBatch]),
                            bind=True)
        replies = ReplySockets(ctx.zmq)
        ctx.ready()
        while not ctx.stop.is_set():
            try:
                batch = inbox.recv(timeout_ms=100)
            except ProtocolError as exc:
                logger.error("dropped a malformed batch: %s", exc)
                continue
            if batch is None:
                continue
            assert isinstance(batch, DetokBatch)
            for address, outputs in core.feed(batch).items():
                replies.send(address, RequestOutputs(outputs))
        replies.close()
