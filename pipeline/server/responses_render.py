"""Chat outputs rendered as OpenAI Responses objects: a whole chat.completion as a `response`
(reasoning, message and function_call output items), and a chat chunk stream as the Responses
server-sent events (response.created ... response.completed, each with its sequence_number).
Pure, no I/O; used by the HTTP front end (pipeline/server/app.py) in each worker process.

A chat message's thinking (`reasoning_content`, or `reasoning`, when a reasoning parser split
it out) becomes a `reasoning` item with one reasoning_text part, before the message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

Item = dict[str, Any]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    return new_item_id("resp")


def _reasoning_of(fields: dict[str, Any]) -> str | None:
    """A chat message's or delta's thinking, under either name vLLM emits."""
    text = fields.get("reasoning_content")
    return text if text is not None else fields.get("reasoning")


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> Item:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "summary": [],
            "content": content, "encrypted_content": None, "status": status}


def message_item(text: str | None, status: str = "completed", item_id: str | None = None
                 ) -> Item:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> Item:
    return {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], finish: str | None) -> list[Item]:
    """A chat answer's message as Responses output items: its thinking, its text, its calls."""
    items = []
    thinking = _reasoning_of(message)
    if thinking:
        items.append(reasoning_item(thinking))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or not calls:
        status = "incomplete" if finish == "length" else "completed"
        items.append(message_item(content or "", status))
    for call in calls:
        fn = call["function"]
        items.append(call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat usage object in the Responses shape (input/output tokens)."""
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def response_object(rid: str, model: str, created: int, echo: dict[str, Any],
                    output: list[Item], status: str, usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object; echo holds the request's fields it repeats."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": created, "model": model,
            "status": status, "output": output, "error": error,
            "incomplete_details": incomplete, "usage": usage, "reasoning": None,
            "truncation": "disabled", "background": False, **echo}


def whole_response(rid: str, model: str, echo: dict[str, Any], chat: dict[str, Any]
                   ) -> dict[str, Any]:
    """A whole chat.completion (one choice) as a Responses `response`."""
    (choice,) = chat["choices"]
    finish = choice["finish_reason"]
    return response_object(rid, model, chat["created"], echo,
                           output_items(choice["message"], finish),
                           "incomplete" if finish == "length" else "completed",
                           usage(chat.get("usage")))


def as_messages(output: list[Item]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn continues from (the
    thinking is left out, as the chat templates of thinking models leave it out)."""
    text = "".join(p["text"] for item in output if item["type"] == "message"
                   for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls
                               else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass
class ResponsesStream:
    """Chat chunks of one choice in, Responses events out: the item open now (reasoning,
    message or function call) grows by deltas and is closed (its .done events) when another
    begins or the stream ends. The final response object holds exactly the items streamed."""

    rid: str
    model: str
    echo: dict[str, Any]
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[Item] = field(default_factory=list)  # items, the last one perhaps open
    is_open: bool = False
    finish: str | None = None
    usage: dict[str, Any] | None = None
    sequence: int = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = response_object(self.rid, self.model, self.created, self.echo, [],
                                   "in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat chunk (its delta, finish reason or usage)."""
        if chunk.get("usage") is not None:
            self.usage = usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            thinking = _reasoning_of(delta)
            if thinking:
                events += self._text("reasoning", thinking)
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return events

    def _open(self, item: Item) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self.is_open = True
        return events + [self._event("response.output_item.added",
                                     output_index=len(self.output) - 1,
                                     item=json.loads(json.dumps(item)))]

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self.output[-1] if self.is_open else None
        if item is None or item["type"] != kind:
            item = (reasoning_item("", "in_progress") if kind == "reasoning"
                    else message_item(None, "in_progress"))
            events += self._open(item)
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else _text_part(""))
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=dict(part)))
        if not delta:
            return events
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, **self._where(), content_index=0, delta=delta, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        fn = call.get("function") or {}
        if call.get("id"):  # a call begins
            events += self._close()
            events += self._open(call_item(call["id"], fn.get("name", ""), "", "in_progress"))
        item = self.output[-1]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(), delta=fn["arguments"]))
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _close(self) -> list[dict[str, Any]]:
        if not self.is_open:
            return []
        self.is_open = False
        item = self.output[-1]
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      **self._where(), arguments=item["arguments"]))
            item["status"] = "completed"
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            done = {"text": part["text"]} if kind == "reasoning_text" else \
                {"text": part["text"], "logprobs": []}
            events.append(self._event(f"response.{kind}.done", **self._where(),
                                      content_index=0, **done))
            events.append(self._event("response.content_part.done", **self._where(),
                                      content_index=0, part=dict(part)))
            incomplete = item["type"] == "message" and self.finish == "length"
            item["status"] = "incomplete" if incomplete else "completed"
        events.append(self._event("response.output_item.done", output_index=len(self.output) - 1,
                                  item=json.loads(json.dumps(item))))
        return events

    def end(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The last events, and the final response object."""
        events = self._text("message", "") if not self.output else []  # (empty: a message)
        events += self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        response = self.response(status)
        return events + [self._event(f"response.{status}", response=response)], response

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.rid, self.model, self.created, self.echo, self.output,
                               status, self.usage, error)

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of a stream the engine failed: an error event, then response.failed."""
        body = error.get("error", error)
        events = [self._event("error", code=body.get("code") or body.get("type"),
                              message=body.get("message", ""), param=body.get("param"))]
        failure = {"code": "server_error", "message": body.get("message", "")}
        return events + [self._event("response.failed", response=self.response("failed",
                                                                                 failure))]


async def response_sse(chunks: AsyncIterator[dict[str, Any]], stream: ResponsesStream,
                       on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The Responses event stream of a chat chunk stream (Generation.chunks()); on_done gets
    the final response object of a stream that completed (not of one that failed)."""
    for event in stream.start():
        yield _sse(event)
    async for chunk in chunks:
        if "error" in chunk:  # the engine failed the request, or the worker is stopping
            for event in stream.fail(chunk):
                yield _sse(event)
            return
        for event in stream.feed(chunk):
            yield _sse(event)
    events, response = stream.end()
    for event in events:
        yield _sse(event)
    on_done(response)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
