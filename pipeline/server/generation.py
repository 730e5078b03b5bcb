"""One API request in the engine: its prompts (each with n samples) submitted through the
client, their outputs merged into choices, collected into one response or streamed as
server-sent events. Runs in each front-end worker process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ipc.messages import WHOLE_REQUEST, ErrorKind, FinishReason, RequestOutput, TokenLogprob
from ipc.outputs import SampleResult
from pipeline.runtime.client import PipelineClient, PipelineError
from pipeline.server.errors import ApiError, shutting_down
from pipeline.server.openai_parse import ParsedRequest
from pipeline.server.openai_render import (
    PromptPart,
    chunk_json,
    completion_logprobs,
    output_error,
    response_json,
    usage_chunk,
    vllm_prompt_logprobs,
)
from pipeline.server.reasoning import ReasoningParser, Split
from pipeline.server.tools import ToolStream

logger = logging.getLogger(__name__)


class FrontEnd(Protocol):
    """What a generation needs of the worker's front end (app.FrontEnd is the one; a
    protocol, so this module does not import the app that imports it)."""

    model: str
    client: PipelineClient
    metrics: Any
    generations: set[Generation]

    async def core(self) -> Any: ...


class ServerStopping(Exception):
    """The worker is shutting down: every stream ends now, with a final event."""


_STOPPING = object()  # put into a live generation's queue when the worker shuts down


class Generation:
    """One API request: its prompts (each with n samples) running in the engine, merged into
    one stream of (choice index, output). Leaving before the end aborts what still runs."""

    def __init__(self, front: FrontEnd, parsed: ParsedRequest, rid: str) -> None:
        self.front, self.parsed, self.rid = front, parsed, rid
        self.n = parsed.params.n
        self.model = parsed.params.lora_name or front.model  # (the id it answers under)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()  # (i, output), None, or _STOPPING
        self.tasks: list[asyncio.Task[None]] = []
        self._early: list[tuple[int, RequestOutput]] = []  # read by start(), yielded first
        self._done_feeds = 0
        self.prompt_tokens = [0] * len(parsed.prompts)
        self.cached_tokens = [0] * len(parsed.prompts)  # of each prompt, from the prefix cache
        self.latency = front.metrics.LatencyRecorder(front.model)
        self.choice_tokens = [[0] * self.n for _ in parsed.prompts]  # per prompt, per sample

    async def _feed(self, i: int) -> None:
        tools = self.parsed.tools.tools if self.parsed.tools is not None else ()
        hidden = self.parsed.eos_stop_ids
        try:  # (the stream made inside: a call that raises at once still reports)
            stream = self.front.client.stream(self.parsed.prompts[i], self.parsed.params,
                                              f"{self.rid}-{i}", tools,
                                              self.parsed.chat_template_kwargs)
            async with contextlib.aclosing(stream):  # closed (so aborted) however this ends
                async for out in stream:
                    if out.stop_reason is not None and out.stop_reason in hidden:
                        out = dataclasses.replace(out, stop_reason=None)  # EOS's, as EOS
                    self.queue.put_nowait((i, out))
        except PipelineError as exc:
            self.queue.put_nowait((i, RequestOutput.refusal(
                f"{self.rid}-{i}", ErrorKind.UNAVAILABLE, f"engine unavailable: {exc}")))
        except Exception as exc:  # never leave the request waiting for an output
            logger.exception("request %s-%d failed in the front end", self.rid, i)
            self.queue.put_nowait((i, RequestOutput.refusal(
                f"{self.rid}-{i}", ErrorKind.INTERNAL, f"front-end error: {exc}")))
        finally:
            self.queue.put_nowait(None)

    async def start(self) -> None:
        """Submit every prompt and wait for each one's first output, so that a request the
        engine refuses (a prompt too long, say) is answered with an HTTP error, not a stream."""
        self.front.generations.add(self)
        self.tasks = [asyncio.create_task(self._feed(i)) for i in range(len(self.parsed.prompts))]
        unanswered = set(range(len(self.parsed.prompts)))
        try:
            while unanswered:
                item = await self._next()
                if item is None:  # cannot happen: every feed reports before it ends
                    raise ApiError(500, "the request ended without an answer", None,
                                   "server_error")
                i, out = item
                unanswered.discard(i)
                self._early.append(item)
                if out.index == WHOLE_REQUEST or (out.finished and out.error):
                    param = "messages" if self.parsed.chat else "prompt"
                    raise output_error(out, param, self.parsed)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.front.generations.discard(self)

    def stop(self) -> None:
        """End this request now (the worker is shutting down): its reader raises
        ServerStopping, and leaving aborts the engine requests."""
        self.queue.put_nowait(_STOPPING)

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, output), or None once every feed has ended."""
        while self._done_feeds < len(self.tasks):
            item = await self.queue.get()
            if item is _STOPPING:
                raise ServerStopping
            if item is not None:
                return item
            self._done_feeds += 1
        return None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every sample of every prompt has finished."""
        try:
            for i, out in self._early:
                yield self._record(i, out)
            while (item := await self._next()) is not None:
                yield self._record(*item)
            self.latency.finished(self.prompt_tokens, self.choice_tokens)
        finally:
            self.cancel()

    def _record(self, i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        self.prompt_tokens[i] = out.num_prompt_tokens
        if out.index == 0:
            self.cached_tokens[i] = out.num_cached_tokens
        choice = i * self.n + max(out.index, 0)
        if out.token_ids:
            self.latency.tokens(choice, len(out.token_ids))
            self.choice_tokens[i][max(out.index, 0)] += len(out.token_ids)
        return choice, out

    async def collect(self) -> dict[str, Any]:
        """The whole response (the caller aborts it if the client goes away meanwhile)."""
        choices = [SampleResult(c) for c in range(len(self.parsed.prompts) * self.n)]
        errors: list[str] = []
        try:
            async for c, out in self.outputs():
                choices[c].add(out)
                if out.finished and out.error:
                    errors.append(out.error)
        except ServerStopping:
            raise shutting_down() from None
        if errors:
            raise ApiError(500, f"the engine failed the request: {errors[0]}", None,
                           "server_error")
        p = self.parsed
        prompts = None
        if self._uses_prompts():
            prompts = [await self._prompt_part(i, choices[i * self.n].prompt_logprobs)
                       for i in range(len(p.prompts))]
        return response_json(self.rid, self.model, p.chat, choices, sum(self.prompt_tokens),
                             p.params.logprobs is not None, sum(self.cached_tokens), p.tools,
                             prompts, p.reasoning)

    def _uses_prompts(self) -> bool:
        """Whether the answer says something of its prompts: echo, prompt logprobs, or a
        completion of max_tokens 0."""
        p = self.parsed
        return p.echo or p.score_only or p.prompt_logprobs is not None

    async def _prompt_part(self, i: int, entries: list[TokenLogprob] | None) -> PromptPart:
        p = self.parsed
        text = None
        if p.echo:
            prompt = p.prompts[i]
            text = prompt if isinstance(prompt, str) else (
                (await self.front.core()).tokenizer.decode(prompt))
        return PromptPart(text, entries or [], p.score_only, p.prompt_logprobs)

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        async for chunk in self.chunks():
            yield _event(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (OpenAI's chunk objects; an error body for a failed choice, and
        a last one if the worker stops), for sse() or another API's renderer (responses)."""
        p = self.parsed
        created = int(time.time())
        want_lp = p.params.logprobs is not None
        completion_tokens = 0
        offsets: dict[int, int] = {}
        tool_streams: dict[int, ToolStream] = {}
        thinking: dict[int, ThinkingChoice] = {}  # a chat's choices, with a reasoning parser
        scored: dict[int, list[TokenLogprob]] = {}  # prompt index -> its prompt logprobs
        try:
            if p.chat:
                for c in range(len(p.prompts) * self.n):
                    yield chunk_json(self.rid, self.model, True, c, None, want_lp,
                                     created, role=True)
            async for c, out in self.outputs():
                completion_tokens += 0 if p.score_only else len(out.token_ids)
                if out.finished and out.error:
                    yield ApiError(500, out.error, None, "server_error").body()
                    continue
                if not p.chat and self._uses_prompts():
                    if out.prompt_logprobs is not None:
                        scored[c // self.n] = out.prompt_logprobs
                    if c not in offsets:  # the choice's first chunk says its prompt
                        chunk, offsets[c] = await self._prompt_chunk(c, scored, created)
                        yield chunk
                    if p.score_only:
                        out = dataclasses.replace(out, text="", token_ids=[], logprobs=None,
                                                  finish_reason=FinishReason.LENGTH,
                                                  stop_reason=None)
                        if not out.finished:
                            continue
                if not (out.text or out.token_ids or out.finished):
                    continue
                if p.reasoning is not None:
                    choice = thinking.setdefault(c, ThinkingChoice(p.reasoning.new()))
                    thought, out = choice.feed(out)
                    if thought:
                        yield chunk_json(
                            self.rid, self.model, True, c, dataclasses.replace(
                                out, finished=False, finish_reason=None), want_lp, created,
                            delta={"reasoning_content": thought, "reasoning": thought})
                        out = dataclasses.replace(out, logprobs=None)
                        if not (out.text or out.finished):
                            continue
                    elif not (out.text or out.finished or (want_lp and out.logprobs)):
                        continue  # (all held: a tag may be coming)
                if p.tools is not None:
                    for chunk in self._tool_chunks(tool_streams, c, out, want_lp, created):
                        yield chunk
                    continue
                yield chunk_json(self.rid, self.model, p.chat, c, out, want_lp,
                                 created, text_offset=offsets.get(c, 0))
                offsets[c] = offsets.get(c, 0) + len(out.text)
            if p.include_usage:
                yield usage_chunk(self.rid, self.model, p.chat, created,
                                  sum(self.prompt_tokens), completion_tokens,
                                  sum(self.cached_tokens),
                                  None if p.reasoning is None else sum(
                                      p.reasoning.count(t.token_ids, t.parser)
                                      for t in thinking.values()))
        except ServerStopping:  # a final event, never a cut stream
            yield shutting_down().body()
        finally:
            self.cancel()  # a disconnected client lands here: its requests are aborted

    async def _prompt_chunk(self, c: int, scored: dict[int, list[TokenLogprob]],
                            created: int) -> tuple[dict[str, Any], int]:
        """A completion choice's first chunk: its prompt echoed (with the prompt tokens'
        logprobs), and vLLM's prompt_logprobs; and the text offset after it. Sample 0 of a
        prompt brings its prompt logprobs with its first output, before any sibling's (the
        siblings start after its prompt)."""
        p = self.parsed
        part = await self._prompt_part(c // self.n, scored.get(c // self.n))
        choice: dict[str, Any] = {"index": c, "text": part.text or "", "logprobs": None,
                                  "finish_reason": None, "stop_reason": None}
        if part.text is not None and p.params.logprobs is not None:
            choice["logprobs"] = completion_logprobs(part.entries, 0)
        if part.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(part.entries, part.prompt_logprobs)
        return ({"id": self.rid, "object": "text_completion", "created": created,
                 "model": self.model, "choices": [choice]}, len(choice["text"]))

    def _tool_chunks(self, streams: dict[int, ToolStream], c: int, out: RequestOutput,
                     want_lp: bool, created: int) -> list[dict[str, Any]]:
        """A tool-calling choice's chunks for one output: content or argument deltas as
        they can be told apart, the calls once complete, then the finish."""
        p = self.parsed
        stream = streams.setdefault(c, ToolStream(p.tools))
        deltas = stream.feed(out.text)
        reason = None
        if out.finished:
            more, reason = stream.finish(out.finish_reason)
            deltas += more
        # The output's logprobs go with its first chunk (held text reports them too).
        first = dataclasses.replace(out, finished=False, finish_reason=None)
        bare = dataclasses.replace(first, logprobs=None)
        chunks = [chunk_json(self.rid, self.model, True, c, bare if k else first,
                             want_lp and not k, created, delta=delta)
                  for k, delta in enumerate(deltas)]
        if out.finished:
            last = dataclasses.replace(out, logprobs=None) if deltas else out
            chunks.append(chunk_json(self.rid, self.model, True, c, last,
                                     want_lp and not deltas, created, delta={},
                                     finish_reason=reason))
        elif not deltas and want_lp and out.logprobs:
            chunks.append(chunk_json(self.rid, self.model, True, c, first, True, created,
                                     delta={}))
        return chunks


@dataclass
class ThinkingChoice:
    """A streamed chat choice's reasoning parser, and its tokens so far (for usage)."""

    parser: ReasoningParser
    token_ids: list[int] = field(default_factory=list)

    def feed(self, out: RequestOutput) -> tuple[str, RequestOutput]:
        """(the reasoning this output adds, the output with its text the content it adds)."""
        self.token_ids += out.token_ids
        split = self.parser.feed(out.text)
        if out.finished:
            last = self.parser.finish()
            split = Split(split.reasoning + last.reasoning, split.content + last.content)
        return split.reasoning, dataclasses.replace(out, text=split.content)


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
