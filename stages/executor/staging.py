"""The packed layout in which the executor hands one step's index arrays to its device, in the
executor process: one buffer, so a step costs one host-to-device copy (non-blocking from
pinned memory on CUDA; none at all on the CPU device). Executor-only, not protocol: what the
scheduler writes is the step-input ring (ipc/step.py); this is what the host side makes of it.

Fields are declared once, as `Staged` attributes of a `StagedFields` group, which gives both
their packing (dtype, capacity) and typed views on the device (`v.positions`). The layout is
the forward's own inputs (ForwardFields), the attention backend's group (backends/base.py
`staging_fields`), what every step carries (CommonFields, with the step table's `staged`
fields as they were read) and a draft model's (drafter.py): the forward's inputs first, so
that in a padded (compiled) forward their offsets depend on the step's bucket alone (fixed
addresses per ring slot, for CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, overload

import numpy as np
import torch

from ipc.config import EngineLimits
from ipc.step import STEP_FIELDS


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


class Staged:
    """A packed field, declared as an attribute of a StagedFields group: its dtype and
    capacity (the packing), and on an instance its view on the device (typed access)."""

    def __init__(self, dtype: str, max_count: Callable[[EngineLimits], int]) -> None:
        self.dtype, self.max_count, self.name = dtype, max_count, ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Staged: ...

    @overload
    def __get__(self, obj: StagedFields, owner: type | None = None) -> torch.Tensor: ...

    def __get__(self, obj: StagedFields | None, owner: type | None = None
                ) -> Staged | torch.Tensor:
        return self if obj is None else obj.views[self.name]

    def __set__(self, obj: StagedFields, value: torch.Tensor) -> None:
        obj.views[self.name] = value  # (a device pass rewrites a field: drafter.py)

    @property
    def packed(self) -> PackedField:
        return PackedField(self.name, self.dtype, self.max_count)


def from_step(name: str) -> Staged:
    """A field of the step's table (ipc/step.py) handed to the device as it was read: its
    capacity from the table; integers widened to int64 (as read_step reads them)."""
    f = next(f for f in STEP_FIELDS if f.name == name)
    width = max(f.width, 1)
    return Staged("float32" if f.dtype == "float32" else "int64",
                  lambda lim: f.count.most(lim) * width)


_Group = TypeVar("_Group", bound="StagedFields")


class StagedFields:
    """One group of packed fields (Staged class attributes, in packing order) and typed views
    of them over a step's views, which the groups share (`views`: name -> tensor)."""

    def __init__(self, views: dict[str, torch.Tensor]) -> None:
        self.views = views

    @classmethod
    def of(cls: type[_Group], **views: torch.Tensor) -> _Group:
        """Views of some of this group's fields, by name (a draft pass's metadata)."""
        unknown = set(views) - set(cls.names())
        assert not unknown, f"no such staged fields: {sorted(unknown)}"
        return cls(views)

    @classmethod
    def packed_fields(cls) -> tuple[PackedField, ...]:
        return tuple(a.packed for klass in reversed(cls.__mro__)
                     for a in vars(klass).values() if isinstance(a, Staged))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.packed_fields())


class ForwardFields(StagedFields):
    """The forward's inputs (T tokens each), before any backend's fields."""

    input_ids = Staged("int64", per_token)  # -1: the slot's last sample
    positions = Staged("int64", per_token)
    token_slots = Staged("int64", per_token)


class CommonFields(StagedFields):
    """What every step carries after the backend's fields: X sampled positions, R rows with
    drafts, then the step table's `staged` fields (ipc/step.py) as they were read."""

    logits_indices = Staged("int64", per_sampled)  # X
    sample_slots = Staged("int64", per_sampled)  # X
    # speculative rows (R, drafts padded to the step's widest, K): their slots, their sampled
    # positions [R, K + 1] (indices into X, the last repeated) and their drafts [R, K] (-1
    # past a row's own)
    spec_slots = Staged("int64", per_seq)
    spec_sampled = Staged("int64", per_sampled)
    spec_draft = Staged("int64", per_sampled)
    bt_slot = from_step("bt_slot")  # U block-table updates
    bt_index = from_step("bt_index")
    bt_block = from_step("bt_block")
    new_slot = from_step("new_slot")  # N sequences taking a slot, and their sampling rows
    new_fparams = from_step("new_fparams")
    new_iparams = from_step("new_iparams")
    stop_slot = from_step("stop_slot")  # M ids min_tokens suppresses
    stop_id = from_step("stop_id")
    plp_index = from_step("plp_index")  # P prompt-logprob positions
    plp_target = from_step("plp_target")


_unstaged = {f.name for f in STEP_FIELDS if f.staged} - set(CommonFields.names())
if _unstaged:
    raise TypeError(f"the step's staged fields {sorted(_unstaged)} need a CommonFields view")


class DeviceStep(ForwardFields, CommonFields):
    """A step's fields on its device, as every forward reads them (a backend's and a draft
    model's own groups view the same `views`)."""


_ALIGN = 8  # every field starts on an 8-byte boundary, so any dtype views it in place
_TORCH_DTYPES = {"int64": (torch.int64, 8), "float32": (torch.float32, 4)}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class StagingLayout:
    """The fields of one backend's steps, in packing order."""

    def __init__(self, backend_fields: type[StagedFields] = StagedFields,
                 tail_fields: type[StagedFields] = StagedFields) -> None:
        """tail_fields: after the common ones (a draft model's, drafter.py)."""
        self.fields = (*ForwardFields.packed_fields(), *backend_fields.packed_fields(),
                       *CommonFields.packed_fields(), *tail_fields.packed_fields())
        names = [f.name for f in self.fields]
        assert len(set(names)) == len(names), f"a staging field twice: {names}"
        # pack's and unpack's plan of each field, worked out once (they run once a step, on
        # the executor's critical path): (name, dtype, itemsize), and its torch dtype
        self._packing = tuple((f.name, f.dtype, np.dtype(f.dtype).itemsize)
                              for f in self.fields)
        self._unpacking = tuple((name, dtype, itemsize, _TORCH_DTYPES[dtype][0])
                                for name, dtype, itemsize in self._packing)
        self._names = frozenset(names)

    def nbytes(self, limits: EngineLimits) -> int:
        """Bytes of a staging buffer that holds any step."""
        return sum(_aligned(np.dtype(f.dtype).itemsize * f.max_count(limits))
                   for f in self.fields)

    def pack(self, arrays: dict[str, np.ndarray], out: np.ndarray) -> tuple[dict[str, int], int]:
        """Write every field of `arrays` densely into `out` (uint8); returns the count of each
        field and the bytes used. `offsets` finds them again from the counts."""
        # Every field starts on an 8-byte boundary: each is a slice of one typed view of the
        # whole buffer (no view made per field), and an empty one writes nothing.
        usable = out[:out.size - out.size % _ALIGN]
        typed = {dtype: usable.view(dtype) for dtype in _TORCH_DTYPES}
        counts, offset = {}, 0
        for name, dtype, itemsize in self._packing:
            values = arrays[name]
            n = counts[name] = values.size
            if n:
                at = offset // itemsize
                typed[dtype][at:at + n] = values.reshape(-1)
                offset += _aligned(n * itemsize)
        return counts, offset

    def offsets(self, counts: dict[str, int]) -> dict[str, tuple[int, int, str]]:
        """(byte offset, count, dtype) of each field of a buffer packed with these counts."""
        where, offset = {}, 0
        for name, dtype, itemsize, _ in self._unpacking:
            count = counts[name]
            where[name] = (offset, count, dtype)
            offset += -(-count * itemsize // _ALIGN) * _ALIGN
        return where

    def unpack(self, packed: torch.Tensor, counts: dict[str, int]) -> DeviceStep:
        """Typed views of each field over a packed uint8 buffer (on whichever device it
        lives), each made when first read: a view costs two torch calls (~3 us on the host),
        and a decode step reads a handful of the twenty-odd fields."""
        where, offset = {}, 0
        for name, _, itemsize, torch_dtype in self._unpacking:
            nbytes = counts[name] * itemsize
            where[name] = (offset, nbytes, torch_dtype)
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return DeviceStep(_LazyViews(packed, where, self._names))


class _LazyViews(dict[str, torch.Tensor]):
    """A step's views by field name (StagedFields.views), each made from the packed buffer
    when first read; `in` says whether the layout has the field, as a full dict would."""

    def __init__(self, packed: torch.Tensor, where: dict[str, tuple[int, int, torch.dtype]],
                 names: frozenset[str]) -> None:
        super().__init__()
        self._packed, self._where, self._names = packed, where, names

    def __missing__(self, name: str) -> torch.Tensor:
        offset, nbytes, torch_dtype = self._where[name]  # (KeyError: no such field)
        view = self[name] = self._packed[offset:offset + nbytes].view(torch_dtype)
        return view

    def __contains__(self, name: object) -> bool:
        return name in self._names or dict.__contains__(self, name)
