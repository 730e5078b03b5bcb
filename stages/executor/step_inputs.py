"""Host-side preparation of one step, in the executor process: reads a step-input ring slot and
packs every array the device needs into one staging buffer (layout: ipc/step.py
STAGING_FIELDS), so a step costs one host->device copy (non-blocking from pinned memory on
CUDA; none at all on the CPU device)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.config import EngineLimits
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


def query_blocks(query_lens: np.ndarray, context_lens: np.ndarray, slots: np.ndarray,
                 block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled attention's query layout: each row's query positions cut at page
    boundaries into query blocks of block_size rows, row i of a block holding the position
    at page offset i (so causality inside a page is `key offset <= query offset` for every
    row alike). Returns the query row of each token [T], and the slot [Q] and page index [Q]
    of each query block."""
    first = (context_lens - query_lens) // block_size  # page of each row's first query
    num = (context_lens - 1) // block_size - first + 1  # pages its queries span
    start = np.cumsum(num) - num
    page_of_block = np.repeat(first, num) + (np.arange(int(num.sum())) - np.repeat(start, num))
    positions = np.repeat(context_lens - query_lens, query_lens) + (
        np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                     query_lens))
    block_of_token = np.repeat(start - first, query_lens) + positions // block_size
    rows = block_of_token * block_size + positions % block_size
    return rows, np.repeat(slots, num), page_of_block


def pad_to(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(size - len(values), fill, values.dtype)])


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
    decode_only: bool  # every row has one query token
    sample_slots: np.ndarray  # [X] the slot of each sampled row, on the host
    new_slots: np.ndarray  # [N] slots taken by a new sequence this step

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
                      host_params: HostSlotParams, limits: EngineLimits, pad: bool = False
                      ) -> HostStep:
    """Read ring slot `ring` (stamps checked) and fill `staging` (uint8, large enough) for
    step `plan`. With `pad` (a compiled forward), the tokens and query blocks are padded
    to the step's bucket: padding tokens belong to slot limits.max_num_seqs, whose block
    table points at a scratch block, and use the last query block."""
    step = read_step(ring, plan)
    q, ctx, slots = step.query_lens, step.context_lens, step.seq_slots
    t = len(step.input_ids)
    ends = np.cumsum(q)
    starts = ends - q
    decode = np.flatnonzero(q == 1)
    decode = decode[np.argsort(ctx[decode], kind="stable")]
    sampled = np.flatnonzero(step.do_sample)
    host_params.update(step.new_slots, step.new_fparams, step.new_iparams)
    query_rows, qblock_slots, qblock_pages = query_blocks(q, ctx, slots, limits.block_size)
    forward = {
        "input_ids": step.input_ids,
        "positions": np.repeat(ctx - q, q) + (np.arange(t) - np.repeat(starts, q)),
        "token_slots": np.repeat(slots, q),
        "query_rows": query_rows,
        "qblock_slots": qblock_slots,
        "qblock_pages": qblock_pages,
    }
    if pad:
        forward = pad_forward_inputs(forward, limits)
    arrays = {
        **forward,
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
        "plp_indices": step.plp_index,
        "plp_targets": step.plp_target,
    }
    counts, nbytes = pack(arrays, staging.numpy())
    prefills = [PrefillRow(int(starts[r]), int(ends[r]), int(slots[r]), int(ctx[r]))
                for r in np.flatnonzero(q > 1)]
    sampling = host_params.step_sampling(slots[sampled], slots, len(step.stop_ids) > 0)
    return HostStep(plan, staging[:nbytes], counts, group_by_length(ctx[decode]), prefills,
                    sampling, len(decode) == len(q), slots[sampled], step.new_slots)


def pad_forward_inputs(forward: dict[str, np.ndarray],
                       limits: EngineLimits) -> dict[str, np.ndarray]:
    """The forward's inputs padded to the smallest bucket that holds the step."""
    num_tokens = limits.bucket(len(forward["input_ids"]))
    num_blocks = limits.max_query_blocks(num_tokens)
    pad_slot, spare_row = limits.max_num_seqs, (num_blocks - 1) * limits.block_size
    return {
        "input_ids": pad_to(forward["input_ids"], num_tokens, 0),
        "positions": pad_to(forward["positions"], num_tokens, 0),
        "token_slots": pad_to(forward["token_slots"], num_tokens, pad_slot),
        "query_rows": pad_to(forward["query_rows"], num_tokens, spare_row),
        "qblock_slots": pad_to(forward["qblock_slots"], num_blocks, pad_slot),
        "qblock_pages": pad_to(forward["qblock_pages"], num_blocks, 0),
    }
