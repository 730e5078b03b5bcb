"""Host-side preparation of one step, in the executor process: reads a step-input ring slot and
packs every array the device needs into one staging buffer (layout: ipc/step.py
STAGING_FIELDS), so a step costs one host->device copy (non-blocking from pinned memory on
CUDA; none at all on the CPU device)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import StepPlan
from ipc.step import field_offsets, pack, read_step
from stages.executor.sampler import HostSlotParams, StepSampling

_TORCH_DTYPES = {"int64": (torch.int64, 8), "float32": (torch.float32, 4)}


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) of the (length-sorted) decode arrays, attended in one call
    with keys padded to max_len."""

    start: int
    end: int
    max_len: int


def group_by_length(lens: np.ndarray, max_ratio: float = 2.0) -> list[DecodeGroup]:
    """Split ascending context lengths into runs whose longest is at most max_ratio times
    their shortest, so padding never more than doubles the keys a group reads."""
    if not len(lens):
        return []
    if lens[-1] <= max_ratio * max(lens[0], 16):  # the common case: one group
        return [DecodeGroup(0, len(lens), int(lens[-1]))]
    values = lens.tolist()  # Python ints: a loop over numpy scalars costs ~1 us a row
    groups, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] > max_ratio * max(values[start], 16):
            groups.append(DecodeGroup(start, i, values[i - 1]))
            start = i
    return groups


@dataclass
class PrefillRow:
    start: int  # first token of the row in the flattened batch
    end: int
    slot: int
    context_len: int  # KV length after this step


@dataclass
class HostStep:
    """A step ready for the device: the packed buffer plus the few sizes the device needs
    as Python ints (so the device never has to ask the host for them)."""

    plan: StepPlan
    packed: torch.Tensor  # [bytes used] uint8, host (pinned on CUDA)
    counts: dict[str, int]  # elements of each staging field
    decode_groups: list[DecodeGroup]  # decode rows sorted by context length, in groups
    prefills: list[PrefillRow]
    sampling: StepSampling

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def unpack(packed: torch.Tensor, counts: dict[str, int]) -> dict[str, torch.Tensor]:
    """Typed views of each field over a packed uint8 buffer (on whichever device it lives)."""
    views = {}
    for name, (offset, count, dtype) in field_offsets(counts).items():
        torch_dtype, itemsize = _TORCH_DTYPES[dtype]
        views[name] = packed[offset:offset + count * itemsize].view(torch_dtype)
    return views


def prepare_host_step(plan: StepPlan, ring: dict[str, np.ndarray], staging: torch.Tensor,
                      host_params: HostSlotParams) -> HostStep:
    """Read ring slot `ring` (stamps checked) and fill `staging` (uint8, large enough) for
    step `plan`."""
    step = read_step(ring, plan)
    q, ctx, slots = step.query_lens, step.context_lens, step.seq_slots
    t = len(step.input_ids)
    ends = np.cumsum(q)
    starts = ends - q
    decode = np.flatnonzero(q == 1)
    decode = decode[np.argsort(ctx[decode], kind="stable")]
    sampled = np.flatnonzero(step.do_sample)
    host_params.update(step.new_slots, step.new_fparams, step.new_iparams)
    arrays = {
        "input_ids": step.input_ids,
        "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
        "token_slots": np.repeat(slots, q),
        "logits_indices": ends[sampled] - 1,
        "sample_slots": slots[sampled],
        "decode_token_idx": starts[decode],
        "decode_slots": slots[decode],
        "decode_lens": ctx[decode],
        "bt_slot": step.bt_slot, "bt_index": step.bt_index, "bt_block": step.bt_block,
        "new_slots": step.new_slots,
        "new_fparams": step.new_fparams,
        "new_iparams": step.new_iparams,
        "stop_slots": step.stop_slots,
        "stop_ids": step.stop_ids,
    }
    counts, nbytes = pack(arrays, staging.numpy())
    prefills = [PrefillRow(int(starts[r]), int(ends[r]), int(slots[r]), int(ctx[r]))
                for r in np.flatnonzero(q > 1)]
    sampling = host_params.step_sampling(slots[sampled], slots, len(step.stop_ids) > 0)
    return HostStep(plan, staging[:nbytes], counts, group_by_length(ctx[decode]), prefills,
                    sampling)
