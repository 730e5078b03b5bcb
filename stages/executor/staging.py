"""The packed layout in which the executor hands one step's index arrays to its device, in the
executor process: one buffer, so a step costs one host-to-device copy (non-blocking from
pinned memory on CUDA; none at all on the CPU device). Executor-only, not protocol: what the
scheduler writes is the step-input ring (ipc/step.py); this is what the host side makes of it.

The fields are the ones every forward needs plus those of the attention backend that runs
(backends/base.py `staging_fields`), in the order of FIELDS: the forward's own inputs first,
so that in a padded (compiled) forward their offsets depend on the step's bucket alone
(fixed addresses per ring slot, for CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ipc.config import EngineLimits
from ipc.sampling import NUM_F, NUM_I


@dataclass(frozen=True)
class PackedField:
    name: str
    dtype: str  # a numpy dtype name
    max_count: Callable[[EngineLimits], int]


def per_token(lim: EngineLimits) -> int:
    return lim.max_num_batched_tokens


def per_seq(lim: EngineLimits) -> int:
    return lim.max_num_seqs


def per_sampled(lim: EngineLimits) -> int:
    return lim.max_sampled


def _updates(lim: EngineLimits) -> int:
    return lim.max_block_updates


def _stops(lim: EngineLimits) -> int:
    return lim.max_stop_ids


# The forward's inputs (sizes T tokens), before any backend's fields.
FORWARD_FIELDS = (
    PackedField("input_ids", "int64", per_token),  # -1: the slot's last sample
    PackedField("positions", "int64", per_token),
    PackedField("token_slots", "int64", per_token),
)
# What every step carries after the backend's fields (X sampled positions, R rows with
# drafts, U block-table updates, N new slots, M suppressed ids, P prompt-logprob positions).
COMMON_FIELDS = (
    PackedField("logits_indices", "int64", per_sampled),  # X
    PackedField("sample_slots", "int64", per_sampled),  # X
    # speculative rows (R, drafts padded to the step's widest, K): their slots, their sampled
    # positions [R, K + 1] (indices into X, the last repeated) and their drafts [R, K] (-1
    # past a row's own)
    PackedField("spec_slots", "int64", per_seq),
    PackedField("spec_sampled", "int64", per_sampled),
    PackedField("spec_draft", "int64", per_sampled),
    PackedField("bt_slot", "int64", _updates),
    PackedField("bt_index", "int64", _updates),
    PackedField("bt_block", "int64", _updates),
    PackedField("new_slots", "int64", per_seq),
    PackedField("new_fparams", "float32", lambda lim: lim.max_num_seqs * NUM_F),
    PackedField("new_iparams", "int64", lambda lim: lim.max_num_seqs * NUM_I),
    PackedField("stop_slots", "int64", _stops),
    PackedField("stop_ids", "int64", _stops),
    PackedField("plp_indices", "int64", per_token),  # P
    PackedField("plp_targets", "int64", per_token),
)
_ALIGN = 8  # every field starts on an 8-byte boundary, so any dtype views it in place
_TORCH_DTYPES = {"int64": (torch.int64, 8), "float32": (torch.float32, 4)}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class StagingLayout:
    """The fields of one backend's steps, in packing order."""

    def __init__(self, backend_fields: Iterable[PackedField] = (),
                 tail_fields: Iterable[PackedField] = ()) -> None:
        """tail_fields: after the common ones (a draft model's, drafter.py)."""
        self.fields = (*FORWARD_FIELDS, *backend_fields, *COMMON_FIELDS, *tail_fields)
        names = [f.name for f in self.fields]
        assert len(set(names)) == len(names), f"a staging field twice: {names}"

    def nbytes(self, limits: EngineLimits) -> int:
        """Bytes of a staging buffer that holds any step."""
        return sum(_aligned(np.dtype(f.dtype).itemsize * f.max_count(limits))
                   for f in self.fields)

    def pack(self, arrays: dict[str, np.ndarray], out: np.ndarray) -> tuple[dict[str, int], int]:
        """Write every field of `arrays` densely into `out` (uint8); returns the count of each
        field and the bytes used. `offsets` finds them again from the counts."""
        counts, offset = {}, 0
        for f in self.fields:
            values = arrays[f.name]
            nbytes = values.size * np.dtype(f.dtype).itemsize
            out[offset:offset + nbytes].view(f.dtype)[:] = values.reshape(-1)
            counts[f.name] = values.size
            offset += _aligned(nbytes)
        return counts, offset

    def offsets(self, counts: dict[str, int]) -> dict[str, tuple[int, int, str]]:
        """(byte offset, count, dtype) of each field of a buffer packed with these counts."""
        where, offset = {}, 0
        for f in self.fields:
            where[f.name] = (offset, counts[f.name], f.dtype)
            offset += _aligned(counts[f.name] * np.dtype(f.dtype).itemsize)
        return where

    def unpack(self, packed: torch.Tensor, counts: dict[str, int]) -> dict[str, torch.Tensor]:
        """Typed views of each field over a packed uint8 buffer (on whichever device it
        lives)."""
        views = {}
        for name, (offset, count, dtype) in self.offsets(counts).items():
            torch_dtype, itemsize = _TORCH_DTYPES[dtype]
            views[name] = packed[offset:offset + count * itemsize].view(torch_dtype)
        return views
