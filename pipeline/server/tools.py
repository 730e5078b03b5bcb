"""Tool calling for /v1/chat/completions: the request's `tools` and `tool_choice`, and the model's
output turned back into OpenAI's `tool_calls`, whole or streamed as deltas.

`tool_choice` "required" and a named function are enforced by structured outputs (the output
is JSON under a schema built here, so the arguments always parse); "auto" lets the model choose
and the output is parsed for the tool-call format the prompt taught it (the request's
parser, pipeline/server/tool_parsers.py: the one --tool-call-parser names, or Hermes'
`<tool_call>{...}</tool_call>` and Llama 3.1's bare JSON after the format the chat template
shows); "none" calls nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ipc.messages import FinishReason, StructuredOutputs, ToolSpec
from pipeline.server.errors import bad
from pipeline.server.tool_parsers import (
    AnswerStream,
    FoundCall,
    ParsedAnswer,
    ToolParser,
    default_parser,
    new_call_id,
)
from stages.text_stream import hold_back

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolRequest:
    """What a chat request asked of tools."""

    tools: list[ToolSpec]
    choice: str  # auto, none, required, or named
    name: str | None = None  # the function, when choice is named
    parallel: bool = True
    # how auto's answers are read (the front end sets it from --tool-call-parser or the
    # chat template)
    parser: ToolParser = field(default_factory=lambda: default_parser(None))

    def structured(self) -> StructuredOutputs | None:
        """The format that enforces the choice (required, named), or None."""
        if self.choice == "named":
            spec = next(t for t in self.tools if t.name == self.name)
            return StructuredOutputs(json=spec.parameters)
        if self.choice == "required":
            calls = [{"type": "object", "properties": {
                "name": {"const": t.name}, "arguments": json.loads(t.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False}
                for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputs(json=json.dumps(schema))
        return None


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls; None when there are no tools (or the
    choice is none, when the prompt need not show them either)."""
    tools_field, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools_field is None or tools_field == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools_field, list) or len(tools_field) > MAX_TOOLS:
        raise bad("tools", f"tools must be an array of at most {MAX_TOOLS} functions")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools_field)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad("tools", "tool names must be unique")
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
        return None if kind == "none" else ToolRequest(tools, kind, None, parallel)
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice.function.name", f"tool_choice names {name!r}, which is not "
                                                   f"among the tools ({', '.join(names)})")
        return ToolRequest(tools, "named", name, parallel)
    raise bad("tool_choice", "tool_choice must be none, auto, required or "
                             '{"type": "function", "function": {"name": ...}}')


def _tool(value: Any, where: str) -> ToolSpec:
    if not (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("function"), dict)):
        raise bad(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
    fn = value["function"]
    for key in fn:
        if key not in ("name", "description", "parameters", "strict"):
            raise bad(f"{where}.function.{key}", f"{where}.function.{key} is not supported")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(f"{where}.function.name", "a function name is 1 to 64 letters, digits, "
                                            "underscores or dashes")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise bad(f"{where}.function.description", "description must be a string")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise bad(f"{where}.function.parameters", "parameters must be a JSON Schema object")
    return ToolSpec(name, description, json.dumps(parameters))


def auto_calls(req: ToolRequest, text: str) -> ParsedAnswer:
    """The calls in an answer the model was free to give (at most one unless parallel), as
    the request's parser reads them, and the rest."""
    found = req.parser.parse(text, req.tools)
    if not req.parallel:
        found.calls = found.calls[:1]
    return found


def _call(name: str, arguments: str, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def message(req: ToolRequest, text: str, finish: FinishReason | None
            ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole answer, and its finish reason (tool_calls when the
    model called a tool)."""
    content: str | None = text
    calls: list[dict[str, Any]] = []
    reasoning = ""
    if req.choice == "named":
        assert req.name is not None
        calls, content = [_call(req.name, text)], None
    elif req.choice == "required":
        try:
            parsed = json.loads(text)
            calls = [_call(c["name"], json.dumps(c["arguments"])) for c in parsed]
            content = None
        except (ValueError, TypeError, KeyError):  # cut by max_tokens: leave the text
            calls = []
    else:
        found = auto_calls(req, text)
        calls = [_call(c.name, c.arguments, req.parser.call_id()) for c in found.calls]
        content = None if calls and not found.content.strip() else found.content
        reasoning = found.reasoning
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if req.choice == "auto" and reasoning:  # harmony's analysis channel
        out["reasoning_content"] = out["reasoning"] = reasoning
    if calls:
        out["tool_calls"] = calls
    reason = finish.value if finish is not None else None
    if calls and finish is FinishReason.STOP:
        reason = "tool_calls"
    return out, reason


@dataclass
class ToolStream:
    """One choice's stream: text deltas in, OpenAI deltas out. A named function streams its
    arguments as they come; required holds the answer to the end; auto streams content up
    to where a call may begin (one of the parser's markers, or an answer that opens as a
    whole call may), then sends each call as the parser settles it (its id, type and name,
    then its arguments) and the rest at the end. The deltas add up to `message` of the whole
    text, wherever the text was split. The text is kept in pieces (`+=` on a long answer
    would copy it at every token)."""

    req: ToolRequest
    pieces: list[str] = field(default_factory=list)  # the text so far
    unsent: str = ""  # auto: the text after what was sent as content
    sent: int = 0  # auto: characters sent as content
    held: bool = False  # auto: a tool call may have begun; content is held from `sent` on
    num_calls: int = 0  # auto: the calls sent
    started: bool = False  # named: the call's first delta (id, name) was sent
    _id: str = field(default_factory=new_call_id)
    _reader: AnswerStream | None = None  # auto, a format read as it comes
    _found: list[FoundCall] = field(default_factory=list)  # what _reader settled
    _spaces: str = ""  # _reader's content while only whitespace, held

    def __post_init__(self) -> None:
        if self.req.choice == "auto":
            self._reader = self.req.parser.streamer()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas (chat.completion.chunk `delta` objects) to send for new text."""
        self.pieces.append(delta)
        if self.req.choice == "named":
            out = []
            if not self.started:
                self.started = True
                out.append({"tool_calls": [{"index": 0, "id": self._id, "type": "function",
                                            "function": {"name": self.req.name,
                                                         "arguments": ""}}]})
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.req.choice == "required":
            return []
        if self._reader is not None:
            return self._progress(self._reader.feed(delta))
        self.unsent += delta
        was_held = self.held
        out = [] if self.held else self._content()
        if self.held and self._may_settle(len(delta) if was_held else len(self.unsent)):
            found = auto_calls(self.req, self.unsent)
            out += self._calls([c for c in found.calls if c.settled])
        return out

    def _may_settle(self, num_new: int) -> bool:
        """Whether the last num_new characters (with what a settle mark may have begun
        before them) hold one of the parser's settle marks."""
        marks = self.req.parser.settle_marks
        longest = max((len(m) for m in marks), default=1)
        tail = self.unsent[max(0, len(self.unsent) - num_new - longest + 1):]
        return any(m in tail for m in marks)

    def _content(self) -> list[dict[str, Any]]:
        """auto: content up to a possible start of a call (and none while it is only
        whitespace: an answer that is only calls has no content)."""
        parser, unsent = self.req.parser, self.unsent
        if not self.sent and unsent.lstrip()[:1] in tuple(parser.openers):
            self.held = True
            return []
        marks = [i for m in parser.markers if (i := unsent.find(m)) >= 0]
        if marks:
            self.held = True
            end = min(marks)
        else:
            end = len(unsent) - hold_back(unsent, parser.markers)
        if not end or (not self.sent and not unsent[:end].strip()):  # (sent: not all spaces)
            return []
        self.sent, self.unsent = self.sent + end, unsent[end:]
        return [{"content": unsent[:end]}]

    def _progress(self, found: ParsedAnswer, end: bool = False) -> list[dict[str, Any]]:
        """A format read as it comes: the deltas of what _reader found new (content once it
        is more than whitespace, or at the end when there are no calls)."""
        out: list[dict[str, Any]] = []
        if found.reasoning:
            out.append({"reasoning_content": found.reasoning, "reasoning": found.reasoning})
        self._found += found.calls
        calls = self._found if self.req.parallel else self._found[:1]
        content = self._spaces + found.content
        if content and (self.sent or content.strip() or (end and not calls)):
            out.append({"content": content})
            self.sent, self._spaces = self.sent + len(content), ""
        else:
            self._spaces = content
        return out + self._calls(calls)

    def _calls(self, calls: list[Any]) -> list[dict[str, Any]]:
        """The deltas of the calls not sent yet: id, type and name, then the arguments."""
        out = []
        for i, c in enumerate(calls[self.num_calls:], self.num_calls):
            out.append({"tool_calls": [{"index": i, "id": self.req.parser.call_id(),
                                        "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        self.num_calls = max(self.num_calls, len(calls))
        return out

    def finish(self, finish: FinishReason | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas once the output ended, and the finish reason."""
        text = "".join(self.pieces)
        msg, reason = message(self.req, text, finish)
        if self.req.choice == "named":
            return [], reason
        if self.req.choice == "required":
            if not msg.get("tool_calls"):  # cut short: the answer is content
                return ([{"content": text}] if text else []), reason
            return [{"tool_calls": [{"index": i, **call}]}
                    for i, call in enumerate(msg["tool_calls"])], reason
        if self._reader is not None:
            return self._progress(self._reader.feed("", final=True), end=True), reason
        found = auto_calls(self.req, self.unsent)
        out: list[dict[str, Any]] = []
        if found.reasoning:
            out.append({"reasoning_content": found.reasoning, "reasoning": found.reasoning})
        if found.content and (self.sent or found.content.strip() or not found.calls):
            out.append({"content": found.content})
        return out + self._calls(found.calls), reason


