"""Detokenizer worker (one of M processes, sharded by request): incremental detokenization,
correct for multi-byte characters and merges, streamed as per-step batches to each client."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from tokenizers import Tokenizer

from ipc.channels import PullChannel, ReplySockets, stage_listen
from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.messages import (
    DetokBatch,
    DetokRequestInfo,
    EngineDown,
    ErrorKind,
    FinishReason,
    Members,
    RequestOutput,
    RequestOutputs,
    StopSample,
    TokenColumns,
    TokenDelta,
    TokenLogprob,
)
from stages.peers import Peers, local_members
from stages.process import stage_process
from stages.text_stream import TextStream, hold_back, text_streams
from stages.trace import now_ns

logger = logging.getLogger(__name__)


@dataclass
class _SampleState:
    """One sample of one request. text is all its output text so far; sent is how much of it
    the client has (the rest may still be part of a stop string)."""

    info: DetokRequestInfo
    index: int
    stream: TextStream  # holds back bytes of an unfinished character; O(1) per token
    num_output_tokens: int = 0
    text: str = ""  # kept only when the request has stop strings
    sent: int = 0
    stopped: bool = False  # ended by a stop string here; the scheduler's last delta is awaited
    finished: bool = False  # the scheduler's last delta came: nothing more will
    engine: int = 0  # the data-parallel engine that runs it


def _split_stop_token(delta: TokenDelta, include: bool) -> tuple[list[int], list[int]]:
    """(ids whose text is output, ids that only count): a stop_token_ids entry that ended
    the sample is reported but not turned into text, unless include_stop_str_in_output."""
    if delta.stop_token_id is None or include or not delta.token_ids:
        return delta.token_ids, []
    return delta.token_ids[:-1], delta.token_ids[-1:]


def find_stop(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string occurring in text at or after `start` (position, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


class _Messages(dict[str, RequestOutputs]):
    """A batch's outputs by client address."""

    def of(self, address: str) -> RequestOutputs:
        msg = self.get(address)
        if msg is None:
            msg = self[address] = RequestOutputs([])
        return msg


class Detokenizer:
    """Pure core: feed(batch) -> outputs grouped by client reply address. A sample ended by a
    stop string is reported in `stopped` (a StopSample each), for the scheduler."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.new_stream = text_streams(tokenizer)
        self.requests: dict[str, list[_SampleState]] = {}
        self.stopped: list[StopSample] = []
        # engine -> the incarnation that died last, and why its requests failed
        self.dead_engines: dict[int, tuple[int, str]] = {}

    def feed(self, batch: DetokBatch) -> dict[str, list[RequestOutput]]:
        """feed_messages' outputs, each client's as one list."""
        return {address: msg.all_outputs() for address, msg in self.feed_messages(batch).items()}

    def feed_messages(self, batch: DetokBatch) -> dict[str, RequestOutputs]:
        """The batch's outputs, a message for each client address: the steady case's as
        columns (OutputColumns), the rest as a RequestOutput each."""
        dead = self.dead_engines.get(batch.engine)
        if dead is not None and batch.incarnation <= dead[0]:
            # sent before it died: its requests failed
            return {a: RequestOutputs(outs) for a, outs in self._refuse_late(batch).items()}
        for info in batch.new_requests:
            self.requests[info.request_id] = [
                _SampleState(info, i, self.new_stream(info.skip_special_tokens, info.request_id),
                             engine=batch.engine)
                for i in range(info.n)]
        by_client = _Messages()
        for rej in batch.rejected:  # needs no state; a failed request's state is done with
            samples = self.requests.get(rej.request_id)
            if samples and samples[0].info.reply_to == rej.reply_to:  # not a duplicate's
                del self.requests[rej.request_id]
            by_client.of(rej.reply_to).outputs.append(RequestOutput.refusal(
                rej.request_id, rej.error_kind, rej.error, None, rej.num_prompt_tokens,
                rej.finish_reason))
        unknown = 0
        for delta in batch.deltas:
            samples = self.requests.get(delta.request_id)
            if samples is None or not 0 <= delta.index < len(samples):
                unknown += 1  # after a restart: its predecessor had it, the scheduler fails it
                continue
            state = samples[delta.index]
            if not state.stopped:
                # (the output made here, not two calls down: this runs for every sample)
                try:
                    out = (self._output if state.info.stop else self._plain_output)(state, delta)
                except Exception as exc:
                    out = self._failed_output(state, delta, exc)
                by_client.of(state.info.reply_to).outputs.append(out)
            if delta.finish_reason is not None:
                state.finished = True
                if all(s.finished for s in samples):
                    del self.requests[delta.request_id]
        unknown += self._feed_plain(batch.plain, by_client)
        if unknown:
            logger.warning("dropped %d token deltas of requests this worker does not know "
                           "(expected just after it was restarted)", unknown)
        return by_client

    def _feed_plain(self, plain: TokenColumns, by_client: _Messages) -> int:
        """feed's loop over the steady case's deltas, kept as columns (one token each, none
        finishing, no logprobs): a sample with stop strings takes _output's way, the others
        _plain_output's, inlined, into the client's columns. Returns how many were of
        requests it does not know."""
        requests, unknown = self.requests, 0
        tokens, indexes, cached = plain.token_ids, plain.indexes, plain.num_cached_tokens
        for i, rid in enumerate(plain.request_ids):
            samples = requests.get(rid)
            index = indexes[i]
            if samples is None or not 0 <= index < len(samples):
                unknown += 1
                continue
            state = samples[index]
            if state.stopped:
                continue
            info = state.info
            try:
                if info.stop:
                    out = self._output(state, plain.delta(i))
                else:
                    token = tokens[i]
                    text = state.stream.step(token)
                    state.num_output_tokens += 1
                    by_client.of(info.reply_to).plain.append(
                        rid, text, token, index, info.num_prompt_tokens,
                        state.num_output_tokens, cached[i])
                    continue
            except Exception as exc:
                out = self._failed_output(state, plain.delta(i), exc)
            by_client.of(info.reply_to).outputs.append(out)
        return unknown

    def _refuse_late(self, batch: DetokBatch) -> dict[str, list[RequestOutput]]:
        """A dead engine's batch that came after EngineDown: the requests it announced end
        with an error too (those it announced before were failed then). The engine started
        again sends a later incarnation's, which are taken."""
        by_client: dict[str, list[RequestOutput]] = {}
        for info in batch.new_requests:
            by_client.setdefault(info.reply_to, []).append(RequestOutput.refusal(
                info.request_id, ErrorKind.UNAVAILABLE, self.dead_engines[batch.engine][1], None,
                info.num_prompt_tokens))
        return by_client

    def engine_of(self, request_id: str) -> int:
        """The engine running a request this worker streams (where its StopSample goes)."""
        samples = self.requests.get(request_id)
        return samples[0].engine if samples else 0

    def fail_engine(self, engine: int, message: str,
                    incarnation: int = 0) -> dict[str, list[RequestOutput]]:
        """Engine `engine` died (in `incarnation`): each request it ran ends with an
        `unavailable` error in place of the rest of its output (a client ignores what follows
        a sample's final output)."""
        self.dead_engines[engine] = (incarnation, message)
        by_client: dict[str, list[RequestOutput]] = {}
        for rid, samples in list(self.requests.items()):
            if samples[0].engine == engine:
                del self.requests[rid]
                info = samples[0].info
                by_client.setdefault(info.reply_to, []).append(RequestOutput.refusal(
                    rid, ErrorKind.UNAVAILABLE, message, None, info.num_prompt_tokens))
        return by_client

    def _failed_output(self, state: _SampleState, delta: TokenDelta,
                       exc: Exception) -> RequestOutput:
        """The sample's final error output, when its delta cannot be turned into text (ids
        outside the tokenizer's vocabulary, say): one bad sample never stops the stage, and
        the scheduler is told to free it."""
        logger.exception("request %s: sample %d failed in the detokenizer", delta.request_id,
                         state.index)  # (called in feed's except clause)
        if delta.finish_reason is None:
            state.stopped = True
            self.stopped.append(StopSample(delta.request_id, state.index))
        return RequestOutput(delta.request_id, "", [], True, FinishReason.ERROR,
                             f"detokenizer error: {exc}", state.info.num_prompt_tokens,
                             state.num_output_tokens, state.index,
                             error_kind=ErrorKind.INTERNAL)

    def _output(self, state: _SampleState, delta: TokenDelta) -> RequestOutput:
        """The output of a sample with stop strings: its text is kept to look for them."""
        info = state.info
        stops = info.stop
        longest = max(map(len, stops))
        ids: list[int] = []
        stop: tuple[int, str] | None = None
        text_ids, silent = _split_stop_token(delta, info.include_stop_str_in_output)
        for t in text_ids:
            ids.append(t)
            before = len(state.text)
            state.text += state.stream.step(t)
            state.num_output_tokens += 1
            if state.num_output_tokens > info.min_tokens:
                # A match starts in text not yet sent (text sent held no part of one).
                stop = find_stop(state.text, max(state.sent, before - longest + 1), stops)
                if stop is not None:
                    break
        finishing = delta.finish_reason is not None
        if finishing and stop is None:
            ids += silent
            state.num_output_tokens += len(silent)
            rest = state.stream.flush()
            if rest is not None:
                before = len(state.text)
                state.text += rest
                if state.num_output_tokens > info.min_tokens:
                    stop = find_stop(state.text, max(state.sent, before - longest + 1), stops)
        finish_reason, stop_reason = delta.finish_reason, delta.stop_token_id
        if stop is not None:
            pos, string = stop
            end = pos + len(string) if info.include_stop_str_in_output else pos
            finish_reason, stop_reason = FinishReason.STOP, string
            if not finishing:  # the scheduler still runs it: tell it to stop now
                state.stopped = True
                self.stopped.append(StopSample(delta.request_id, state.index))
        elif finishing:
            end = len(state.text)
        else:
            end = len(state.text) - hold_back(state.text, stops)
        text = state.text[state.sent:end]
        state.sent = max(state.sent, end)
        finished = finishing or stop is not None
        num_out = state.num_output_tokens
        logprobs = self._logprobs(delta, len(ids)) if info.logprobs is not None else None
        return RequestOutput(
            delta.request_id, text, ids, finished, finish_reason, delta.error,
            info.num_prompt_tokens, num_out, state.index, stop_reason, logprobs,
            delta.num_cached_tokens, prompt_logprobs=self._with_texts(delta.prompt_logprobs),
            embedding=delta.embedding)

    def _plain_output(self, state: _SampleState, delta: TokenDelta) -> RequestOutput:
        """The output of a sample without stop strings (the common case): no text kept,
        nothing held back."""
        info = state.info
        ids = delta.token_ids
        # _split_stop_token and _with_texts, inlined: this runs for every sample
        text_ids = (ids[:-1] if delta.stop_token_id is not None and ids
                    and not info.include_stop_str_in_output else ids)
        text = "".join(map(state.stream.step, text_ids))
        finishing = delta.finish_reason is not None
        if finishing:
            text += state.stream.flush() or ""
        state.num_output_tokens += len(ids)
        logprobs = self._logprobs(delta, len(ids)) if info.logprobs is not None else None
        prompt_logprobs = (None if delta.prompt_logprobs is None
                           else self._with_texts(delta.prompt_logprobs))
        return RequestOutput(
            delta.request_id, text, ids, finishing, delta.finish_reason, delta.error,
            info.num_prompt_tokens, state.num_output_tokens, state.index, delta.stop_token_id,
            logprobs, delta.num_cached_tokens, prompt_logprobs=prompt_logprobs,
            embedding=delta.embedding)

    def _logprobs(self, delta: TokenDelta, count: int) -> list[TokenLogprob]:
        """The delta's logprobs for its first `count` tokens, with each token's text."""
        return self._with_texts((delta.logprobs or [])[:count]) or []

    def _with_texts(self, entries: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """Logprob entries with each token's text (and each alternative's)."""
        if entries is None:
            return None
        out = []
        for lp in entries:
            texts = self.tokenizer.decode_batch([[lp.token_id], *([i] for i in lp.top_ids)],
                                                skip_special_tokens=False)
            out.append(dataclasses.replace(lp, token=texts[0], top_tokens=texts[1:]))
        return out


# The detokenizer is off the run-ahead chain (the scheduler plans the next steps without it),
# so where the cores are short it yields to the stages on the chain: at timed:2,0,0.8, depth 3,
# on 2 cores, batch 64's chain p99 2.8 / 2.8 ms against 4.3 / 3.1 at nice 0 (the report's p99
# 0.45 / 0.44 against 1.42 / 0.86), batch 256's device idle 8.0 / 13.3% against 13.6 / 14.3%.
# Its text reaches clients a little later only while the host has no core to spare.
DETOKENIZER_NICE = 5


def run_detokenizer(cfg: PipelineConfig, rank: int, parent_pid: int,
                    members: Members | None = None, stage_port: int = 0) -> None:
    """members: the stages to send to, when others joined from other hosts (default: the
    run's own). stage_port: a restarted worker's predecessor's (see stage_listen)."""
    # Before any thread starts (Linux applies a nice value per thread; new ones inherit it).
    os.nice(DETOKENIZER_NICE)
    with stage_process("detokenizer", rank, cfg, parent_pid) as ctx:
        core = Detokenizer(Tokenizer.from_file(f"{cfg.model.path}/tokenizer.json"))
        inbox = PullChannel(ctx.zmq, cfg.detokenizer_address(rank),
                            Codec([DetokBatch, EngineDown, Members]), bind=True,
                            secret=cfg.keys.run_secret)
        replies = ReplySockets(ctx.zmq, is_client=cfg.is_client_address)
        engines = Peers(ctx.zmq, cfg.keys.run_secret, members or local_members(cfg))
        ctx.ready(stage_port=stage_listen(inbox, cfg, stage_port))
        while not ctx.stop.is_set():
            batch = inbox.recv_valid(100)
            if batch is None:
                continue
            if isinstance(batch, Members):
                engines.update(batch)
                continue
            if isinstance(batch, EngineDown):
                logger.warning("engine %d is down: failing its requests", batch.engine)
                for address, outputs in core.fail_engine(batch.engine, batch.message,
                                                         batch.incarnation).items():
                    replies.send(address, RequestOutputs(outputs))
                continue
            assert isinstance(batch, DetokBatch)
            start = now_ns()
            messages = core.feed_messages(batch)
            for stop in core.stopped:  # first, so the scheduler frees them a step sooner
                engines.to_engine(core.engine_of(stop.request_id), stop)
            core.stopped.clear()
            for address, msg in messages.items():
                replies.send(address, msg)
            ctx.tracer.span("detokenize", start, now_ns(), args={"deltas": batch.num_deltas})
        replies.close()
        engines.close()
