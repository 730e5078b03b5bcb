"""OpenAI's Responses API (POST /v1/responses) mapped onto the chat machinery: a request becomes
a chat request body (messages, tools, response_format), parsed by parse_chat like any chat, and
the responses a client asked to keep (store: true) wait in a bounded store for a later request's
previous_response_id. Pure, no I/O; used by the HTTP front end in each worker process.

A field the chat side refuses is renamed back to the Responses field it came from, so every 400
names what the client sent (`max_output_tokens`, `text.format`, `input[3]`...).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pipeline.server.errors import ApiError, bad
from pipeline.server.openai_parse import ParsedRequest, parse_chat
from pipeline.server.responses_render import as_messages

# Fields of a Responses request this server implements; the rest is refused by name.
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
    "tool_choice", "parallel_tool_calls", "text", "stream", "store", "previous_response_id",
    "metadata", "user", "reasoning", "truncation", "include", "background",
    "prompt_cache_key", "service_tier"})
NOT_IMPLEMENTED = {
    "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
    "conversation": "conversation objects are not kept; use previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
}
# OpenAI's built-in tools: this server runs none of them (function tools only).
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                  "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                  "computer_use_preview", "computer_use", "image_generation", "mcp",
                  "local_shell", "shell", "custom", "apply_patch")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")  # what a message's content parts may be here
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 keys, keys 64 and values 512 characters


@dataclass
class ResponsesRequest:
    """A Responses request: the chat request it runs as, and what the response echoes."""

    parsed: ParsedRequest
    conversation: list[dict[str, Any]]  # chat messages, instructions left out (what is kept)
    echo: dict[str, Any]  # fields the response object repeats (tools, tool_choice, text...)
    store: bool = False
    origins: list[str] = field(default_factory=list)  # per chat message, its Responses field

    def renamed(self, exc: ApiError) -> ApiError:
        """An error the engine gave the chat request, naming the Responses field."""
        exc.param = responses_param(exc.param, self.origins)
        return exc


@dataclass
class Stored:
    """A kept response: its object (GET /v1/responses/{id}) and its whole conversation."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    size: int = 0  # characters, roughly: what it costs the store


@dataclass
class ResponseStore:
    """The responses kept in one worker process (store: true), oldest evicted first past
    max_responses or max_chars. Each API worker has its own: the server refuses store with
    more than one worker rather than answer a previous_response_id from the wrong one."""

    max_responses: int = 1000
    max_chars: int = 64 << 20
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    num_chars: int = 0

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]
            ) -> None:
        size = len(repr(response)) + len(repr(conversation))
        self.items[rid] = Stored(response, conversation, size)
        self.num_chars += size
        while self.items and (len(self.items) > self.max_responses
                              or self.num_chars > self.max_chars):
            _, old = self.items.popitem(last=False)
            self.num_chars -= old.size

    def keep(self, asked: ResponsesRequest, response: dict[str, Any]) -> None:
        """A finished response, kept for previous_response_id if its request asked."""
        if asked.store:
            self.put(response["id"], response,
                     asked.conversation + as_messages(response["output"]))

    def delete(self, rid: str) -> None:
        self.get(rid, "response_id")  # (the same 404)
        self.num_chars -= self.items.pop(rid).size

    def get(self, rid: str, param: str = "previous_response_id") -> Stored:
        """The kept response, or a 404 saying it was never kept or is gone."""
        if rid not in self.items:
            raise ApiError(404, f"no response {rid!r} is kept here: it was not created with "
                           "store: true, or it was evicted (this server keeps the last "
                           f"{self.max_responses} in memory) or the server restarted",
                           param, "invalid_request_error", "not_found")
        return self.items[rid]


def parse_responses(body: dict[str, Any], vocab_size: int, store: ResponseStore,
                    num_workers: int = 1) -> ResponsesRequest:
    """The chat request a Responses request runs as; every 400 names the Responses field."""
    for name in body:
        if name in NOT_IMPLEMENTED:
            raise bad(name, NOT_IMPLEMENTED[name])
        if name not in RESPONSES_FIELDS:
            raise bad(name, f"unknown field {name!r}: this server does not implement it")
    _check_refused(body)
    keep = _flag(body, "store")
    previous = body.get("previous_response_id")
    if (keep or previous is not None) and num_workers > 1:
        raise bad("store" if keep else "previous_response_id",
                  f"responses cannot be kept with --api-workers {num_workers}: each worker "
                  "process has its own store and a later request may reach another one")
    history: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id", "previous_response_id must be a string")
        history = list(store.get(previous).conversation)
    messages, origins = _instructions(body)
    new, new_origins = input_messages(body.get("input"))
    conversation = history + new
    messages += conversation
    origins += ["previous_response_id"] * len(history) + new_origins
    chat = {"messages": messages, "stream": _flag(body, "stream")}
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user"),
                         ("prompt_cache_key", "prompt_cache_key"),
                         ("service_tier", "service_tier"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(body, "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _reasoning_options(body, chat)
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    try:
        parsed = parse_chat(chat, vocab_size)
    except ApiError as exc:
        exc.param = responses_param(exc.param, origins)
        raise
    echo = {"instructions": body.get("instructions"), "max_output_tokens":
            body.get("max_output_tokens"), "metadata": _metadata(body), "previous_response_id":
            previous, "temperature": parsed.params.temperature, "top_p": parsed.params.top_p,
            "tools": [_echo_tool(t) for t in body.get("tools") or []],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "user": body.get("user"), "store": keep,
            "prompt_cache_key": body.get("prompt_cache_key"), "service_tier": "default"}
    return ResponsesRequest(parsed, conversation, echo, keep, origins)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean")
    return value


def _list(body: dict[str, Any], name: str) -> list[Any]:
    value = body[name]
    if not isinstance(value, list):
        raise bad(name, f"{name} must be an array")
    return value


def _check_refused(body: dict[str, Any]) -> None:
    """Options whose only supported value is the default."""
    if _flag(body, "background"):
        raise bad("background", "background responses are not supported")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", "truncation must be disabled: a conversation longer than the "
                                "context is refused, never cut")
    include = body.get("include") or []
    if not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise bad("include", "include must be an array of strings")
    for name in include:  # (no reasoning is ever encrypted here: that one asks for nothing)
        if name != "reasoning.encrypted_content":
            raise bad("include", f"include {name!r} is not supported: this server has no "
                                 "logprobs, images or built-in tool outputs to add")


SUMMARIES = ("auto", "concise", "detailed")


def _reasoning_options(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """reasoning.effort becomes the chat's reasoning_effort (the template's variable, as
    vLLM passes it); reasoning.summary is taken, and answered with the whole reasoning text
    (a reasoning item's `content`, its `summary` empty: no model here summarises, vLLM
    answers the same), so clients that ask for one by default (Codex) are served."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise bad("reasoning", "reasoning must be an object")
    for key, value in reasoning.items():
        if value is None:
            continue
        if key == "effort":
            chat["reasoning_effort"] = value  # (checked by the chat's parse, renamed back)
        elif key in ("summary", "generate_summary"):
            if value not in SUMMARIES:
                raise bad(f"reasoning.{key}", f"reasoning.{key} must be one of "
                                              f"{list(SUMMARIES)}, got {value!r}")
        else:
            raise bad(f"reasoning.{key}", f"reasoning.{key} is not supported")


def _instructions(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    value = body.get("instructions")
    if value is None:
        return [], []
    if not isinstance(value, str):
        raise bad("instructions", "instructions must be a string")
    return [{"role": "system", "content": value}], ["instructions"]


def input_messages(value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Responses input (a string, or items) as chat messages, and the input field each came
    from. Consecutive function_call items join one assistant message (the one before them,
    if it was the assistant's text), as a chat has them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list) or not value:
        raise bad("input", "input must be a string or a non-empty array of items")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_output(item, where))
        elif kind == "reasoning":
            _reasoning(item, where)  # checked, then left out of the prompt (ARCHITECTURE.md)
            continue
        else:
            raise bad(f"{where}.type", f"input items of type {kind!r} are not supported "
                      "(message, function_call, function_call_output and reasoning are)")
        origins.append(where)
    if not messages:
        raise bad("input", "input has no message, function call or function call output")
    return messages, origins


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in item:
        if key not in ("type", "role", "content", "id", "status", "phase"):
            raise bad(f"{where}.{key}", f"{where}.{key} is not supported")
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise bad(f"{where}.role", f"role must be one of {list(INPUT_ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content", "content must be a string or an array of parts")
    text = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{k}]", f"content parts of type {kind!r} are not "
                      "supported: only text (input_text, output_text) is read (the engine "
                      "runs language models: no images, files or audio)")
        text.append(part["text"])
    return {"role": role, "content": "".join(text)}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str)):
        raise bad(where, "a function_call item needs call_id, name and arguments (strings)")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _function_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise bad(f"{where}.call_id", "a function_call_output item needs its call_id")
    if isinstance(output, list):  # parts: text only
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "input_text"
                 else None for p in output]
        if any(not isinstance(p, str) for p in parts):
            raise bad(f"{where}.output", "output parts must be input_text")
        output = "".join(parts)  # type: ignore[arg-type]
    if not isinstance(output, str):
        raise bad(f"{where}.output", "output must be a string or an array of input_text parts")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning(item: dict[str, Any], where: str) -> None:
    if item.get("encrypted_content") is not None:
        raise bad(f"{where}.encrypted_content", "encrypted reasoning is not supported: this "
                                                "server never makes it")


def _tool(value: Any, i: int) -> dict[str, Any]:
    """Responses' flat function tool as the chat's nested one; a built-in tool refused."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in BUILT_IN_TOOLS or (isinstance(kind, str) and kind != "function"):
        raise bad(f"tools[{i}].type", f"the built-in tool {kind!r} is not supported: this "
                  "server runs function tools only")
    if kind != "function":
        raise bad(f"tools[{i}]", 'each tool must be {"type": "function", "name": ...}')
    fn = {k: v for k, v in value.items() if k != "type" and v is not None}
    return {"type": "function", "function": fn}


def _echo_tool(value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": value["name"], "description": value.get("description"),
            "parameters": value.get("parameters"), "strict": value.get("strict")}


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    kind = value.get("type") if isinstance(value, dict) else None
    raise bad("tool_choice", f"tool_choice must be none, auto, required or "
              f'{{"type": "function", "name": ...}}; {kind!r} is not supported')


def _text_format(text: Any) -> dict[str, Any] | None:
    """text.format as the chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "text must be an object")
    for key in text:
        if key != "format" and text[key] is not None:
            raise bad(f"text.{key}", f"text.{key} is not supported")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "text.format must be an object")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object; anything else the chat side refuses by name
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    value = body.get("metadata")
    if value is None:
        return None
    if not (isinstance(value, dict) and len(value) <= MAX_METADATA
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                    and len(v) <= 512 for k, v in value.items())):
        raise bad("metadata", f"metadata must be an object of at most {MAX_METADATA} string "
                              "values (keys up to 64 characters, values up to 512)")
    return dict(value)


_RENAMES = [(re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema"), "text.format"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.function"), "tool_choice"),
            (re.compile(r"^reasoning_effort$"), "reasoning.effort")]
_MESSAGE = re.compile(r"^messages\[(\d+)\]")


def responses_param(param: str | None, origins: list[str]) -> str | None:
    """The Responses field a chat field came from."""
    if param is None:
        return None
    found = _MESSAGE.match(param)
    if found:
        index = int(found.group(1))
        return origins[index] if index < len(origins) else "input"
    if param == "messages":
        return "input"
    for pattern, name in _RENAMES:
        if pattern.match(param):
            return pattern.sub(name, param)
    return param
