"""Rings of named tensors in POSIX shared memory. Created by the launcher, mapped by stages.

Each ring slot holds the same set of named buffers (numpy views over one mapping). The creator
unlinks the segment once every stage has mapped it, so nothing is left in /dev/shm whatever
way the run ends; mappings stay valid until each process exits. No resource tracker involved.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
_ALIGN = 64


@dataclass(frozen=True)
class BufferSpec:
    name: str
    dtype: str  # a numpy dtype name: "int64", "int32", "float32", "bool"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape)))


def _layout(specs: tuple[BufferSpec, ...]) -> tuple[dict[str, int], int]:
    offsets, offset = {}, 0
    for spec in specs:
        offsets[spec.name] = offset
        offset += (spec.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, max(offset, _ALIGN)


class SharedRing:
    """`num_slots` slots of buffers `specs`, in the segment /dev/shm/`name`."""

    def __init__(self, name: str, specs: tuple[BufferSpec, ...], num_slots: int, *, create: bool):
        self.name, self.specs, self.num_slots = name, specs, num_slots
        self._offsets, self.slot_nbytes = _layout(specs)
        size = self.slot_nbytes * num_slots
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared ring {name}: size {os.fstat(fd).st_size} != {size}")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = [self._make_views(i) for i in range(num_slots)]

    def _make_views(self, index: int) -> dict[str, np.ndarray]:
        base = index * self.slot_nbytes
        views = {}
        for spec in self.specs:
            count = int(np.prod(spec.shape))
            arr = np.frombuffer(self._mmap, spec.dtype, count, base + self._offsets[spec.name])
            views[spec.name] = arr.reshape(spec.shape)
        return views

    def slot(self, index: int) -> dict[str, np.ndarray]:
        return self._slots[index]

    @property
    def buffer(self) -> mmap.mmap:
        return self._mmap

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid. Safe to call twice."""
        unlink_segment(self.name)


def unlink_segment(name: str) -> None:
    """Remove /dev/shm/`name` if it is there."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
