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
slot that has a grammar (`SlotGrammars`), advanced by every token the slot samples.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ipc.messages import StructuredOutputs
from ipc.params import RequestError

logger = logging.getLogger(__name__)

# Whitespace between JSON tokens: at most this much, so that a sampled output cannot pad
# itself forever (unbounded whitespace never ended a random walk in 400 tokens).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,12}"
MAX_TEMPLATES = 256  # compiled grammars an executor keeps for the next request that uses one
PARAM = "structured_outputs"


def _llguidance() -> Any:
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
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = self._hf or AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_id)
            return self._tokenizer

    def grammar(self, so: StructuredOutputs) -> str:
        """The grammar text of `so`, checked against the model's tokens; RequestError naming
        structured_outputs if it is not a valid format."""
        matcher = _llguidance().LLMatcher
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
            template = _llguidance().LLMatcher(self.tokenizer, text)
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.popitem(last=False)
        self._templates[text] = template
        self._templates.move_to_end(text)
        return template.deep_copy()


def words_per_row(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row v is what byte value v adds to its 8 tokens' logits: 0 where bit i is
    set (allowed), -inf where it is clear."""
    table = _BYTE_BIAS.get((device, dtype))
    if table is None:  # made on the device: a copy from the host would wait for it
        bits = (torch.arange(256, device=device).unsqueeze(1)
                >> torch.arange(8, device=device)) & 1
        table = torch.zeros(256, 8, dtype=dtype, device=device).masked_fill_(bits == 0,
                                                                             float("-inf"))
        _BYTE_BIAS[device, dtype] = table
    return table


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                  bitmask: torch.Tensor) -> torch.Tensor:
    """logits [X, V] with, in rows `rows` [R], every token whose bit is clear in bitmask
    [R, ceil(V / 32)] int32 set to -inf (bit j of word k: token 32k + j, llguidance's layout).
    A new tensor (the raw logits stay, for logprobs); plain tensor code, on any device.

    Read as bytes (little-endian: byte m of a row covers tokens 8m..8m+7), each byte picks
    its 8 tokens' row of a 256-entry bias table, and the bias is added: 10x faster on this
    CPU than unpacking bits into a boolean mask for masked_fill (0.3 against 3 ms at 32
    rows of 49,152)."""
    assert sys.byteorder == "little"
    vocab = logits.shape[1]
    table = _byte_bias(logits.device, logits.dtype)
    index = bitmask.contiguous().view(torch.uint8).view(-1).long()
    bias = table.index_select(0, index).view(len(rows), -1)[:, :vocab]
    return logits.index_copy(0, rows, logits.index_select(0, rows) + bias)


class SlotGrammars:
    """The executor's matchers, one per slot whose sequence has a structured output. Every
    token a slot samples advances its matcher (`consume`, in step order); before a step
    samples, `fill` writes the bitmask of its structured rows.

    A matcher that has stopped (the format is complete: only EOS was allowed) ignores what
    its slot samples afterwards: those are the rows a run-ahead step planned before the
    scheduler saw the end, and the scheduler drops them. A matcher that rejects a sampled
    token (a bug: the mask allowed only what it accepts) marks its slot failed; its rows
    then report token -1 and the scheduler ends the sequence with an error.
    """

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.matchers: dict[int, Any] = {}
        self.failed: dict[int, str] = {}  # slot -> why its matcher failed
        self._executor: Any = None

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def admit(self, slot: int, text: str, output_ids: Sequence[int]) -> None:
        """Slot `slot` is taken by a sequence with grammar `text` ("" for none) that has
        already produced output_ids (a preempted sequence resuming)."""
        self.matchers.pop(slot, None)
        self.failed.pop(slot, None)
        if not text:
            return
        matcher = self.grammars.matcher(text)
        self.matchers[slot] = matcher
        for token in output_ids:
            self._consume(slot, matcher, int(token))

    def consume(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Each slot in `slots` sampled the token beside it."""
        for slot, token in zip(slots.tolist(), tokens.tolist(), strict=True):
            matcher = self.matchers.get(slot)  # (gone once its EOS was sampled)
            if matcher is not None:
                self._consume(slot, matcher, token)

    def _consume(self, slot: int, matcher: Any, token: int) -> None:
        if slot in self.failed:
            return
        if token in self.grammars.end_token_ids:  # the model's other end tokens are its end
            token = self.grammars.eos_token_id
        if matcher.is_error():  # (is_stopped is true then too: it is not an end)
            self._fail(slot, matcher.get_error() or "the grammar is in error")
            return
        if matcher.is_stopped():
            if token == self.grammars.eos_token_id:  # the end, sampled: nothing more to do
                del self.matchers[slot]
            return
        if not matcher.consume_token(token):
            self._fail(slot, matcher.get_error() or f"token {token} was not allowed")
        elif matcher.is_error():
            self._fail(slot, matcher.get_error() or "the grammar is in error")

    def _fail(self, slot: int, why: str) -> None:
        logger.error("the grammar of slot %d failed: %s", slot, why)
        self.failed[slot] = why

    def rows(self, sample_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sampled row indices, their slots) of the rows that have a matcher."""
        has = np.fromiter((s in self.matchers for s in sample_slots.tolist()), bool,
                          len(sample_slots))
        rows = np.flatnonzero(has)
        return rows, sample_slots[rows]

    def fill(self, slots: np.ndarray, buffer: torch.Tensor) -> torch.Tensor:
        """The bitmask [len(slots), words] of the next token of each slot, in the first rows
        of buffer (host memory). A stopped or failed matcher allows EOS only (its row is
        dropped anyway)."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor(1)
        mask = buffer[:len(slots)]
        assert mask.dtype == torch.int32 and mask.is_contiguous() and mask.device.type == "cpu"
        live = []
        for i, slot in enumerate(slots.tolist()):
            matcher = self.matchers[slot]
            if slot in self.failed or matcher.is_stopped() or matcher.is_error():
                mask[i] = 0
                eos = self.grammars.eos_token_id
                mask[i, eos // 32] = _bit(eos % 32)
            else:
                live.append((matcher, i))
        if live:  # (not llguidance.torch's wrapper of this: importing it takes 1.4 s)
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), mask.shape[1] * 4,
                                                   len(slots))
        eos = self.grammars.eos_token_id
        for end in self.grammars.end_token_ids:  # allowed wherever EOS is
            ends_here = (mask[:, eos // 32] >> (eos % 32)) & 1
            mask[:, end // 32] |= ends_here << (end % 32)
        return mask

    def fail_all(self, why: str) -> None:
        """Every slot with a matcher fails (the grammar work itself raised)."""
        for slot in self.matchers:
            self.failed.setdefault(slot, why)

    def mark_failed(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Rows of failed slots report token -1 (tokens: this step's samples, in place)."""
        if not self.failed:
            return
        bad = [i for i, s in enumerate(slots.tolist()) if s in self.failed]
        if bad:  # from page-locked memory on CUDA, so nothing waits for the device
            rows = torch.tensor(bad, pin_memory=tokens.is_cuda)
            tokens.index_fill_(0, rows.to(tokens.device, non_blocking=True), -1)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value a tensor of int32 holds."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j
