"""The formats in which models write tool calls, each read back out of an answer's text, by
vLLM's names (`--tool-call-parser`): hermes, llama3_json, mistral, pythonic, qwen3_coder,
openai (gpt-oss harmony). Without the flag, the default reads Hermes and Llama 3.1's bare JSON
and, first, the format the model's chat template shows (detect). Runs in the HTTP front end.

Every parser is a pure function of the text (parse), so a stream and a whole answer agree:
pipeline/server/tools.py streams content up to a parser's markers and sends each call once
the parser says it is settled (no later text can change it); harmony, whose content and calls
interleave, is read once as it comes (streamer), and its parse is that reader fed it whole.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from ipc.messages import ToolSpec
from pipeline.server.harmony import HarmonyStream


@dataclass(frozen=True)
class FoundCall:
    """A call in an answer: its function, arguments (JSON text), and settled: its end was
    seen, so a longer answer holds the same call."""

    name: str
    arguments: str
    settled: bool = False


@dataclass
class ParsedAnswer:
    """An answer split into its calls and the rest: content (the text that is no call, as it
    is) and reasoning (harmony's analysis channel, which is no content)."""

    calls: list[FoundCall] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""


class ToolParser:
    """One format. markers: where a call may begin (content streams up to the first);
    openers: first characters of an answer that may be one call as a whole (it is held to
    the end); special_tokens: the format's tags are special tokens, so the answer must be
    decoded with them (skip_special_tokens false); settle_marks: text whose arrival may
    settle a call (a stream parses again only then: parsing at every token would cost the
    square of the answer's length)."""

    name = ""
    markers: tuple[str, ...] = ()
    openers = ""
    special_tokens = False
    settle_marks: tuple[str, ...] = ()

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        raise NotImplementedError

    def streamer(self) -> AnswerStream | None:
        """A reader of one answer as it comes, for a format whose content and calls
        interleave; None: a stream goes by the markers instead."""
        return None

    def call_id(self) -> str:
        return new_call_id()


def new_call_id() -> str:
    """A call's id, as OpenAI's look (a format with ids of its own overrides call_id)."""
    return "call_" + uuid.uuid4().hex[:24]


def _args(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    """text without the spans (in order, not overlapping)."""
    kept, last = [], 0
    for start, end in spans:
        kept.append(text[last:start])
        last = end
    return "".join(kept) + text[last:]


class Hermes(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5/3); an
    unclosed last one counts when its JSON is whole."""

    name, markers, settle_marks = "hermes", ("<tool_call>",), ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        calls, spans = [], []
        for m in self._CALL.finditer(text):
            try:
                value = json.loads(m.group(1))
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                args = value.get("arguments", value.get("parameters", {}))
                calls.append(FoundCall(value["name"], _args(args), bool(m.group(2))))
                spans.append(m.span())
        return ParsedAnswer(calls, _cut(text, spans))


class Llama3Json(ToolParser):
    """Llama 3.1's: the answer is one JSON call of a known function, `{"name": ...,
    "arguments"|"parameters": {...}}` (several joined by `;`), after an optional
    `<|python_tag|>`. Settled only at the end (more text would make it no call)."""

    name, markers, openers = "llama3_json", ("<|python_tag|>",), "{"
    TAG = "<|python_tag|>"

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        at = text.find(self.TAG)
        before, body = (text[:at], text[at + len(self.TAG):]) if at >= 0 else ("", text)
        names = {t.name for t in tools}
        calls = []
        for part in body.split(";") if body.strip() else []:
            try:
                value = json.loads(part)
            except ValueError:
                return ParsedAnswer([], text)
            if not (isinstance(value, dict) and value.get("name") in names):
                return ParsedAnswer([], text)
            calls.append(FoundCall(value["name"],
                                   _args(value.get("arguments", value.get("parameters", {})))))
        return ParsedAnswer(calls, before) if calls else ParsedAnswer([], text)


class Mistral(ToolParser):
    """Mistral's `[TOOL_CALLS]` (a special token) before a JSON list of {"name",
    "arguments"}, or (tokenizer v11+) before each call as `name[ARGS]{...}` (an optional
    `[CALL_ID]id` between). Call ids are 9 letters and digits, as Mistral's templates demand
    of the calls sent back."""

    name, markers, special_tokens = "mistral", ("[TOOL_CALLS]",), True
    settle_marks = ("]", "}")  # a JSON list or object closing
    TAG = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")
    _decoder = json.JSONDecoder()

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        calls, spans, at = [], [], text.find(self.TAG)
        while at >= 0:
            found, end = self._one(text, at + len(self.TAG))
            if found:
                calls += found
                spans.append((at, end))
            at = text.find(self.TAG, max(end, at + 1))
        return ParsedAnswer(calls, _cut(text, spans))

    def _one(self, text: str, at: int) -> tuple[list[FoundCall], int]:
        """The calls after one [TOOL_CALLS] at `at`, and where they end (none: at)."""
        named = self._NAMED.match(text, at)
        start = named.end() if named else len(text) - len(text[at:].lstrip())
        try:
            value, end = self._decoder.raw_decode(text, start)
        except ValueError:
            return [], at
        if named:  # arguments are an object (a bare number's digits might go on)
            if not isinstance(value, dict):
                return [], at
            return [FoundCall(named.group(1), _args(value), True)], end
        if isinstance(value, dict):
            value = [value]
        if not (isinstance(value, list) and value and all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in value)):
            return [], at
        return [FoundCall(c["name"], _args(c.get("arguments", c.get("parameters", {}))), True)
                for c in value], end

    def call_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class Pythonic(ToolParser):
    """Llama 3.2/4's: the answer is a Python list of calls, `[f(a=1, b="x"), g()]`
    (Llama 4 wraps it in `<|python_start|>`/`<|python_end|>`), read with `ast` (never
    evaluated): keyword arguments of literal values only, else it is no call."""

    name, markers, openers = "pythonic", ("<|python_start|>",), "["
    START, END = "<|python_start|>", "<|python_end|>"
    _JSON_NAMES = {"true": True, "false": False, "null": None}

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        at = text.find(self.START)
        if at >= 0:
            end = text.find(self.END, at)
            stop = len(text) if end < 0 else end + len(self.END)
            body, rest = text[at + len(self.START):stop - (0 if end < 0 else len(self.END))], \
                text[:at] + text[stop:]
        else:
            body, rest = text, ""
        calls = self._calls(body.strip())
        return ParsedAnswer(calls, rest) if calls else ParsedAnswer([], text)

    def _calls(self, body: str) -> list[FoundCall]:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return []
        if not (isinstance(tree, ast.List) and tree.elts):
            return []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and all(k.arg for k in node.keywords)):
                return []
            try:
                args = {k.arg: self._value(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return []
            calls.append(FoundCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls

    def _value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id in self._JSON_NAMES:
            return self._JSON_NAMES[node.id]
        if isinstance(node, ast.List):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):  # {**x}: no literal
                raise ValueError("dict unpacking")
            return {self._value(k): self._value(v)  # type: ignore[arg-type]
                    for k, v in zip(node.keys, node.values, strict=True)}
        value = ast.literal_eval(node)  # constants, tuples, sets, negative numbers
        return list(value) if isinstance(value, (tuple, set)) else value


class Qwen3Coder(ToolParser):
    """Qwen3-Coder's XML: `<tool_call><function=NAME><parameter=P>value</parameter>
    </function></tool_call>`; each value converted by the type the tool's JSON schema gives
    its parameter (a string stays as written, less one newline at each end). A call counts
    once `</function>` closes it."""

    name, markers, settle_marks = "qwen3_coder", ("<tool_call>", "<function="), ("</function>",)
    _CALL = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>"
                       r"(?:\s*</tool_call>)?", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        schemas = {t.name: json.loads(t.parameters) for t in tools}
        calls, spans = [], []
        for m in self._CALL.finditer(text):
            name = m.group(1).strip()
            props = schemas.get(name, {}).get("properties", {})
            args = {p.group(1).strip(): _typed(_trim(p.group(2)), props.get(p.group(1).strip()))
                    for p in self._PARAM.finditer(m.group(2))}
            calls.append(FoundCall(name, json.dumps(args, ensure_ascii=False), True))
            spans.append(m.span())
        return ParsedAnswer(calls, _cut(text, spans))


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type; as it is if it is not that type."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return value
    if value.strip().lower() in ("null", "none") and kind != "string":
        return None
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        return json.loads(value)  # object, array, or no schema: JSON if it is JSON
    except (ValueError, KeyError):
        if kind in ("object", "array"):
            try:
                return ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                pass
        return value


class AnswerStream(Protocol):
    """One answer read as it comes: feed gives what is new (content, reasoning, calls as
    each settles); what every feed and the final one gave adds up to parse(whole text)."""

    def feed(self, delta: str, final: bool = False) -> ParsedAnswer: ...


class OpenAIHarmony(ToolParser):
    """gpt-oss's harmony messages (pipeline/server/harmony.py): a message to
    `functions.NAME` with JSON content is a call (settled at its end tag); the final
    channel, commentary to no one (preambles) and untagged text are content; analysis is
    reasoning. Streamed as it comes (a call's message is held until it ends)."""

    name, markers, special_tokens = "openai", ("<|channel|>", "<|start|>"), True

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        return HarmonyCalls().feed(text, final=True)

    def streamer(self) -> AnswerStream:
        return HarmonyCalls()


class HarmonyCalls:
    """OpenAIHarmony's reading of one answer, fed as it comes."""

    def __init__(self) -> None:
        self.stream = HarmonyStream()
        self.held: dict[int, list[str]] = {}  # a function message's content, to its end

    def feed(self, delta: str, final: bool = False) -> ParsedAnswer:
        out = ParsedAnswer()
        for d in self.stream.feed(delta, final):
            if d.recipient is not None and d.recipient.startswith("functions."):
                self.held.setdefault(d.index, []).append(d.text)
                if d.done:
                    self._resolve(d.index, d.recipient, out, True)
            elif d.channel == "analysis":
                out.reasoning += d.text
            else:
                out.content += d.text
        if final:  # a call the text stopped inside (its <|call|> was a stop token)
            for index in list(self.held):
                msg = self.stream.messages[index]
                self._resolve(index, msg.recipient or "", out, False)
        return out

    def _resolve(self, index: int, recipient: str, out: ParsedAnswer, settled: bool) -> None:
        text = "".join(self.held.pop(index))
        try:
            arguments = json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:  # not a call after all: what the model wrote stays, as content
            out.content += text
            return
        out.calls.append(FoundCall(recipient[len("functions."):], arguments, settled))


class Either(ToolParser):
    """Several formats: the first that finds calls in an answer reads it (none: the first
    reads its content). Its calls settle only at the end, as another format may yet win."""

    def __init__(self, parsers: list[ToolParser]) -> None:
        self.parsers = parsers
        self.name = "+".join(p.name for p in parsers)
        self.markers = tuple(dict.fromkeys(m for p in parsers for m in p.markers))
        self.openers = "".join(dict.fromkeys(c for p in parsers for c in p.openers))
        self.special_tokens = any(p.special_tokens for p in parsers)

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedAnswer:
        first = None
        for p in self.parsers:
            found = p.parse(text, tools)
            if found.calls:
                found.calls = [FoundCall(c.name, c.arguments) for c in found.calls]
                return found
            first = first or found
        assert first is not None
        return first

    def call_id(self) -> str:
        return self.parsers[0].call_id()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Hermes, Llama3Json, Mistral, Pythonic, Qwen3Coder, OpenAIHarmony)}

HARMONY_SIGN = "<|channel|>"
# What a chat template shows of its model's format: its own tags, or the instructions of
# Llama 3.2/4's pythonic calls. In this order (Qwen3-Coder's template has `<tool_call>` too).
TEMPLATE_SIGNS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("func_name1(", "pythonic"),
    ("<|python_start|>", "pythonic"),
)


def default_parser(chat_template: Any) -> ToolParser:
    """Without --tool-call-parser: Hermes and Llama 3.1's bare JSON, after the format the
    chat template shows, if it shows one of the others (a tokenizer's chat_template: a
    string, or a dict of named templates). A harmony template's model (gpt-oss) writes
    nothing but harmony: its answers are read as harmony alone (so they stream)."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if isinstance(chat_template, str) and HARMONY_SIGN in chat_template:
        return OpenAIHarmony()
    found: list[ToolParser] = [Hermes(), Llama3Json()]
    for sign, name in TEMPLATE_SIGNS:
        if isinstance(chat_template, str) and sign in chat_template:
            found.insert(0, TOOL_PARSERS[name]())
            break
    return Either(found)


def tool_parser(name: str | None, chat_template: Any) -> ToolParser:
    """The parser --tool-call-parser names (one of TOOL_PARSERS), or the default."""
    return default_parser(chat_template) if name is None else TOOL_PARSERS[name]()
