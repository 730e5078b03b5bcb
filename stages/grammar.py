"""Structured outputs: a request's format (JSON Schema, any JSON object, regex, choice, Lark
grammar) as a grammar, and its matchers, which give each sampled row the bitmask of the tokens
that keep the output in the format.

The grammars are llguidance's (an Earley parser over a lazily built lexer: a JSON Schema
compiles in under a millisecond, so nothing is cached across processes or compiled ahead).
It was picked over xgrammar by measurement on this machine (docs/ARCHITECTURE.md,
"Structured outputs"): 20 of 20 random walks under a nested schema gave valid JSON against
xgrammar's 17, no triton dependency, 5-45 us of mask per row and token.

The tokenizer stage turns a request's `StructuredOutputs` into grammar text and checks it
(`Grammars.grammar`, a clear error before anything runs); the executor keeps one matcher per
slot that has a grammar (`SlotGrammars`, stages/executor/grammar_mask.py), advanced by every
token the slot samples. This module imports no torch: the tokenizer stage runs without it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ipc.messages import StructuredOutputs
from ipc.params import RequestError

logger = logging.getLogger(__name__)

# Whitespace between JSON tokens: at most this much, so that a sampled output cannot pad
# itself forever (unbounded whitespace never ended a random walk in 400 tokens).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,12}"
MAX_TEMPLATES = 256  # compiled grammars an executor keeps for the next request that uses one
PARAM = "structured_outputs"


def load_llguidance() -> Any:
    import llguidance

    return llguidance


class Grammars:
    """The model's token table for llguidance (built on first use, ~0.3 s) and grammars by
    their text. One per process that checks or matches grammars.

    llguidance knows one end token (eos_token_id); `end_token_ids` are all the model's (its
    generation config's eos ids: Llama 3.1 Instruct ends a turn with <|eot_id|>, not the
    first of them, <|end_of_text|>). Where a format may end, the mask allows each of them,
    and the matcher reads any of them as the end."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_id: int,
                 hf_tokenizer: Any = None, end_token_ids: Sequence[int] = ()) -> None:
        self.model_dir, self.vocab_size, self.eos_token_id = model_dir, vocab_size, eos_token_id
        self.end_token_ids = tuple(t for t in end_token_ids if t != eos_token_id
                                   and 0 <= t < vocab_size)
        self._hf = hf_tokenizer  # the process's own, if it has one loaded
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Any] = OrderedDict()

    def warm(self) -> None:
        """Build the token table on a thread now, so the first structured request does not
        wait for it (a stage calls this once it has started)."""
        threading.Thread(target=lambda: self.tokenizer, name="grammar-warm",
                         daemon=True).start()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from stages.file_tokenizer import FileTokenizer, load_tokenizer

                hf = self._hf or load_tokenizer(self.model_dir)
                if isinstance(hf, FileTokenizer):  # (llguidance.hf would import torch)
                    self._tokenizer = load_llguidance().LLTokenizer(
                        hf.backend_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_id)
                else:
                    import llguidance.hf

                    self._tokenizer = llguidance.hf.from_tokenizer(
                        hf, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._tokenizer

    def grammar(self, so: StructuredOutputs) -> str:
        """The grammar text of `so`, checked against the model's tokens; RequestError naming
        structured_outputs if it is not a valid format."""
        matcher = load_llguidance().LLMatcher
        kinds = so.kinds()
        if len(kinds) != 1:
            raise RequestError("structured_outputs must give exactly one of json, regex, "
                               f"choice, grammar, json_object; got {kinds or 'none'}", PARAM)
        try:
            if so.json is not None or so.json_object:
                schema = json.loads(so.json) if so.json is not None else {"type": "object"}
                text = matcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
            elif so.regex is not None:
                text = matcher.grammar_from_regex(so.regex)
            elif so.choice is not None:
                if not so.choice or not all(so.choice):
                    raise RequestError("choice must be a non-empty list of non-empty strings",
                                       PARAM)
                # Lark string literals take JSON's escapes.
                text = matcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in so.choice))
            else:
                assert so.grammar is not None
                text = matcher.grammar_from_lark(so.grammar)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"invalid {kinds[0]}: {exc}", PARAM) from None
        error = matcher.validate_grammar(text, self.tokenizer)
        if error:
            raise RequestError(f"invalid {kinds[0]}: {error.strip()}", PARAM)
        return str(text)

    def matcher(self, text: str) -> Any:
        """A fresh matcher for grammar `text` (a copy of a kept template: ~1 us)."""
        template = self._templates.get(text)
        if template is None:
            template = load_llguidance().LLMatcher(self.tokenizer, text)
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.popitem(last=False)
        self._templates[text] = template
        self._templates.move_to_end(text)
        return template.deep_copy()


def words_per_row(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
