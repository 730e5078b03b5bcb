"""OpenAI API responses built from the engine's outputs: whole responses, stream chunks,
usage, logprobs in the completions, chat and vLLM shapes, and the error an engine failure
becomes. Pure functions, no I/O; used by the HTTP front end's request handling
(pipeline/server/generation.py, app.py).

Shapes follow OpenAI's (`text_completion`, `chat.completion`, `chat.completion.chunk`), with
vLLM's `stop_reason` extension and `prompt_logprobs`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ipc.messages import ErrorKind, RequestOutput, TokenLogprob
from ipc.outputs import SampleResult
from pipeline.server.errors import ApiError, bad
from pipeline.server.openai_parse import ParsedRequest, api_param
from pipeline.server.tools import message as tool_message


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """reasoning_tokens: those of completion_tokens that were reasoning (None: a request
    with no reasoning parser, which says nothing of them)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel arrays, top alternatives as {token: logprob}.
    A prompt's first token, which nothing scores (NaN), has null for both."""
    text_offset, pos = [], offset
    for e in entries:
        text_offset.append(pos)
        pos += len(e.token)
    scored = [not math.isnan(e.logprob) for e in entries]
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if ok else None
                               for e, ok in zip(entries, scored, strict=True)],
            "top_logprobs": [dict(zip(e.top_tokens, e.top_logprobs, strict=True)) if ok
                             else None for e, ok in zip(entries, scored, strict=True)],
            "text_offset": text_offset}


def vllm_prompt_logprobs(entries: list[TokenLogprob], k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: null for the first token, then for each token {id: {logprob,
    rank, decoded_token}} of the token itself and its k most likely alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries[1:]:
        ranked = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                                    "decoded_token": e.token}}
        alternatives = zip(e.top_ids[:k], e.top_tokens[:k], e.top_logprobs[:k], strict=True)
        for rank, (tid, token, lp) in enumerate(alternatives, start=1):
            ranked.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": token})
        out.append(ranked)
    return out


@dataclass
class PromptPart:
    """What a completion choice says of its prompt: the prompt itself when echoed, the
    logprobs of its tokens when computed."""

    text: str | None  # the prompt's text, echoed before the completion (None: no echo)
    entries: list[TokenLogprob]  # its tokens' logprobs, the first's NaN (empty: none)
    score_only: bool = False  # max_tokens 0: no completion
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, as asked


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)}
                          for t, lp in zip(e.top_tokens, e.top_logprobs, strict=True)]}
        for e in entries]}


def choice_json(c: SampleResult, chat: bool, want_logprobs: bool,
                tools: Any = None, prompt: PromptPart | None = None,
                answer: Any = None) -> dict[str, Any]:
    """tools: the chat's ToolRequest (pipeline/server/tools.py), whose calls the text holds
    (after the reasoning); prompt: what a completion echoes or scores of its prompt;
    answer: a chat's text split into reasoning and content (pipeline/server/reasoning.py
    Answer, by its ReasoningSpec), None without a reasoning parser."""
    if prompt is not None and not chat:
        return _completion_choice(c, want_logprobs, prompt)
    logprobs = None
    if want_logprobs:
        logprobs = chat_logprobs(c.logprobs) if chat else completion_logprobs(c.logprobs, 0)
    body: dict[str, Any] = {"index": c.index}
    finish: Any = c.finish_reason
    if not chat:
        body["text"] = c.text
    else:
        text, thought = (c.text, None) if answer is None else (answer.content, answer.reasoning)
        if tools is not None:
            body["message"], finish = tool_message(tools, text, c.finish_reason)
        else:
            body["message"] = {"role": "assistant",
                               "content": None if thought is not None and not text else text}
        if answer is not None:  # (both names: vLLM's older and newer)
            body["message"].update(reasoning_content=thought, reasoning=thought)
    body.update(logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)
    return body


def _completion_choice(c: SampleResult, want_logprobs: bool,
                       prompt: PromptPart) -> dict[str, Any]:
    text, entries = (("", []) if prompt.score_only else (c.text, c.logprobs))
    body: dict[str, Any] = {"index": c.index}
    if prompt.text is not None:  # echo
        body["text"] = prompt.text + text
        logprobs = completion_logprobs(prompt.entries + entries, 0) if want_logprobs else None
    else:
        body["text"] = text
        logprobs = completion_logprobs(entries, 0) if want_logprobs else None
    finish, stop = ("length", None) if prompt.score_only else (c.finish_reason, c.stop_reason)
    body.update(logprobs=logprobs, finish_reason=finish, stop_reason=stop)
    if prompt.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt.entries, prompt.prompt_logprobs)
    return body


def response_json(rid: str, model: str, chat: bool, choices: list[SampleResult],
                  prompt_tokens: int, want_logprobs: bool,
                  cached_tokens: int = 0, tools: Any = None,
                  prompts: list[PromptPart] | None = None, reasoning: Any = None
                  ) -> dict[str, Any]:
    """prompts: one per prompt (choices are prompt-major), when a completion echoes or
    scores them; a chat's prompt_logprobs go at the top, as vLLM has them. reasoning: a
    chat's ReasoningSpec."""
    n = len(choices) // max(1, len(prompts or [None]))
    parts = [prompts[i // n] if prompts else None for i in range(len(choices))]
    answers = [reasoning.answer(c.text, c.token_ids) if chat and reasoning is not None
               else None for c in choices]  # (each answer split once)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [choice_json(c, chat, want_logprobs, tools, part, answer)
                        for c, part, answer in zip(choices, parts, answers, strict=True)],
            "usage": usage(prompt_tokens,
                           0 if prompts and prompts[0].score_only
                           else sum(len(c.token_ids) for c in choices), cached_tokens,
                           None if not chat or reasoning is None else sum(
                               a.num_reasoning_tokens for a in answers if a is not None))}
    if chat and prompts and prompts[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompts[0].entries,
                                                       prompts[0].prompt_logprobs)
    return body


def chunk_json(rid: str, model: str, chat: bool, index: int, out: RequestOutput | None,
               want_logprobs: bool, created: int, *, role: bool = False,
               text_offset: int = 0, delta: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
    """One stream chunk for choice `index`: its role (chat, first), or an output delta.
    delta and finish_reason, if given, replace what out would say (tool calls)."""
    choice: dict[str, Any] = {"index": index}
    finish: Any = out.finish_reason if out is not None and out.finished else None
    if finish_reason is not None:
        finish = finish_reason
    if chat:
        if delta is None:
            delta = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif out is not None and (out.text or not out.finished):
                delta = {"content": out.text}
        choice["delta"] = delta
    else:
        choice["text"] = out.text if out is not None else ""
    logprobs = None
    if want_logprobs and out is not None and out.logprobs:
        logprobs = (chat_logprobs(out.logprobs) if chat
                    else completion_logprobs(out.logprobs, text_offset))
    choice.update(logprobs=logprobs, finish_reason=finish,
                  stop_reason=out.stop_reason if finish else None)
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, created: int, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0,
                reasoning_tokens: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}


def output_error(out: RequestOutput, prompt_param: str,
                 parsed: ParsedRequest | None = None) -> ApiError:
    """An engine error on a request that produced nothing, by whose fault it is: a bad field
    (400 naming it, by the API's name for it; prompt_param for the prompt as a whole), the
    engine unavailable (503), or a bug (500)."""
    message = out.error or f"the request ended with {out.finish_reason}"
    if out.error_kind is ErrorKind.UNAVAILABLE:  # no room now, or lost in a restart
        return ApiError(503, message, None, "service_unavailable",
                        headers={"Retry-After": "1"})
    if out.error_kind is ErrorKind.INTERNAL:
        return ApiError(500, message, None, "server_error")
    return bad(api_param(out.error_param, parsed) or prompt_param, message)
