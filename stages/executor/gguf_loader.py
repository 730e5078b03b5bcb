"""A GGUF file's tensors as checkpoint entries (loader.py), in the executor process: each
tensor under its Hugging Face name, read from the memory-mapped file one at a time; quantized
ones as our blocks (linear/gguf_blocks.py), float ones as tensors. llama.cpp's converter
permutes the rows of a "llama" file's q and k projections (interleaved rope pairs); they are
put back in Hugging Face's order here, rows of blocks as rows of floats. It stores Gemma's
norm weights as 1 + w; w is taken back here (x - 1 is exact in float32 for every x = 1 + w
the converter can write from a w >= -2, so the model's 1 + w is the file's x again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from ipc.arch import ArchSpec
from ipc.gguf_source import (
    EXPERT,
    FLOATS,
    NORM_PLUS_ONE,
    PERMUTED_QK,
    GgufSource,
    check_tensors,
    hf_name,
)
from stages.executor.linear.gguf_blocks import gguf_blocks
from stages.executor.linear.quantized import QuantizedWeight


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The rows of a llama.cpp-permuted q or k projection ([heads * D, ...]) in Hugging
    Face's order: row i of the result is row index[i] of the file's."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _floats(tensor: Any, data: np.ndarray) -> torch.Tensor:
    if tensor.tensor_type.name == "BF16":  # (read as raw bytes: two a value)
        shape = [*data.shape[:-1], int(tensor.shape[0])]
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy())
        return raw.view(torch.bfloat16).reshape(shape).float()
    return torch.from_numpy(np.array(data, dtype=np.float32))


def gguf_entries(source: GgufSource, spec: ArchSpec,
                 keep: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, str, Any]]:
    """(file name, Hugging Face name, float tensor or QuantizedWeight) of every tensor (that
    `keep` keeps, by name: a pipeline stage reads only its own layers' blocks); a mixture of
    experts' stacked tensor as one entry per expert, kept in its blocks."""
    reader = GGUFReader(source.file)
    check_tensors(source.file, source.architecture,
                  {t.name: t.tensor_type.name for t in reader.tensors})
    where = Path(source.file).name
    for tensor in reader.tensors:
        name = hf_name(tensor.name, source.architecture)
        assert name is not None  # (check_tensors refused the others)
        if keep is not None and not keep(name):
            continue
        if EXPERT in name:
            for expert, part in enumerate(np.asarray(tensor.data)):
                yield where, name.replace(EXPERT, str(expert)), _value(tensor, part)
            continue
        value = _value(tensor, np.asarray(tensor.data))
        if name.endswith("shared_expert_gate.weight") and isinstance(value, torch.Tensor):
            value = value.reshape(1, -1)  # (a vector in llama.cpp's files; a [1, hidden] row)
        if source.architecture in NORM_PLUS_ONE and name.endswith("norm.weight"):
            value = _floats_of(value) - 1
        if source.architecture in PERMUTED_QK and name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = spec.num_heads if name.split(".")[-2] == "q_proj" else spec.num_kv_heads
            value = _rows(value, unpermute_rows(_num_rows(value), heads))
        yield where, name, value


def _value(tensor: Any, data: np.ndarray) -> torch.Tensor | QuantizedWeight:
    """`data` (the tensor's, or one expert's rows of it) as floats or our blocks."""
    kind = tensor.tensor_type.name
    if kind in FLOATS:
        return _floats(tensor, data)
    return gguf_blocks(data, kind, int(tensor.shape[0]))


def _floats_of(value: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return value.dequantize() if isinstance(value, QuantizedWeight) else value.float()


def _num_rows(value: torch.Tensor | QuantizedWeight) -> int:
    return len(value.d) if isinstance(value, QuantizedWeight) else value.shape[0]


def _rows(value: torch.Tensor | QuantizedWeight,
          index: torch.Tensor) -> torch.Tensor | QuantizedWeight:
    if isinstance(value, QuantizedWeight):
        return QuantizedWeight(value.codes[index].contiguous(), value.d[index].contiguous(),
                               value.mn[index].contiguous(), value.bits, value.in_features)
    return value[index].contiguous()
