"""Host-side preparation of one step, in the executor process: reads a step-input ring slot and
packs every array the device needs into one staging buffer (staging.py), so a step costs one
host->device copy (non-blocking from pinned memory on CUDA; none at all on the CPU device).
The arrays every forward needs are made here; the attention backend adds its own
(backends/base.py `host_inputs`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ipc.messages import StepPlan
from ipc.step import STEP_FIELDS, StepInputs, read_step
from stages.executor.backends.base import AttentionBackend, HostInputs, StepRows
from stages.executor.lora import StepAdapters, step_adapters
from stages.executor.pooling import PoolRows, plan_pooling
from stages.executor.sampler import HostSlotParams, StepSampling
from stages.executor.staging import StagingLayout

if TYPE_CHECKING:
    from stages.executor.drafter import Drafter


_STAGED = tuple(f for f in STEP_FIELDS if f.staged)  # handed to the device as they are read


@dataclass
class HostStep:
    """A step ready for the device: the packed buffer plus the few sizes the device needs
    as Python ints (so the device never has to ask the host for them)."""

    plan: StepPlan
    packed: torch.Tensor  # [bytes used] uint8, host (pinned on CUDA)
    counts: dict[str, int]  # elements of each staging field
    attn_plan: Any  # the backend's host-side plan (HostInputs.plan)
    sampling: StepSampling
    decode_only: bool  # every row has one query token
    sample_slots: np.ndarray  # [X] the slot of each sampled position, on the host
    new_slot: np.ndarray  # [N] slots taken by a new sequence this step
    spec_width: int = 0  # the most drafts a row of this step carries (0: none)
    last_drafts: bool = False  # a drafted row's sequence, if all stand, may draft no more
    # the rows with drafts, on the host: their slots [R] and drafts [R, K] (-1 past a row's
    # own), from which `drafts` is made
    spec_rows: tuple[np.ndarray, np.ndarray] | None = None
    # the step's input ids and each one's slot, on the host (-1: a placeholder)
    input_ids: np.ndarray | None = None
    token_slots: np.ndarray | None = None
    pool: PoolRows | None = None  # what its embeddings' rows pool (None: no such row)
    # their vectors (float32 bytes), written by the device's reporter once computed
    pooled: list[bytes] = dataclasses.field(default_factory=list)
    lora: StepAdapters | None = None  # its rows by LoRA adapter (None: all the base model's)

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @functools.cached_property
    def placeholder_slots(self) -> list[int]:
        """The slots whose last sample this step's ids take (a pipeline's first stage waits
        for those samples; asked only there)."""
        assert self.input_ids is not None and self.token_slots is not None
        return np.unique(self.token_slots[self.input_ids < 0]).tolist()  # type: ignore[no-any-return]

    @functools.cached_property
    def drafts(self) -> dict[int, list[int]] | None:
        """Slot -> its row's drafts (the ids known on the host: a draft model's are not yet),
        if the step has drafts: host ints for the structured rows' masks. Made when asked,
        by the grammar thread, not by prepare (a loop over the rows)."""
        if not self.spec_width or self.spec_rows is None:
            return None
        slots, drafts = self.spec_rows
        return {slot: [t for t in row if t >= 0]
                for slot, row in zip(slots.tolist(), drafts.tolist(), strict=True)}


def prepare_host_step(plan: StepPlan, ring: dict[str, np.ndarray], staging: torch.Tensor,
                      host_params: HostSlotParams, layout: StagingLayout,
                      backend: AttentionBackend | None,
                      drafter: Drafter | None = None) -> HostStep:
    """Read ring slot `ring` (stamps checked) and fill `staging` (uint8, at least
    layout.nbytes) for step `plan`; `backend` adds its own fields (None: only the common
    ones, as the timed instrument needs), and `drafter` (a draft model) its passes'.
    (It runs between a step's end on the device and the launch of the step after next, so
    the steps that decode only, the steady state, take a path of their own: a handful of
    numpy calls, none per row.)"""
    step = read_step(ring, plan)
    q, ctx, slots = step.query_len, step.context_len, step.seq_slot
    decode_only = bool((q == 1).all())
    if decode_only:  # (each row's one token sits at the end of its context)
        starts = np.arange(len(q))
        forward = {"input_ids": step.input_ids, "positions": ctx - 1, "token_slots": slots}
    else:
        t = len(step.input_ids)
        starts = np.cumsum(q) - q
        forward = {
            "input_ids": step.input_ids,
            "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
            "token_slots": np.repeat(slots, q),
        }
    host_params.update(step.new_slot, step.new_fparams, step.new_iparams)
    rows = StepRows(q, ctx, slots, starts, forward)
    sampled = step.do_sample.nonzero()[0]
    sampled_slots = slots[sampled]
    if step.num_draft.any():
        positions = _sampled_positions(step, rows.ends, sampled, sampled_slots)
    else:  # (one position a sampled row, after its last token)
        positions = SampledPositions(sampled if decode_only else rows.ends[sampled] - 1,
                                     sampled_slots, _NO_SPECULATIVE_ROWS)
    attn = HostInputs({}) if backend is None else backend.host_inputs(rows)
    draft_passes = ({} if drafter is None else drafter.host_arrays(
        rows, step.num_draft, step.do_sample, step.new_slot, step.draft_kv))
    arrays = {
        **forward,
        **attn.arrays,
        "logits_indices": positions.logits_indices,
        "sample_slots": positions.sample_slots,
        **positions.speculative,
        **{f.name: getattr(step, f.name) for f in _STAGED},
        **draft_passes,
    }
    counts, nbytes = layout.pack(arrays, staging.numpy())
    sampling = host_params.step_sampling(sampled_slots, slots, len(step.stop_id) > 0)
    spec = positions.speculative
    return HostStep(plan, staging[:nbytes], counts, attn.plan, sampling, decode_only,
                    positions.sample_slots, step.new_slot, spec_width=positions.spec_width,
                    last_drafts=bool(step.last_drafts.any()),
                    spec_rows=(spec["spec_slots"], spec["spec_draft"]),
                    input_ids=step.input_ids, token_slots=forward["token_slots"],
                    pool=plan_pooling(step, starts),
                    lora=step_adapters(step.adapter_id, q))


class SampledPositions(NamedTuple):
    """Where a step samples: the logits of each of its X sampled positions (an index into
    its tokens), their slots, and the verification arrays of its rows with drafts."""

    logits_indices: np.ndarray  # [X]
    sample_slots: np.ndarray  # [X]
    speculative: dict[str, np.ndarray]  # _speculative_rows
    spec_width: int = 0  # the most drafts a row carries


def _no_speculative_rows() -> dict[str, np.ndarray]:
    """_speculative_rows of a step without drafts: every array empty (each field's count
    0), made once."""
    none = np.empty(0, np.int64)
    none.flags.writeable = False
    return {"spec_slots": none, "spec_sampled": none, "spec_draft": none, "spec_at": none}


_NO_SPECULATIVE_ROWS = _no_speculative_rows()


def _sampled_positions(step: StepInputs, ends: np.ndarray, sampled: np.ndarray,
                       slots: np.ndarray) -> SampledPositions:
    """SampledPositions of a step whose rows may carry drafts (`sampled`: the rows that
    sample, `slots` theirs): a row samples after its last token, and after each of its
    drafts' predecessors."""
    width = 1 + step.num_draft[sampled]
    first = np.cumsum(width) - width  # each sampled row's first position among the X
    return SampledPositions(
        np.repeat(ends[sampled] - width - first, width) + np.arange(width.sum()),
        np.repeat(slots, width),
        _speculative_rows(step.input_ids, slots, ends[sampled], width, first),
        int(width.max(initial=1)) - 1)


def _speculative_rows(input_ids: np.ndarray, slots: np.ndarray, ends: np.ndarray,
                      width: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]:
    """The verification arrays of the sampled rows that carry drafts (staging.py): which
    sampled positions are each row's, the drafts their samples must match, and where each
    draft is among the step's input ids (a draft model's are written there on the device;
    0 past a row's own)."""
    spec = width > 1
    num_drafts = width[spec] - 1
    k = int(num_drafts.max(initial=0))
    j = np.arange(k + 1)
    own = j[:k] < num_drafts[:, None]  # [R, K]: a real draft, not padding
    # draft j of a row is its token at index end - num_drafts + j
    at = np.where(own, (ends[spec] - num_drafts)[:, None] + j[:k], 0)
    return {
        "spec_slots": slots[spec],
        "spec_sampled": first[spec][:, None] + np.minimum(j, num_drafts[:, None]),
        "spec_draft": np.where(own, input_ids[at], -1),
        "spec_at": at,
    }
