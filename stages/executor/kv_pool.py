"""The KV cache's format and memory, in the executor process: the one place that knows what a
block holds (--kv-cache-dtype). A format says the cache tensor's dtype and a head's row in it;
the pool allocates every layer's cache in that format and says how many bytes a block takes,
which is what the runner divides --kv-cache-memory by. The cache tensor's dtype is how the
CPU kernels know the format (csrc/kv_formats.h): they quantize a step's keys and values as
they write them and widen a page at a time as they read, so no caller passes a format on.

- `auto`: the model's dtype, every backend.
- `int8`: per token and KV head, D int8 codes and an fp16 scale (max|x| / 127, rounded up),
  the row's last two bytes: 1.94x the tokens of bf16 at head size 64 (an fp32 scale would give
  1.88x). Keys are stored rotated by the Hadamard matrix (queries alike: the scores are
  unchanged), which spreads a key's outlier channels over the row: on the default model the
  mean |Δ log-prob| against a float32 cache fell from 0.031 to 0.016. Queries go on their int8
  grid (0.0199 with it): a decode scores by integer dot products (VNNI), and every form scores
  alike. Ours: vLLM has no int8 KV; llama.cpp's q8_0 keeps an fp16 scale per 32 elements.
- `fp8_e4m3` (`fp8`), `fp8_e5m2`: vLLM's names, one byte an element with no scale (a scale of
  1.0, vLLM's when a checkpoint carries no calibrated one: not calibrated here either), values
  past the format's range saturate. 2x the tokens of bf16.

The 8-bit formats are read by the CPU kernels' vector forms (a decode's pages in place, int8 as
integer products; other reads a page widened to float rows in the thread's buffer; a CPU with
AMX runs them on AVX-512, AMX having no 8-bit float type and its int8 products wanting both
sides in int8). The torch and flex forwards keep the model's dtype:
select.py refuses an 8-bit format there by name, before anything starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ipc.config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class KVFormat:
    """How a head's key or value is stored in the cache: `storage` elements (None: the model's
    dtype) a row of head_dim + `extra`."""

    name: str  # as --kv-cache-dtype names it, aliases resolved
    storage: torch.dtype | None = None
    extra: int = 0  # elements past the head's codes (int8: its fp16 scale's two bytes)

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.storage if self.storage is not None else model_dtype

    def row(self, head_dim: int) -> int:
        """Elements of one head's key (or value) in the cache."""
        return head_dim + self.extra

    def describe(self, model_dtype: torch.dtype) -> str:
        """The format as the start-up log and /metrics say it (auto: the dtype's name)."""
        return self.name if self.quantized else str(model_dtype).removeprefix("torch.")


FORMATS = {
    "auto": KVFormat("auto"),
    "int8": KVFormat("int8", torch.int8, extra=2),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2),
}
ALIASES = {"fp8": "fp8_e4m3"}  # (vLLM's: fp8 is e4m3)
assert set(FORMATS) | set(ALIASES) == set(KV_CACHE_DTYPES)


def kv_format(name: str) -> KVFormat:
    """The format --kv-cache-dtype `name` names (validated by ExecutorConfig already)."""
    return FORMATS[ALIASES.get(name, name)]


@dataclass(frozen=True)
class KVShape:
    """What a model's cache holds per token: its layers (this rank's), KV heads, head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_dtype: torch.dtype


class KVPool:
    """The layers' caches [2, num_blocks, block_size, kv_heads, row] in one format, each its
    own tensor (so that every layer's cache looks alike to a compiled layer); the runner's
    (and a draft model's, whose blocks are the same ids). places: each layer's place
    (ArchSpec.kv_places; None: a place each): layers at the same place, each of another KV
    group, share one tensor, a block holding the KV of whichever group holds it."""

    def __init__(self, fmt: KVFormat, shape: KVShape, num_blocks: int, block_size: int,
                 device: torch.device, places: Sequence[int] | None = None) -> None:
        self.format, self.shape = fmt, shape
        self.num_blocks, self.block_size = num_blocks, block_size
        places = list(range(shape.num_layers)) if places is None else list(places)
        assert len(places) == shape.num_layers
        dims = (2, num_blocks, block_size, shape.num_kv_heads, fmt.row(shape.head_dim))
        # Written whole now, at the start: memory from calloc (pages the kernel zeroes when a
        # block is first written) started 0.2 s sooner for 1 GiB but moved those page faults
        # into the first steps that reach each block: a fresh engine's 64 x 128 tokens in
        # bf16 ran at 811-864 tok/s against 891-944 (in process, interleaved).
        tensors = {p: torch.zeros(dims, dtype=fmt.dtype(shape.model_dtype), device=device)
                   for p in sorted(set(places))}
        self.caches = [tensors[p] for p in places]

    @staticmethod
    def bytes_per_block(fmt: KVFormat, shape: KVShape, block_size: int,
                        num_places: int | None = None) -> int:
        """A block's bytes: a layer's for each of the shape's layers (or num_places)."""
        itemsize = torch.empty((), dtype=fmt.dtype(shape.model_dtype)).element_size()
        layers = shape.num_layers if num_places is None else num_places
        return (layers * 2 * block_size * shape.num_kv_heads * fmt.row(shape.head_dim)
                * itemsize)

    def describe(self) -> str:
        return self.format.describe(self.shape.model_dtype)
