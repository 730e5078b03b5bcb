"""The scheduler process's book of requests: each request's live samples (n-sample siblings
held until sample 0's prompt is planned), what ended lately or was refused (for a lost
detokenizer and for reconciling a client), and the outputs gathered for the detokenizers."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from ipc.config import EngineLimits
from ipc.lora import adapter_id
from ipc.messages import (
    DetokRequestInfo,
    ErrorKind,
    FinishReason,
    RequestRejected,
    TokenColumns,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)
from ipc.params import MAX_RECONCILE_IDS, RequestError, room_for, validate_params
from ipc.step import PromptLogprobs
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import SeqStatus, Sequence

MAX_FORGOTTEN_CLIENTS = 1024
# A dead detokenizer may have taken the final outputs of requests that ended this recently.
RECENT_FINAL_S = 10.0
MAX_RECENT_FINALS = 65536
EARLY_ABORT_S = 60.0  # how long an abort of a request not here yet is remembered


class StepOutputs(NamedTuple):
    infos: list[DetokRequestInfo]
    deltas: list[TokenDelta]
    rejected: list[RequestRejected]
    plain: TokenColumns  # (take_outputs(columns=True): the steady case's deltas, apart)


def invalid_reason(req: TokenizedRequest, lim: EngineLimits) -> str | None:
    """What is wrong with a request the tokenizer should not have let through: checked
    again here, since a bad one would otherwise reach the executor."""
    ids = req.prompt_token_ids
    if not ids:
        return "the prompt is empty"
    if min(ids) < 0 or max(ids) >= lim.vocab_size:
        return f"the prompt has token ids outside the vocabulary [0, {lim.vocab_size})"
    if len(ids) >= lim.max_model_len:
        return (f"the prompt has {len(ids)} tokens; the context holds {lim.max_model_len}, "
                f"which must leave room for {room_for(req.params)}")
    try:
        validate_params(req.params, lim.vocab_size, lim.priority_range)
    except RequestError as exc:
        return exc.message
    if req.params.lora_path and not lim.lora_updating:
        return (f"LoRA adapter {req.params.lora_name!r} is loaded at run time, which this "
                "engine does not take (--enable-lora-updating)")
    if not req.params.lora_path and adapter_id(lim.lora_names, req.params.lora_name) is None:
        served = ", ".join(lim.lora_names) or "none"
        return f"no LoRA adapter {req.params.lora_name!r} is served (adapters: {served})"
    if (req.params.structured_outputs is not None) != bool(req.grammar):
        return "a structured output must come with its grammar (from a tokenizer stage)"
    return None


def detok_info(req: TokenizedRequest) -> DetokRequestInfo:
    """What a detokenizer needs to know of a new request."""
    p = req.params
    return DetokRequestInfo(
        req.request_id, req.reply_to, len(req.prompt_token_ids), p.skip_special_tokens,
        req.arrival_time, p.n, list(p.stop), p.include_stop_str_in_output, p.min_tokens,
        p.logprobs)


class RequestBook:
    def __init__(self) -> None:
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live samples
        self.held: dict[str, list[Sequence]] = {}  # the HELD samples of each request
        self.early_aborts: dict[str, float] = {}  # aborted before they came, and when
        self.forgotten: dict[str, None] = {}  # reply addresses of dead clients, newest last
        # (when, request id, reply_to, prompt length) of the samples that ended lately
        self.recent_finals: deque[tuple[float, str, str, int]] = deque()
        self.new_infos: list[DetokRequestInfo] = []
        self.rejected: list[RequestRejected] = []
        self.touched: dict[Sequence, None] = {}  # new tokens or finished since take_outputs
        self.finished: dict[str, int] = {}  # sequences (and refused requests) by reason value
        self.prompt_tokens = 0

    def seq(self, request_id: str, index: int = 0) -> Sequence:
        return next(s for s in self.requests[request_id] if s.index == index)

    # ------------------------------------------------------------ arrivals

    def add(self, req: TokenizedRequest, seqs: list[Sequence]) -> None:
        """A request taken: its samples, the first waiting and the others HELD."""
        self.prompt_tokens += len(req.prompt_token_ids)
        self.new_infos.append(detok_info(req))
        self.requests[req.request_id] = seqs
        if len(seqs) > 1:
            self.held[req.request_id] = seqs[1:]

    def refuse(self, refusal: RequestRejected) -> None:
        self.rejected.append(refusal)
        self.count_finished(refusal.finish_reason)
        self.remember_final(refusal.request_id, refusal.reply_to, refusal.num_prompt_tokens)

    def note_early_abort(self, request_id: str) -> None:
        """An abort of a request not here (it may still be in a tokenizer)."""
        now = time.monotonic()
        self.early_aborts = {k: t for k, t in self.early_aborts.items()
                             if now - t < EARLY_ABORT_S}
        self.early_aborts[request_id] = now

    def was_aborted(self, request_id: str) -> bool:
        """Whether the request was aborted before it came (asked once: it is forgotten)."""
        return self.early_aborts.pop(request_id, None) is not None

    def forget_client(self, reply_to: str) -> list[str]:
        """A client died: what it sends from now on is refused; returns its live requests."""
        self.forgotten[reply_to] = None
        while len(self.forgotten) > MAX_FORGOTTEN_CLIENTS:
            del self.forgotten[next(iter(self.forgotten))]
        return [r for r, seqs in self.requests.items() if seqs[0].reply_to == reply_to]

    # ------------------------------------------------------------ samples

    def siblings_ready(self) -> list[Sequence]:
        """HELD samples wait until sample 0's prompt is planned (and its blocks cached), or
        it ended: those whose wait is over, now WAITING (for the queue), in order."""
        ready = []
        for rid, siblings in list(self.held.items()):
            first = next((s for s in self.requests[rid] if s.index == 0), None)
            if (first is None or first.status is SeqStatus.FINISHED
                    or first.num_computed >= len(first.prompt_ids)):
                del self.held[rid]
                for seq in siblings:
                    seq.move_to(SeqStatus.WAITING)
                    ready.append(seq)
        return ready

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """seq (not finished, not waiting in the queue) ends; its output says so."""
        if seq.status is SeqStatus.HELD:
            self.held[seq.request_id].remove(seq)
        self.touched[seq] = None
        self.remember_final(seq.request_id, seq.reply_to, len(seq.prompt_ids))
        seq.move_to(SeqStatus.FINISHED)
        seq.finish_reason = reason
        self.count_finished(reason)

    def is_live(self, seq: Sequence) -> bool:
        seqs = self.requests.get(seq.request_id)
        return seqs is not None and seq in seqs

    def remove(self, seq: Sequence) -> None:
        """A finished sample is gone for good (its blocks and slot are given back)."""
        seqs = self.requests[seq.request_id]
        seqs.remove(seq)
        if not seqs:
            del self.requests[seq.request_id]
            self.held.pop(seq.request_id, None)

    def count_finished(self, reason: FinishReason) -> None:
        self.finished[reason.value] = self.finished.get(reason.value, 0) + 1

    # ------------------------------------------------------------ lost finals

    def remember_final(self, rid: str, reply_to: str, num_prompt: int) -> None:
        """For fail_recent: the final output just sent on may yet be lost with its
        detokenizer."""
        self.recent_finals.append((time.monotonic(), rid, reply_to, num_prompt))
        if len(self.recent_finals) > MAX_RECENT_FINALS:
            self.recent_finals.popleft()

    def prune_finals(self) -> None:
        now = time.monotonic()
        while self.recent_finals and now - self.recent_finals[0][0] > RECENT_FINAL_S:
            self.recent_finals.popleft()

    def fail_recent(self, belongs: Callable[[str], bool], failed: set[str],
                    message: str) -> None:
        """Each request that `belongs` and ended lately, not in `failed` already, ends again
        with an error (its final output may have gone to a dead detokenizer)."""
        for _, rid, reply_to, num_prompt in self.recent_finals:
            if rid not in failed and belongs(rid):
                self.reject_unavailable(rid, reply_to, message, num_prompt)
                failed.add(rid)

    def reject_unavailable(self, rid: str, reply_to: str, message: str,
                           num_prompt: int) -> None:
        self.rejected.append(RequestRejected(rid, reply_to, FinishReason.ERROR, message,
                                             num_prompt, ErrorKind.UNAVAILABLE))

    def known(self, request_ids: list[str]) -> list[str]:
        """Which of these ids are held, or ended lately (Scheduler.known_requests)."""
        ended = {rid for _, rid, _, _ in self.recent_finals}
        return [rid for rid in request_ids[:MAX_RECONCILE_IDS]
                if rid in self.requests or rid in ended]

    # ------------------------------------------------------------ outputs

    def take_outputs(self, columns: bool = False) -> StepOutputs:
        """New request infos, token deltas and rejections since the last call, in order;
        with `columns`, the deltas of the steady case (TokenColumns) in `plain`, apart."""
        deltas = []
        plain = TokenColumns()
        finished = SeqStatus.FINISHED
        for seq in self.touched:  # (a sample per step each: names looked up once)
            ids, start = seq.output_ids, seq.num_sent
            seq.num_sent = num_out = len(ids)
            if seq.status is finished:
                reason, error = seq.finish_reason, seq.error
            elif start == num_out:
                continue
            else:
                reason = error = None
            p = seq.params
            if (columns and reason is None and num_out - start == 1 and p.logprobs is None
                    and p.prompt_logprobs is None and seq.embedding is None):
                plain.append(seq.request_id, ids[start], seq.index,
                             seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0)
                continue
            deltas.append(TokenDelta(
                seq.request_id, ids[start:], reason, error, seq.index,
                None if p.logprobs is None else seq.output_logprobs[start:],
                seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0, seq.stop_token,
                None if p.prompt_logprobs is None else prompt_logprobs_to_send(seq),
                seq.embedding))
        out = StepOutputs(self.new_infos, deltas, self.rejected, plain)
        self.new_infos, self.rejected, self.touched = [], [], {}
        return out


def prompt_logprobs_to_send(seq: Sequence) -> list[TokenLogprob] | None:
    """All of a sequence's prompt logprobs, once they are in (the first token, which
    nothing scores, has logprob NaN); None before, and after they were sent."""
    if seq.plp_sent or not seq.scores_prompt:
        return None
    if len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1:
        return None
    seq.plp_sent = True
    return [TokenLogprob(seq.prompt_ids[0], math.nan), *seq.prompt_logprobs]


def take_prompt_logprobs(step: PlannedStep, scored: PromptLogprobs) -> None:
    """A step's prompt logprobs go to the samples whose positions they score, in order."""
    lps, ranks, top_ids, top_lps = scored
    j = 0
    for seq, count in step.plp_owners:
        k = seq.params.prompt_logprobs or 0
        for _ in range(count):
            seq.prompt_logprobs.append(TokenLogprob(
                step.prompt_logprobs[j][1], lps[j], top_ids[j][:k], top_lps[j][:k],
                rank=ranks[j]))
            j += 1
