"""How an answer's text is read, in each API worker of the HTTP front end: the tool-call
format an `auto` tool choice is parsed with (--tool-call-parser, else the chat template's), the
special tokens a format's tags need kept, and a thinking model's reasoning (--reasoning-parser)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from ipc.config import ServerOptions
from ipc.errors import ConfigError
from ipc.model_info import ModelInfo
from ipc.params import MAX_STOP_TOKEN_IDS
from pipeline.server.errors import bad
from pipeline.server.openai_parse import ParsedRequest
from pipeline.server.reasoning import PARSERS, reasoning_spec
from pipeline.server.tool_parsers import ToolParser, tool_parser


class AnswerReading:
    """A worker's readers of answers; core: the tokenizer stage's core (its tokenizer and
    template), loaded on first use."""

    def __init__(self, options: ServerOptions, model_dir: str | None,
                 core: Callable[[], Awaitable[Any]]) -> None:
        self.options, self.model_dir, self.core = options, model_dir, core
        self._parser: ToolParser | None = None
        self._eos: tuple[int, ...] | None = None

    async def prepare(self, parsed: ParsedRequest, chat: bool) -> None:
        """Set up how this request's answer is read (parsed is changed in place)."""
        if parsed.tools is not None and parsed.tools.choice == "auto":
            await self._read_calls_with_parser(parsed)
        name = self.options.reasoning_parser
        if chat and name is not None:
            if PARSERS[name].needs_special_tokens:  # (harmony's markers)
                await self.keep_special_tokens(parsed)
            parsed.reasoning = reasoning_spec((await self.core()).tokenizer, name, parsed)

    async def _read_calls_with_parser(self, parsed: ParsedRequest) -> None:
        """A free (auto) tool choice: its answer is read by --tool-call-parser's format, or
        by the default with the one the chat template shows (the template read once). A
        format of special tokens needs them in the answer's text."""
        if self._parser is None:
            template = None
            if self.options.tool_call_parser is None and self.model_dir is not None:
                template = (await self.core()).tokenizer.chat_template
            self._parser = tool_parser(self.options.tool_call_parser, template)
        parsed.tools.parser = self._parser
        if self._parser.special_tokens:
            await self.keep_special_tokens(parsed)

    async def keep_special_tokens(self, parsed: ParsedRequest) -> None:
        """This request's answer decoded with its special tokens (a parser reads its tags),
        all but the EOS that ends it: EOS becomes a stop token id, whose text is not output
        (and which Generation reports as EOS: no stop_reason). Other requests are untouched; a
        request that already keeps them is left as it asked."""
        params = parsed.params
        if not params.skip_special_tokens:
            return
        eos = [] if params.ignore_eos else await self._eos_ids()
        stops = [*params.stop_token_ids, *(t for t in eos if t not in params.stop_token_ids)]
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS - len(eos)} "
                      "stop_token_ids here: the answer's EOS ids join them, as its special "
                      "tokens are kept for the parser that reads its tags")
        parsed.params = dataclasses.replace(params, skip_special_tokens=False,
                                            stop_token_ids=stops)
        parsed.eos_stop_ids = tuple(t for t in eos if t not in params.stop_token_ids)

    async def _eos_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, as the scheduler reads them (its tokenizer's, for a folder
        ModelInfo does not read)."""
        if self._eos is None:
            self._eos = ()
            if self.model_dir is not None:
                try:
                    self._eos = ModelInfo.from_dir(self.model_dir).eos_token_ids
                except ConfigError:
                    eos = (await self.core()).tokenizer.eos_token_id
                    self._eos = () if eos is None else (eos,)
        return self._eos
