"""OpenAI's harmony format (gpt-oss) read back out of an answer's text: its messages, each
with a channel (analysis: reasoning; commentary: preambles and tool calls; final: the answer)
and a recipient (`to=functions.NAME` for a call). Whole (parse_harmony) or streamed
(HarmonyStream). Pure text, no tokenizer: the answer must be decoded with its special tokens
(`<|channel|>` and the others are special tokens of gpt-oss's tokenizer). Runs in the HTTP
front end (tool calls; and the reasoning parser, which takes its analysis/final split).

An answer starts after the prompt's `<|start|>assistant`, so its first message's header has
no `<|start|>`: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>
commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`. A message ends at
`<|end|>`, `<|call|>`, `<|return|>`, the next `<|start|>`, or the end of the text (then it is
not `done`: the model was cut, or its stop token, `<|call|>`/`<|return|>`, was not shown).
Text before any header (the tags were skipped) is one message of channel None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_TAG = re.compile("|".join(re.escape(t) for t in TAGS))
_LONGEST = max(len(t) for t in TAGS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


@dataclass
class HarmonyMessage:
    """One message of an answer. channel: analysis, commentary, final, or None (text outside
    any header); recipient: e.g. `functions.get_weather`, or None; content_type: e.g. json
    (the header's `<|constrain|>json`); done: its end tag was seen (end is which)."""

    channel: str | None
    recipient: str | None = None
    content_type: str | None = None
    content: str = ""
    done: bool = False
    end: str | None = None

    @property
    def function(self) -> str | None:
        """The function this message calls (`to=functions.NAME`), or None."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions."):]
        return None


@dataclass(frozen=True)
class HarmonyDelta:
    """New content of message `index` (HarmonyStream.feed), with its header's fields; done:
    the message ended here (its last delta, whose text may be empty)."""

    index: int
    channel: str | None
    recipient: str | None
    text: str
    done: bool = False


def _header(text: str) -> HarmonyMessage:
    """A message's header: `assistant<|channel|>commentary to=functions.f <|constrain|>json`
    (role, channel, recipient and content type, the recipient before or after the channel)."""
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    content_type = None
    if CONSTRAIN in text:
        words = text.split(CONSTRAIN, 1)[1].split()
        content_type = words[0] if words else None
    elif channel is not None:
        rest = text[channel.end():].split()
        words = [w for w in rest if not w.startswith("to=")]
        content_type = words[0] if words else None
    return HarmonyMessage(channel.group(1) if channel else None,
                          recipient.group(1) if recipient else None, content_type)


def write_header(message: HarmonyMessage) -> str:
    """A message's header in harmony, as a model writes it (up to its `<|message|>`)."""
    to = f" to={message.recipient}" if message.recipient else ""
    constrain = f" {CONSTRAIN}{message.content_type}" if message.content_type else ""
    return f"{CHANNEL}{message.channel or ''}{to}{constrain}{MESSAGE}"


def parse_harmony(text: str) -> list[HarmonyMessage]:
    """Every message of a whole answer, in order (the last not `done` if the text stops
    inside it; a header the text stops inside is not a message)."""
    stream = HarmonyStream()
    stream.feed(text, final=True)
    return stream.messages


def partial_tag(text: str) -> int:
    """How many characters at the end of text could begin a harmony tag (a proper prefix of
    one: only from the last "<", as no tag has another)."""
    at = text.rfind("<", max(0, len(text) - _LONGEST + 1))
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(len(t) > len(tail) and t.startswith(tail) for t in TAGS) else 0


class HarmonyStream:
    """An answer's text in, each message's content out as it comes (never part of a tag):
    feed(delta) returns the new content per message, in order; joined per index, it is each
    message's content in parse_harmony(whole text). Each piece of text is scanned once (a
    possible tag at the end waits for the next delta, or `final`), so a stream costs what its
    length does. Outside a message (before the first header, or between an end tag and the
    next `<|start|>`) text is a message of channel None; inside a message's content, only an
    end tag or `<|start|>` is a tag."""

    def __init__(self) -> None:
        self._pending = ""  # a possible tag at the end, not scanned yet
        self._state = "outside"  # outside, header (after <|start|> or <|channel|>), body
        self._header: list[str] = []
        self._messages: list[HarmonyMessage] = []
        self._parts: list[list[str]] = []  # each message's content, in pieces

    @property
    def messages(self) -> list[HarmonyMessage]:
        """The messages so far (the last one open unless done)."""
        for msg, parts in zip(self._messages, self._parts, strict=True):
            if len(parts) > 1:
                parts[:] = ["".join(parts)]
            msg.content = parts[0] if parts else ""
        return self._messages

    def header(self, index: int) -> HarmonyMessage:
        """Message `index` as its header and end tag say (its content is not kept up to date
        here: `messages` joins it)."""
        return self._messages[index]

    def feed(self, delta: str, final: bool = False) -> list[HarmonyDelta]:
        """The content new since the last feed; final: the text is complete (what was held
        as a possible tag is content after all)."""
        text = self._pending + delta
        safe = len(text) if final else len(text) - partial_tag(text)
        chunk, self._pending = text[:safe], text[safe:]
        out: list[HarmonyDelta] = []
        at = 0
        for tag in _TAG.finditer(chunk):
            if tag.start() > at:
                self._text(chunk[at:tag.start()], out)
            self._tag(tag.group(), out)
            at = tag.end()
        if at < len(chunk):
            self._text(chunk[at:], out)
        return out

    def _open(self) -> HarmonyMessage | None:
        last = self._messages[-1] if self._messages else None
        return last if last is not None and not last.done else None

    def _text(self, text: str, out: list[HarmonyDelta]) -> None:
        if self._state == "header":
            self._header.append(text)
            return
        msg = self._open()
        if msg is None:  # outside: text of no message
            msg = HarmonyMessage(None)
            self._messages.append(msg)
            self._parts.append([])
        self._parts[-1].append(text)
        out.append(HarmonyDelta(len(self._messages) - 1, msg.channel, msg.recipient, text))

    def _end(self, end: str | None, out: list[HarmonyDelta]) -> None:
        msg = self._open()
        if msg is not None:
            msg.done, msg.end = True, end
            out.append(HarmonyDelta(len(self._messages) - 1, msg.channel, msg.recipient, "",
                                    True))

    def _tag(self, tag: str, out: list[HarmonyDelta]) -> None:
        if self._state == "header":
            if tag != MESSAGE:
                self._header.append(tag)
                return
            self._messages.append(_header("".join(self._header)))
            self._parts.append([])
            self._state, self._header = "body", []
        elif tag in ENDS:  # (outside, a stray end tag ends the text of no message)
            self._end(tag, out)
            self._state = "outside"
        elif tag == START or (tag == CHANNEL and self._state == "outside"):
            self._end(None, out)
            self._state, self._header = "header", [] if tag == START else [tag]
        else:  # <|channel|>, <|message|>, <|constrain|> inside content are content
            self._text(tag, out)
