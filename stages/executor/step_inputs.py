"""Host-side preparation of one step, in the executor process: reads a step-input ring slot and
packs every array the device needs into one staging buffer (staging.py), so a step costs one
host->device copy (non-blocking from pinned memory on CUDA; none at all on the CPU device).
The arrays every forward needs are made here; the attention backend adds its own
(backends/base.py `host_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ipc.messages import StepPlan
from ipc.step import STEP_FIELDS, read_step
from stages.executor.backends.base import AttentionBackend, HostInputs, StepRows
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
    drafts: dict[int, list[int]] | None = None  # slot -> its row's drafts, if any
    last_drafts: bool = False  # a drafted row's sequence, if all stand, may draft no more

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def prepare_host_step(plan: StepPlan, ring: dict[str, np.ndarray], staging: torch.Tensor,
                      host_params: HostSlotParams, layout: StagingLayout,
                      backend: AttentionBackend | None,
                      drafter: Drafter | None = None) -> HostStep:
    """Read ring slot `ring` (stamps checked) and fill `staging` (uint8, at least
    layout.nbytes) for step `plan`; `backend` adds its own fields (None: only the common
    ones, as the timed instrument needs), and `drafter` (a draft model) its passes'."""
    step = read_step(ring, plan)
    q, ctx, slots = step.query_len, step.context_len, step.seq_slot
    t = len(step.input_ids)
    ends = np.cumsum(q)
    starts = ends - q
    sampled = np.flatnonzero(step.do_sample)
    # A row samples after its last token, and after each of its drafts' predecessors.
    width = 1 + step.num_draft[sampled]
    first = np.cumsum(width) - width  # each sampled row's first position among the X
    logits_indices = np.repeat(ends[sampled] - width - first, width) + np.arange(width.sum())
    host_params.update(step.new_slot, step.new_fparams, step.new_iparams)
    forward = {
        "input_ids": step.input_ids,
        "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
        "token_slots": np.repeat(slots, q),
    }
    rows = StepRows(q, ctx, slots, starts, forward)
    attn = HostInputs({}) if backend is None else backend.host_inputs(rows)
    draft_passes = ({} if drafter is None else drafter.host_arrays(
        rows, step.num_draft, step.do_sample, step.new_slot, step.draft_kv))
    arrays = {
        **forward,
        **attn.arrays,
        "logits_indices": logits_indices,
        "sample_slots": np.repeat(slots[sampled], width),
        **_speculative_rows(step.input_ids, slots[sampled], ends[sampled], width, first),
        **{f.name: getattr(step, f.name) for f in _STAGED},
        **draft_passes,
    }
    counts, nbytes = layout.pack(arrays, staging.numpy())
    sampling = host_params.step_sampling(slots[sampled], slots, len(step.stop_id) > 0)
    spec_width = int(width.max(initial=1)) - 1
    drafts = None
    if spec_width:  # (host ints, for the structured rows' masks)
        drafts = {slot: [t for t in row if t >= 0] for slot, row in zip(
            arrays["spec_slots"].tolist(), arrays["spec_draft"].tolist(), strict=True)}
    return HostStep(plan, staging[:nbytes], counts, attn.plan, sampling,
                    bool((q == 1).all()), arrays["sample_slots"], step.new_slot,
                    spec_width, drafts, bool(step.last_drafts.any()))


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
