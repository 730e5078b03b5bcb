"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's answer split into
its reasoning (OpenAI-compatible servers' `reasoning_content`, and `reasoning`) and its
content, whole or streamed. Pure text functions, no I/O; used by the HTTP front end.

A parser is fed the answer's text deltas and returns (reasoning, content) deltas; a tag split
over two deltas is held until it can be told apart, so it never leaks into either field, and
feeding the text in any pieces gives the same fields as feeding it whole. Whether the answer
starts inside the reasoning is the prompt's to say: a template may open `<think>` itself (then
the model writes only `</think>`), or close it empty (Qwen3's enable_thinking=False).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ipc.errors import ConfigError
from ipc.messages import ReasoningTags
from pipeline.server.errors import bad
from pipeline.server.harmony import ENDS, HarmonyDelta, HarmonyStream, write_header
from stages.text_stream import hold_back

logger = logging.getLogger(__name__)


class Split(NamedTuple):
    reasoning: str
    content: str


class _State(enum.Enum):
    START = "start"  # may open with the start tag; else the answer is all content
    OPENING = "opening"  # reasoning already; a start tag the model writes anyway is dropped
    REASONING = "reasoning"
    AFTER = "after"  # just past the end tag: whitespace before the content is dropped
    CONTENT = "content"


class ReasoningParser:
    """`<think>`-style reasoning: text between the start and the end tag is reasoning, the
    rest content (its leading whitespace dropped). `in_reasoning`: the prompt left the
    reasoning open (the answer begins inside it). Reasoning never ended (cut by max_tokens)
    stays reasoning."""

    name = ""
    start_tag, end_tag = "<think>", "</think>"
    tag_optional = False  # the answer starts inside the reasoning even with no start tag
    needs_special_tokens = False  # its tags are special tokens: answers must keep them

    def __init__(self, in_reasoning: bool = False) -> None:
        opens = in_reasoning or self.tag_optional
        self.state = _State.OPENING if opens else _State.START
        self.held = ""  # text not yet told apart (a possible tag, or leading whitespace)
        self.entered = opens  # whether any of the answer was reasoning
        self.ended = False  # whether the reasoning ended (its end tag came)

    def feed(self, delta: str) -> Split:
        """The (reasoning, content) deltas that `delta` makes known."""
        text, self.held = self.held + delta, ""
        reasoning, content = [], []
        while text:
            state = self.state
            if state in (_State.START, _State.OPENING):
                head = text.lstrip()
                if head.startswith(self.start_tag):
                    text, self.state, self.entered = (head[len(self.start_tag):],
                                                      _State.REASONING, True)
                elif self.start_tag.startswith(head):  # (all whitespace, or part of the tag)
                    self.held = text
                    break
                else:
                    self.state = _State.CONTENT if state is _State.START else _State.REASONING
            elif state is _State.REASONING:
                at = text.find(self.end_tag)
                if at >= 0:
                    reasoning.append(text[:at])
                    text, self.state, self.ended = (text[at + len(self.end_tag):],
                                                    _State.AFTER, True)
                else:
                    keep = hold_back(text, (self.end_tag,))
                    reasoning.append(text[:len(text) - keep])
                    self.held = text[len(text) - keep:]
                    break
            elif state is _State.AFTER:
                text = text.lstrip()
                if text:
                    self.state = _State.CONTENT
            else:
                content.append(text)
                break
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What is still held once the answer has ended."""
        held, self.held = self.held, ""
        if self.state is _State.START:
            return Split("", held)
        if self.state in (_State.OPENING, _State.REASONING):
            return Split(held, "")
        return Split("", "")  # (whitespace after the end tag)

    def split(self, text: str) -> Split:
        """A whole answer at once."""
        a, b = self.feed(text), self.finish()
        return Split(a.reasoning + b.reasoning, a.content + b.content)


class Qwen3Parser(ReasoningParser):
    """Qwen3: the answer opens `<think>` itself (or the template did); with
    enable_thinking=False the template closes an empty block, and the answer is content."""

    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: its template opens `<think>`, so the answer is reasoning up to
    `</think>` whether or not it writes the start tag (as vLLM's parser assumes)."""

    name = "deepseek_r1"
    tag_optional = True


class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony format, read by harmony.HarmonyStream (the one harmony reader, the
    openai tool parser's too): a message on the `analysis` channel is reasoning, one on
    `final` (or text outside any message: a model not speaking harmony) content. A message on
    another channel (`commentary`: tool calls, preambles) goes to content written back in
    harmony, header and end tag, for a tool parser to read. Its markers are special tokens:
    its answers are detokenized with them (`needs_special_tokens`)."""

    name = "openai_gptoss"
    start_tag, end_tag = "<|channel|>analysis<|message|>", "<|end|>"
    needs_special_tokens = True

    def __init__(self, in_reasoning: bool = False) -> None:
        super().__init__(False)
        self.entered = self.ended = False
        self.stream = HarmonyStream()
        self._written = -1  # the last message written back whole (its header sent)

    def feed(self, delta: str) -> Split:
        return self._split(self.stream.feed(delta))

    def finish(self) -> Split:
        return self._split(self.stream.feed("", final=True))

    def _split(self, deltas: list[HarmonyDelta]) -> Split:
        reasoning, content = [], []
        for d in deltas:
            if d.channel == "analysis":
                self.entered = True
                self.ended |= d.done
                reasoning.append(d.text)
            elif d.channel in (None, "final"):
                content.append(d.text)
            else:  # kept as written, for a tool parser
                message = self.stream.header(d.index)
                if d.index != self._written:
                    self._written = d.index
                    content.append(write_header(message))
                content.append(d.text)
                if d.done:
                    content.append(message.end or ENDS[0])
        return Split("".join(reasoning), "".join(content))


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3Parser, DeepSeekR1Parser,
                                                                 HarmonyParser)}
# vLLM's names that are not served, with why
REFUSED: dict[str, str] = {}


@dataclass(frozen=True)
class ReasoningSpec:
    """A chat request's reasoning, as the front end found it: the parser, whether its prompt
    left the reasoning open, the end tag's token id (None: not one token), and the tokenizer's
    decode, as answers are detokenized (to count the tokens of an end tag of several)."""

    parser: type[ReasoningParser]
    opened: bool
    end_id: int | None
    start_id: int | None = None
    decode: Callable[[list[int]], str] | None = field(default=None, compare=False)

    def new(self) -> ReasoningParser:
        return self.parser(self.opened)

    def tags(self) -> ReasoningTags | None:
        """The tags a structured output waits for (None: the end tag is not one token, or
        the reasoning does not end with one: harmony's)."""
        if self.end_id is None or self.parser.needs_special_tokens:
            return None
        opened = self.opened or self.parser.tag_optional
        return ReasoningTags(-1 if self.start_id is None else self.start_id, self.end_id,
                             opened)

    def answer(self, text: str, token_ids: list[int]) -> Answer:
        """A whole answer's fields, and how many of its tokens were reasoning."""
        parser = self.new()
        reasoning, content = parser.split(text)
        return Answer(reasoning if parser.entered else None, content,
                      self.count(token_ids, parser))

    def count(self, token_ids: list[int], parser: ReasoningParser) -> int:
        """How many of an answer's tokens were reasoning (`parser`: the one that read it)."""
        return reasoning_tokens(token_ids, parser, self.end_id, self.decode)


class Answer(NamedTuple):
    reasoning: str | None  # None: the answer had no reasoning
    content: str
    num_reasoning_tokens: int


def reasoning_spec(tokenizer: Any, name: str, parsed: Any) -> ReasoningSpec:
    """A chat request's ReasoningSpec (parsed: its openai_parse.ParsedRequest): its prompt
    rendered as the tokenizer stage will, to see whether the template opened the reasoning.
    A template that fails here fails there too, and that error is the answer. A structured
    output (response_format, tool_choice required or named) gets the tags to wait for
    (parsed.params.reasoning): it constrains the answer after the reasoning, not the
    reasoning."""
    from stages.chat_template import render, template_kwargs

    parser = PARSERS[name]
    tools = parsed.tools.tools if parsed.tools is not None else []
    try:
        prompt = render(tokenizer, parsed.prompts[0], tools,
                        template_kwargs(parsed.chat_template_kwargs))
    except Exception:  # noqa: BLE001 (the tokenizer stage answers with the error)
        prompt = ""
    skip = not parser.needs_special_tokens  # (as the detokenizer writes answers)
    spec = ReasoningSpec(parser, prompt_opens_reasoning(prompt, parser),
                         token_id(tokenizer, parser.end_tag), token_id(tokenizer, parser.start_tag),
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=skip))
    if parsed.params.structured_outputs is not None:  # (tools' required and named too)
        tags = spec.tags()
        if tags is None:
            raise bad(parsed.structured_param, f"{parsed.structured_param} cannot follow the "
                      f"reasoning of --reasoning-parser {name}: it does not end with one "
                      "token (not supported)")
        parsed.params = dataclasses.replace(parsed.params, reasoning=tags)
    return spec


def check_parser(name: str | None) -> str | None:
    """A --reasoning-parser value, or a ConfigError naming it."""
    if name is None or name in PARSERS:
        return name
    if name in REFUSED:
        raise ConfigError(f"--reasoning-parser {name} is not supported: {REFUSED[name]}")
    raise ConfigError(f"--reasoning-parser {name!r} is not known (use one of "
                      f"{sorted(PARSERS)})")


def prompt_opens_reasoning(prompt: str, parser: type[ReasoningParser]) -> bool:
    """Whether a rendered chat prompt leaves the reasoning open: its last start tag comes
    after its last end tag (a template that opens `<think>` for the model)."""
    start = prompt.rfind(parser.start_tag)
    return start >= 0 and prompt.find(parser.end_tag, start) < 0


def token_id(tokenizer: Any, tag: str) -> int | None:
    """The tag's token id, or None if the tag is not one token."""
    ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def tags_survive(tokenizer: Any, parser: type[ReasoningParser]) -> str | None:
    """Why the detokenized answer would lose a tag (the tokenizer marks it special, and
    special tokens are skipped), or None when both come through as text."""
    if parser.needs_special_tokens:
        return None  # (answers keep them)
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    lost = [t for t in (parser.start_tag, parser.end_tag) if t in special]
    if lost:
        return (f"the tokenizer marks {lost} as special tokens, which answers skip: "
                f"--reasoning-parser {parser.name} cannot find them")
    return None


def reasoning_tokens(token_ids: list[int], parser: ReasoningParser, end_id: int | None,
                     decode: Callable[[list[int]], str] | None = None) -> int:
    """The answer's tokens that were reasoning: up to its end tag's (included), all of them
    if the reasoning never ended, none if there was none. An end tag of several tokens (or
    one the tokenizer merged with the text beside it): the fewest first tokens whose text
    (`decode`) holds it, found by bisection."""
    if not parser.entered:
        return 0
    if not parser.ended:
        return len(token_ids)
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    if decode is None or parser.end_tag not in decode(token_ids):  # (the parser saw it)
        logger.warning("the reasoning ended, but %r is not in the answer's tokens: all %d "
                       "counted as reasoning", parser.end_tag, len(token_ids))
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # (hi holds the tag)
    while lo < hi:
        mid = (lo + hi) // 2
        if parser.end_tag in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return hi
