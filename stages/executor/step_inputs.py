"""Host-side preparation of one step, in the executor process: reads a step-input ring slot and
packs every index array the device needs into one int64 buffer, so a step costs one host->device
copy (non-blocking from pinned memory on CUDA; none at all on the CPU device)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.messages import StepPlan
from ipc.rings import check_stamp
from stages.executor.sampler import NUM_F, NUM_I, HostSlotParams, StepSampling

# Packed int64 fields, in order. Sizes: T tokens, S rows, X sampled rows, B decode rows,
# U block-table updates, N new slots (their float32 parameters as bit patterns, their int
# parameters), M (slot, id) pairs that min_tokens suppresses.
_FIELDS = ("input_ids", "positions", "token_slots", "logits_indices", "sample_slots",
           "decode_token_idx", "decode_slots", "decode_lens", "bt_slot", "bt_index", "bt_block",
           "new_slots", "new_fparams", "new_iparams", "stop_slots", "stop_ids")


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
    groups, start = [], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or lens[i] > max_ratio * max(lens[start], 16):
            groups.append(DecodeGroup(start, i, int(lens[i - 1])))
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
    packed: torch.Tensor  # [sum of sizes] int64, host (pinned on CUDA)
    sizes: dict[str, int]
    decode_groups: list[DecodeGroup]  # decode rows sorted by context length, in groups
    prefills: list[PrefillRow]
    sampling: StepSampling
    ring_slot: int

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def unpack(packed: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Views of each field over a packed buffer (on whichever device it now lives)."""
    views, offset = {}, 0
    for name in _FIELDS:
        views[name] = packed[offset:offset + sizes[name]]
        offset += sizes[name]
    return views


def prepare_host_step(plan: StepPlan, ring: dict[str, np.ndarray], staging: torch.Tensor,
                      host_params: HostSlotParams, ring_slot: int) -> HostStep:
    """Read ring slot `ring` and fill `staging` (int64, large enough) for step `plan`.
    The slot's stamps are checked before and after: a slot rewritten meanwhile raises."""
    check_stamp(ring, plan.step_id)
    s, t, u = plan.num_seqs, plan.num_tokens, plan.num_block_updates
    q = ring["query_len"][:s].astype(np.int64)
    ctx = ring["context_len"][:s].astype(np.int64)
    slots = ring["seq_slot"][:s].astype(np.int64)
    do_sample = ring["do_sample"][:s]
    ends = np.cumsum(q)
    starts = ends - q
    decode = np.flatnonzero(q == 1)
    decode = decode[np.argsort(ctx[decode], kind="stable")]
    sampled = np.flatnonzero(do_sample)
    fparams, iparams = host_params.updated(plan.new_slots)
    new = plan.new_slots
    stops = [(init.slot, t) for init in new for t in init.stop_ids]
    arrays = {
        "input_ids": ring["input_ids"][:t],
        "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
        "token_slots": np.repeat(slots, q),
        "logits_indices": ends[sampled] - 1,
        "sample_slots": slots[sampled],
        "decode_token_idx": starts[decode],
        "decode_slots": slots[decode],
        "decode_lens": ctx[decode],
        "bt_slot": ring["bt_slot"][:u], "bt_index": ring["bt_index"][:u],
        "bt_block": ring["bt_block"][:u],
        "new_slots": np.array([i.slot for i in new], dtype=np.int64),
        # float32 bit patterns, so one int64 buffer carries everything
        "new_fparams": fparams[[i.slot for i in new]].reshape(-1).view(np.int32)
        .astype(np.int64),
        "new_iparams": iparams[[i.slot for i in new]].reshape(-1),
        "stop_slots": np.array([s for s, _ in stops], dtype=np.int64),
        "stop_ids": np.array([t for _, t in stops], dtype=np.int64),
    }
    sizes = {name: len(arrays[name]) for name in _FIELDS}
    out = staging.numpy()
    offset = 0
    for name in _FIELDS:
        out[offset:offset + sizes[name]] = arrays[name]
        offset += sizes[name]
    check_stamp(ring, plan.step_id)  # nothing rewrote the slot while we copied it out
    host_params.f, host_params.i = fparams, iparams
    prefills = [PrefillRow(int(starts[r]), int(ends[r]), int(slots[r]), int(ctx[r]))
                for r in np.flatnonzero(q > 1)]
    sampling = HostSlotParams.step_sampling(fparams, iparams, slots[sampled], slots,
                                            bool(stops))
    return HostStep(plan, staging[:offset], sizes, group_by_length(ctx[decode]), prefills,
                    sampling, ring_slot)


def staging_size(max_num_seqs: int, max_num_tokens: int, max_block_updates: int,
                 max_stop_ids: int) -> int:
    """Elements of a packed buffer that holds any step."""
    return (3 * max_num_tokens + (9 + NUM_F + NUM_I) * max_num_seqs + 3 * max_block_updates
            + 2 * max_stop_ids)
