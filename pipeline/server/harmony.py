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
from dataclasses import dataclass, field

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
TAGS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
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
    """New content of message `index` (HarmonyStream.feed), with its header's fields."""

    index: int
    channel: str | None
    recipient: str | None
    text: str


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


def parse_harmony(text: str) -> list[HarmonyMessage]:
    """Every message of an answer, in order (the last not `done` if the text stops inside
    it; a header the text stops inside is not a message yet). Text outside any message
    (before the first header, or between an end tag and the next `<|start|>`) is kept as a
    message of channel None."""
    messages: list[HarmonyMessage] = []
    at, in_header = 0, False  # in_header: after a <|start|>
    while at < len(text):
        if not in_header and not text.startswith(CHANNEL, at):
            if text.startswith(START, at):
                at, in_header = at + len(START), True
                continue
            tags = [(i, t) for t in (CHANNEL, START, *ENDS) if (i := text.find(t, at)) >= 0]
            cut, tag = min(tags) if tags else (len(text), "")
            if cut > at:
                messages.append(HarmonyMessage(None, content=text[at:cut], done=bool(tag),
                                               end=tag if tag in ENDS else None))
            at = cut + (len(tag) if tag in ENDS else 0)  # a stray end tag ends it
            continue
        body = text.find(MESSAGE, at)
        if body < 0:
            break  # a header still coming
        msg, at, in_header = _header(text[at:body]), body + len(MESSAGE), False
        ends = [(i, tag) for tag in (*ENDS, START) if (i := text.find(tag, at)) >= 0]
        if ends:
            end, tag = min(ends)
            msg.content, msg.done = text[at:end], True
            msg.end = tag if tag != START else None
            at = end + (len(tag) if tag != START else 0)
        else:
            msg.content, at = text[at:], len(text)
        messages.append(msg)
    return messages


def partial_tag(text: str) -> int:
    """How many characters at the end of text could begin a harmony tag."""
    for n in range(min(max(len(t) for t in TAGS) - 1, len(text)), 0, -1):
        if any(len(t) > n and t.startswith(text[-n:]) for t in TAGS):  # a proper prefix
            return n
    return 0


@dataclass
class HarmonyStream:
    """An answer's text in, each message's content out as it comes (never part of a tag):
    feed(delta) returns the new content per message; `messages` is the parse so far. What
    feed returns, joined per index, is each message's content in parse_harmony(whole text)."""

    text: str = ""
    sent: list[int] = field(default_factory=list)  # characters of each message's content sent

    @property
    def messages(self) -> list[HarmonyMessage]:
        return parse_harmony(self.text)

    def feed(self, delta: str, final: bool = False) -> list[HarmonyDelta]:
        """The content new since the last feed; final: the text is complete (what was held
        as a possible tag is content after all)."""
        self.text += delta
        safe = self.text if final else self.text[:len(self.text) - partial_tag(self.text)]
        out = []
        for i, msg in enumerate(parse_harmony(safe)):
            if i == len(self.sent):
                self.sent.append(0)
            if len(msg.content) > self.sent[i]:
                out.append(HarmonyDelta(i, msg.channel, msg.recipient,
                                        msg.content[self.sent[i]:]))
                self.sent[i] = len(msg.content)
        return out
