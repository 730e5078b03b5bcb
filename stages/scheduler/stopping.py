"""When a sample ends, decided in one place for the scheduler process: a sampled token that is
EOS or a stop token id (once min_tokens are out), max_tokens, the end of the context; and which
ids min_tokens keeps from being sampled. (Stop strings are the detokenizer's: they need text.)"""

from __future__ import annotations

from typing import NamedTuple

from ipc.messages import FinishReason, SamplingParams


class Finish(NamedTuple):
    reason: FinishReason
    stop_token: int | None = None  # the stop_token_ids entry that ended it


def check_stop(params: SamplingParams, eos_token_ids: tuple[int, ...], token: int,
               num_outputs: int, num_tokens: int, max_len: int) -> Finish | None:
    """Whether the sample ends with `token`, its num_outputs-th output (num_tokens in all)."""
    if num_outputs > params.min_tokens:
        if token in params.stop_token_ids:
            return Finish(FinishReason.STOP, token)
        if not params.ignore_eos and token in eos_token_ids:
            return Finish(FinishReason.STOP)
    if reaches_length(params, num_outputs, num_tokens, max_len):
        return Finish(FinishReason.LENGTH)
    return None


def reaches_length(params: SamplingParams, num_outputs: int, num_tokens: int,
                   max_len: int) -> bool:
    """max_tokens outputs, or a context of max_len tokens: planning stops once the tokens in
    flight reach it, and the sample finishes when they are known."""
    max_tokens = params.max_tokens
    return (max_tokens is not None and num_outputs >= max_tokens) or num_tokens >= max_len


def output_limit(params: SamplingParams, num_prompt: int, max_len: int) -> int:
    """The output count from which reaches_length holds for a sample of num_prompt prompt
    tokens: each step compares one int against it, and asks the full check only there."""
    room = max_len - num_prompt
    return room if params.max_tokens is None else min(params.max_tokens, room)


def stopping_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids with which check_stop ends a sample once past min_tokens (most samples have
    none: each step asks the full check only for a sampled id in here)."""
    return frozenset((*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)))


def suppressed_ids(params: SamplingParams, eos_token_ids: tuple[int, ...],
                   num_outputs: int) -> list[int]:
    """The ids min_tokens keeps from being sampled while fewer outputs exist: the stop token
    ids, and EOS unless ignored."""
    if params.min_tokens <= num_outputs:
        return []
    return [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
