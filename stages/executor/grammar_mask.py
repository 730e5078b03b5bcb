"""The executor's side of structured outputs: one llguidance matcher per slot that has a
grammar (`SlotGrammars`), the bitmask of each structured row, and its application to the
logits (`apply_bitmask`). The grammars themselves are stages/grammar.py's."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ipc.messages import ReasoningTags
from stages.grammar import Grammars, load_llguidance

logger = logging.getLogger(__name__)


FIRST, THINKING = "first", "thinking"  # SlotGrammars.waiting's states
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
        # Slots whose grammar waits for a thinking model's reasoning to end (ReasoningTags):
        # THINKING ones allow every token and their matcher takes none until the end tag; a
        # FIRST one's first token may open the reasoning (its mask allows the start tag too).
        self.waiting: dict[int, tuple[str, ReasoningTags]] = {}
        self._executor: Any = None

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def admit(self, slot: int, text: str, output_ids: Sequence[int],
              reasoning: ReasoningTags | None = None) -> None:
        """Slot `slot` is taken by a sequence with grammar `text` ("" for none) that has
        already produced output_ids (a preempted sequence resuming); reasoning: the grammar
        applies after the model's reasoning."""
        self.matchers.pop(slot, None)
        self.failed.pop(slot, None)
        self.waiting.pop(slot, None)
        if not text:
            return
        matcher = self.grammars.matcher(text)
        self.matchers[slot] = matcher
        if reasoning is not None:
            self.waiting[slot] = (THINKING if reasoning.opened else FIRST, reasoning)
        for token in output_ids:
            self._consume(slot, matcher, int(token))

    def consume(self, slots: np.ndarray, tokens: np.ndarray,
                stands: np.ndarray | None = None) -> None:
        """Each slot in `slots` sampled the token beside it, in order (a row with drafts
        has one per sampled position); stands: whether each of them stood (those after a
        rejected draft did not)."""
        keep = stands.tolist() if stands is not None else [True] * len(slots)
        for slot, token, stood in zip(slots.tolist(), tokens.tolist(), keep, strict=True):
            matcher = self.matchers.get(slot)  # (gone once its EOS was sampled)
            if matcher is not None and stood:
                self._consume(slot, matcher, token)

    def _consume(self, slot: int, matcher: Any, token: int) -> None:
        if slot in self.failed:
            return
        wait = self.waiting.get(slot)
        if wait is not None:
            state, tags = wait
            if state == FIRST and token == tags.start_id:
                self.waiting[slot] = (THINKING, tags)
                return
            del self.waiting[slot]  # (FIRST: the answer did not think; its grammar takes it)
            if state == THINKING:
                if token != tags.end_id:
                    self.waiting[slot] = wait
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
        """(sampled row indices, their slots) of the rows that have a matcher (a thinking
        one's too: its mask allows every token, and its tokens come back to consume)."""
        has = np.fromiter((s in self.matchers for s in sample_slots.tolist()), bool,
                          len(sample_slots))
        rows = np.flatnonzero(has)
        return rows, sample_slots[rows]

    def fill(self, slots: np.ndarray, buffer: torch.Tensor,
             drafts: dict[int, list[int]] | None = None) -> torch.Tensor:
        """The bitmask [len(slots), words] of the next token of each slot, in the first rows
        of buffer (host memory). A stopped or failed matcher allows EOS only (its row is
        dropped anyway). A slot whose row carries drafts (`drafts`) has one row per sampled
        position, in order: the mask after its matcher took the drafts before it."""
        if self._executor is None:
            self._executor = load_llguidance().LLExecutor(1)
        mask = buffer[:len(slots)]
        assert mask.dtype == torch.int32 and mask.is_contiguous() and mask.device.type == "cpu"
        live, first_rows = [], []
        order = slots.tolist()
        i = 0
        while i < len(order):
            slot = order[i]
            width = 1
            while i + width < len(order) and order[i + width] == slot:
                width += 1
            matcher = self.matchers[slot]
            state, tags = self.waiting.get(slot, ("", None))
            if state == THINKING:  # no constraint until the reasoning ends
                mask[i:i + width] = -1
                i += width
                continue
            if state == FIRST and tags is not None and tags.start_id >= 0:
                first_rows.append((i, tags.start_id))  # it may open the reasoning instead
            if slot in self.failed or matcher.is_stopped() or matcher.is_error():
                for row in range(i, i + width):
                    self._only_eos(mask, row)
            elif width == 1:
                live.append((matcher, i))
            else:
                self._fill_drafted(matcher, mask, i, (drafts or {}).get(slot, [])[:width - 1])
            i += width
        if live:  # (not llguidance.torch's wrapper of this: importing it takes 1.4 s)
            self._executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), mask.shape[1] * 4,
                                                   len(slots))
        eos = self.grammars.eos_token_id
        for end in self.grammars.end_token_ids:  # allowed wherever EOS is
            ends_here = (mask[:, eos // 32] >> (eos % 32)) & 1
            mask[:, end // 32] |= ends_here << (end % 32)
        for row, token in first_rows:  # (after the ends: a thinking row's -1 is all ones)
            mask[row, token // 32] |= _bit(token % 32)
        return mask

    def _only_eos(self, mask: torch.Tensor, row: int) -> None:
        mask[row] = 0
        eos = self.grammars.eos_token_id
        mask[row, eos // 32] = _bit(eos % 32)

    def _fill_drafted(self, matcher: Any, mask: torch.Tensor, first: int,
                      drafts: list[int]) -> None:
        """Rows first .. first + len(drafts) of mask: a drafted row's positions. The
        matcher takes the drafts the grammar allows, the mask of each position is computed
        on the way back (rolling them back one by one), so the matcher ends where it began:
        what it takes for good is what stands, after sampling (consume). Positions past a
        draft the grammar refuses cannot stand (the sample before it cannot be that
        draft): they get the last reachable position's mask."""
        eos, ends = self.grammars.eos_token_id, self.grammars.end_token_ids
        taken = matcher.try_consume_tokens([eos if t in ends else t for t in drafts])
        for j in range(taken, -1, -1):
            row = first + j
            if matcher.is_stopped() or matcher.is_error():
                self._only_eos(mask, row)
            else:
                self._executor.unsafe_compute_mask_ptr([(matcher, row)], mask.data_ptr(),
                                                       mask.shape[1] * 4, mask.shape[0])
            if j:
                matcher.rollback(1)
        for j in range(taken + 1, len(drafts) + 1):
            mask[first + j] = mask[first + taken]

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
