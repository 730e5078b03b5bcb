"""A draft model for speculative decoding, in the executor process (docs/ARCHITECTURE.md,
"Speculative decoding"). The scheduler plans a drafted row as its last known token followed
by K DRAFT_TOKEN placeholders; here, before the step's forward, the draft model proposes them
greedily on the device and they are written into the step's input ids, where the target
verifies them as it verifies n-gram drafts. Nothing goes back to the host: run-ahead holds.

The draft model keeps its own KV cache, in the same block ids as the target's (the slot's
block table serves both), so the scheduler's blocks, prefix cache and roll-back cover it:
- pass 1 runs the draft over every row whose KV it keeps (the scheduler says which: a row's
  `draft_kv`; prefill chunks too), so its cache holds whatever the target's holds for those
  sequences; a drafted row's pass-1 logits give its first draft;
- passes 2..K run the drafted rows one token each (the previous draft) for the next drafts;
- a decode row is led in pass 1 by the token before its last (kept per slot on the device,
  PREV_TOKEN): when every draft of the row before stood, the last draft's KV was never
  written (no pass ran on it), and this writes it; otherwise it rewrites what is there.
Positions past a row's stood tokens hold stale draft KV, as the target's do; each is written
again before anything reads it.

Ahead of a plan (`work_ahead`): after a step with drafted rows, while the scheduler learns
what stood and plans the next step (the device would idle: it cannot plan a drafted
sequence before its drafts are verified), the passes that step will want are run already,
from what the device holds: each drafted row's last sample at its known position, led by
the token before it. Only positions in the block where the row's last sample lands are
written (the scheduler allocates a draft model's row up to there and keeps that block through
roll-back; its table entry stays as it is), so the passes stop at that block's end. The next
step takes them when its pass 1 is exactly the one run ahead (the same rows, slots, positions
and tokens: a decode row each, with drafts) and resumes the passes where they stopped;
otherwise they are dropped, and what they wrote is rewritten before it is read, as above. None
are run after a row that ended its sequence or may draft no more (`last_drafts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ipc.config import EngineLimits
from ipc.step import DRAFT_TOKEN
from stages.executor.backends.base import ForwardTables, StepRows
from stages.executor.kv_pool import FORMATS, KVFormat, KVPool
from stages.executor.models.base import CausalLM
from stages.executor.sampler import SampleOutput, greedy_tokens
from stages.executor.staging import DeviceStep, Staged, StagedFields, per_sampled, per_seq
from stages.trace import now_ns

PREV_TOKEN = -3  # in pass 1's ids: the token before the slot's last sample


def _per_draft_token(lim: EngineLimits) -> int:
    return lim.max_num_batched_tokens + lim.max_num_seqs  # each row's tokens, and a lead


class DraftFields(StagedFields):
    """A draft model's packed fields (after the common ones)."""

    # pass 1: every row's known tokens (-1: the slot's last sample), a decode row's led by
    # the one before (PREV_TOKEN), with their positions and slots
    draft_ids = Staged("int64", _per_draft_token)
    draft_positions = Staged("int64", _per_draft_token)
    draft_slots = Staged("int64", _per_draft_token)
    draft_last = Staged("int64", per_seq)  # [R] each drafted row's last, in pass 1
    spec_at = Staged("int64", per_sampled)  # [R, K] each draft's index in input_ids


@dataclass
class Ahead:
    """Draft passes run before their step's plan came (Drafter.work_ahead): the pass 1 they
    ran, the drafts [R] of each pass after it, and when they began."""

    pass1: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, pos, slots, last
    drafts: list[torch.Tensor]
    began_ns: int


class Drafter:
    """The draft model of one runner: its weights, its KV cache (as many blocks as the
    target's, in the same ids), each slot's token before its last, and the host's record of
    which slots have one."""

    def __init__(self, model: CausalLM, limits: EngineLimits, num_cache_blocks: int,
                 block_table: torch.Tensor, device: torch.device,
                 kv_format: KVFormat = FORMATS["auto"]) -> None:
        self.model, self.limits, self.device = model, limits, device
        self.backend = model.backend
        self.kv = KVPool(kv_format, model.kv_shape, num_cache_blocks, limits.block_size, device)
        self.kv_caches = self.kv.caches
        self.backend.bind(ForwardTables([block_table], model.ropes, num_cache_blocks))
        n = limits.max_num_seqs
        self.prev = torch.zeros(n + 1, dtype=torch.int64, device=device)
        # Host: whether a slot sampled since it was taken (prev holds its token), as of the
        # step last prepared; the device runs steps in the order they are prepared.
        self._has_prev = np.zeros(n + 1, dtype=bool)
        # The drafted rows of the step being computed (slots, position of each row's last
        # known token); once verified, where the next step's passes start (slots, position
        # of each row's last sample), unless a row ended; the passes run ahead of it.
        self._drafted: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ahead: Ahead | None = None
        self._eos = (torch.tensor(limits.eos_token_ids, device=device)
                     if limits.eos_token_ids else None)
        self.began_ns: int | None = None  # when the last step's passes began, if run ahead
        self.num_ahead = self.num_ahead_taken = 0  # passes run ahead of a step; taken by it

    # ------------------------------------------------------------ host

    def host_arrays(self, rows: StepRows, num_draft: np.ndarray, do_sample: np.ndarray,
                    new_slots: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
        """Pass 1's arrays for a step (first_pass); call once per step, in step order."""
        self._has_prev[new_slots] = False
        arrays = first_pass(rows, num_draft, do_sample, self._has_prev, kept)
        self._has_prev[rows.slots[do_sample]] = True
        return arrays

    # ------------------------------------------------------------ device

    def propose(self, v: DeviceStep, ids: torch.Tensor, last_sampled: torch.Tensor,
                width: int, last_drafts: bool = False) -> torch.Tensor:
        """Run the draft passes of a step whose drafted rows carry up to `width` placeholders;
        returns the step's input ids with the drafts written in, and sets v.spec_draft to
        them (-1 past a row's own), as the verification reads it. last_drafts: if a row's drafts
        all stand, its sequence may draft no more (no passes are run ahead of the next step)."""
        ahead, self._ahead, self._drafted, self._next = self._ahead, None, None, None
        self.began_ns = None
        own_fields = DraftFields(v.views)
        slots, d_ids = own_fields.draft_slots, own_fields.draft_ids
        if not len(d_ids):  # (no row's KV is the draft model's)
            return ids
        positions, last = own_fields.draft_positions, own_fields.draft_last
        resolved = torch.where(d_ids == -1, last_sampled[slots],
                               torch.where(d_ids == PREV_TOKEN, self.prev[slots], d_ids))
        if ahead is not None and width and _same_pass(ahead.pass1, (resolved, positions, slots,
                                                                    last)):
            drafts = ahead.drafts[:width]
            self.began_ns = ahead.began_ns
            self.num_ahead_taken += 1
        else:
            token = self._forward(resolved, slots, positions, last)
            if not width:
                return ids
            drafts = [token]
        own = v.spec_draft.view(-1, width) == DRAFT_TOKEN  # [R, K]
        num_own = own.sum(dim=1)
        rows = torch.arange(len(last), device=ids.device)
        start, row_slots = positions[last], v.spec_slots
        if not last_drafts:  # (else the next step most likely runs none of these rows)
            self._drafted = (row_slots.clone(), start.clone())  # (staging views)
        token = drafts[-1]
        for i in range(len(drafts), width):
            # draft i at its position; past a row's own drafts, at its last draft's (a
            # position written once more before anything reads it: see the module's doc)
            token = self._forward(token, row_slots, start + torch.clamp(num_own, max=i),
                                  rows)
            drafts.append(token)
        proposed = torch.where(own, torch.stack(drafts, dim=1), -1)
        v.spec_draft = proposed.view(-1)
        at = own_fields.spec_at.view(-1, width)
        ids = ids.clone()
        ids[at] = torch.where(own, proposed, ids[at])
        return ids

    def work_ahead(self, last_sampled: torch.Tensor, came: Callable[[], bool]) -> bool:
        """Run the draft passes of the next step before its plan comes (see the module's
        doc), for the rows that drafted in the step computed last, until `came()` says a
        step came (that step resumes them, or drops them if it is another). False when
        there is nothing to run: no drafted rows, or one that ended (an end token)."""
        nxt, self._next = self._next, None
        if nxt is None or self._ahead is not None:
            return False
        began = now_ns()
        slots, at = nxt
        bs = self.limits.block_size
        # positions at and after it left in its block (the scheduler holds that block for
        # a draft model's row: core.py _drafts), and in the model's context
        most = min(int((bs - at % bs).min()),
                   int((self.limits.max_model_len - at).min()),
                   self.limits.num_speculative_tokens)
        if most < 1:
            return False
        r = len(slots)
        ids = torch.stack([self.prev[slots], last_sampled[slots]], dim=1).view(-1)
        positions = torch.stack([at - 1, at], dim=1).view(-1)
        pass_slots = slots.repeat_interleave(2)
        last = torch.arange(1, 2 * r, 2, device=at.device)
        token = self._forward(ids, pass_slots, positions, last)
        drafts = [token]
        rows = torch.arange(r, device=at.device)
        for i in range(1, most):
            if came():
                break
            token = self._forward(token, slots, at + i, rows)
            drafts.append(token)
        self._ahead = Ahead((ids, positions, pass_slots, last), drafts, began)
        self.num_ahead += 1
        return True

    def _ended(self, out: SampleOutput, fed: torch.Tensor) -> bool:
        """Whether an end token stands among a step's samples, or was fed in (a row planned
        before the sample it follows was known, which ended its sequence): a row most
        likely ended, and no passes are run ahead of the next step."""
        if self._eos is None:
            return False
        stood = out.tokens if out.stands is None else out.tokens[out.stands]
        return bool(torch.isin(torch.cat([stood, fed]), self._eos).any())

    def _forward(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 wanted: torch.Tensor) -> torch.Tensor:
        """A draft pass: the draft model's greedy token [len(wanted)] at the wanted rows."""
        meta = self.backend.metadata(DeviceStep.of(token_slots=slots, positions=positions), None)
        return greedy_tokens(self.model(ids, self.kv_caches, meta, wanted))

    def keep_prev(self, v: DeviceStep, ids: torch.Tensor, out: SampleOutput,
                  width: int) -> None:
        """Each sampled slot's token before its new last sample: the input whose logits
        sampled it (a drafted row: the input at its last standing position)."""
        inputs = v.logits_indices
        self.prev[v.sample_slots] = ids[inputs]
        drafted, self._drafted = self._drafted, None
        if drafted is not None and out.accepted is not None and not self._ended(out,
                                                                                 ids[inputs]):
            self._next = (drafted[0], drafted[1] + out.accepted.long())
        if width and out.accepted is not None:
            where = v.spec_sampled.view(-1, width + 1)
            last = where.gather(1, (out.accepted.long() - 1).unsqueeze(1)).squeeze(1)
            self.prev[v.spec_slots] = ids[inputs[last]]


def _same_pass(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def first_pass(rows: StepRows, num_draft: np.ndarray, do_sample: np.ndarray,
               has_prev: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
    """The draft model's first pass over a step whose rows end in num_draft placeholders
    each (numpy only): the known tokens of each row whose KV the draft model keeps (`kept`,
    per row, as the scheduler says), a decode row's led by the token before it where its
    slot has one (has_prev, per slot), and where each drafted row's last known token is
    among them."""
    q, ctx, slots, starts = rows.query_lens, rows.context_lens, rows.slots, rows.starts
    known = q - num_draft
    lead = ((known == 1) & has_prev[slots] & (ctx - q >= 1)).astype(np.int64)
    dq = (known + lead) * kept
    dstarts = np.cumsum(dq) - dq
    within = np.arange(int(dq.sum())) - np.repeat(dstarts, dq)
    is_lead = np.repeat(lead.astype(bool), dq) & (within == 0)
    src = np.repeat(starts - lead, dq) + within
    ids = np.where(is_lead, PREV_TOKEN, rows.forward["input_ids"][np.where(is_lead, 0, src)])
    return {
        "draft_ids": ids,
        "draft_positions": np.repeat(ctx - q - lead, dq) + within,
        "draft_slots": np.repeat(slots, dq),
        "draft_last": (dstarts + dq - 1)[do_sample & (num_draft > 0)],
    }
