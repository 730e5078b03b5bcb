"""One sample's ids turned into text as they come (in the detokenizer worker): tokenizers'
DecodeStream for any tokenizer, and the same pieces for a byte-level (GPT-2 style) decoder from a
table built once per tokenizer, at a dict lookup for a token made of whole characters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class TextStream(Protocol):
    def step(self, token: int) -> str:
        """The text `token` adds: "" while a character is unfinished (its bytes held back)."""
        ...

    def flush(self) -> str | None:
        """The text of the ids held back (a cut-off character decodes to U+FFFD), so that a
        finished sample's pieces add up to decode(all ids); None if no id came since the last
        piece."""
        ...


# (skip_special_tokens, request id for the log) -> a new sample's stream
StreamFactory = Callable[[bool, str], TextStream]


def text_streams(tokenizer: Tokenizer) -> StreamFactory:
    """The fastest exact stream this tokenizer has: ByteLevelText where its decoder is exactly
    ByteLevel (SmolLM2, Llama 3, Qwen, GPT-2), DecodeStreamText for any other."""
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        table = ByteLevelTable(tokenizer)
        return lambda skip, request_id: ByteLevelText(table, skip)
    return lambda skip, request_id: DecodeStreamText(tokenizer, skip, request_id)


class DecodeStreamText:
    """tokenizers' DecodeStream, resynchronised when it rejects a token."""

    __slots__ = ("tokenizer", "skip", "request_id", "stream", "held", "context")

    def __init__(self, tokenizer: Tokenizer, skip: bool, request_id: str) -> None:
        self.tokenizer, self.skip, self.request_id = tokenizer, skip, request_id
        self.stream = DecodeStream(skip_special_tokens=skip)  # O(1) per token
        self.held: list[int] = []  # ids the stream has not turned into text yet
        self.context: list[int] = []  # ids of its last piece

    def step(self, token: int) -> str:
        self.held.append(token)
        try:
            piece = self.stream.step(self.tokenizer, token)
        except Exception:
            piece = self._resync()
        if piece is None:
            return ""
        self.context, self.held = self.held, []
        return piece

    def _resync(self) -> str:
        """The stream rejected a token (e.g. "Invalid prefix encountered"): flush what it held
        and restart it."""
        logger.warning("request %s: incremental decode failed; resyncing", self.request_id,
                       exc_info=True)
        piece = self.flush() or ""
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        return piece

    def flush(self) -> str | None:
        """Decodes only a few ids: those held and the last piece's."""
        if not self.held:
            return None
        prefix = self.tokenizer.decode(self.context, skip_special_tokens=self.skip)
        held, self.held = self.held, []
        text = self.tokenizer.decode(self.context + held, skip_special_tokens=self.skip)
        if text.startswith(prefix):
            return text[len(prefix):]
        return self.tokenizer.decode(held, skip_special_tokens=self.skip)


def _bytes_to_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode): character -> the byte it stands for.
    Printable bytes stand for themselves; the others for 256 + n, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in kept}
    n = 0
    for b in range(256):
        if b not in kept:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class ByteLevelTable:
    """Each id's bytes as tokenizers' decode sees them, for skip_special_tokens false and true:
    decode(ids) is the UTF-8 (a U+FFFD per invalid part) of their bytes joined, where a
    token's bytes are those its characters stand for in the byte-level alphabet, or its own
    UTF-8 if one of them is not in it (added tokens such as "<|im_end|>" are plain ASCII, which
    stands for itself); a special token's are empty when skipped, and an id no token has is
    dropped. `pieces` holds the text of each id whose bytes are whole characters: what the
    stream gives for it when nothing is held back."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.alphabet = _bytes_to_chars()
        self.special = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                        if t.special}
        size = max([tokenizer.get_vocab_size(with_added_tokens=True),
                    *(i + 1 for i in tokenizer.get_vocab(with_added_tokens=True).values()),
                    *(i + 1 for i in tokenizer.get_added_tokens_decoder())])
        kept: dict[int, bytes] = {}
        skipped: dict[int, bytes] = {}
        for i in range(size):
            token = tokenizer.id_to_token(i)
            if token is not None:  # (an id no token has is dropped by decode: no bytes)
                kept[i] = self._bytes(token, False)
                skipped[i] = self._bytes(token, True)
        self.bytes = {False: kept, True: skipped}
        self.pieces = {skip: _whole_pieces(table) for skip, table in self.bytes.items()}

    def _bytes(self, token: str, skip: bool) -> bytes:
        if skip and token in self.special:
            return b""
        try:
            return bytes(self.alphabet[c] for c in token)
        except KeyError:
            return token.encode()

    def bytes_of(self, token: int, skip: bool) -> bytes:
        """An id outside the table: decode's error for one it cannot take (negative, over 32
        bits: the exception DecodeStream's resynchronisation would end with), else its bytes
        (none for an id no token has)."""
        self.tokenizer.decode([token], skip_special_tokens=skip)
        token_str = self.tokenizer.id_to_token(token)
        return b"" if token_str is None else self._bytes(token_str, skip)


def _whole_pieces(table: dict[int, bytes]) -> dict[int, str]:
    """The ids whose bytes decode to text that ends in a whole character: given alone after
    a piece, DecodeStream returns just that text."""
    pieces = {}
    for i, raw in table.items():
        text = raw.decode("utf-8", "replace")
        if text and not text.endswith(REPLACEMENT):
            pieces[i] = text
    return pieces


class ByteLevelText:
    """DecodeStream's pieces for a byte-level decoder, from the bytes held since the last
    piece. DecodeStream decodes the ids since its last piece's start and gives what follows
    that piece's text once the decode is longer and does not end in U+FFFD. A piece's bytes
    never end inside a character (its text would end in U+FFFD), so decoding them and what
    follows is decoding each apart (UTF-8 resynchronises at a character's start, and an
    invalid byte is replaced alone or with the unfinished sequence it cuts off): the new
    text is the decode of the bytes held since the last piece, given once it is not empty
    and does not end in U+FFFD. tests/test_text_stream.py checks this against DecodeStream
    on random ids and random bytes."""

    __slots__ = ("table", "skip", "pieces", "token_bytes", "held")

    def __init__(self, table: ByteLevelTable, skip: bool) -> None:
        self.table, self.skip = table, skip
        self.pieces, self.token_bytes = table.pieces[skip], table.bytes[skip]
        self.held: bytes | None = None  # bytes since the last piece; None: no id since

    def step(self, token: int) -> str:
        held = self.held
        if held is None:
            piece = self.pieces.get(token)
            if piece is not None:
                return piece
            held = b""
        raw = self.token_bytes.get(token)
        if raw is None:
            raw = self.table.bytes_of(token, self.skip)
        held += raw
        text = held.decode("utf-8", "replace")
        if text and text[-1] != REPLACEMENT:
            self.held = None
            return text
        self.held = held
        return ""

    def flush(self) -> str | None:
        held, self.held = self.held, None
        return None if held is None else held.decode("utf-8", "replace")


def hold_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text that could still become one of `stops` (stop strings,
    a tool call's or a reasoning tag's markers): the longest suffix of text that is a proper
    prefix of one of them."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
