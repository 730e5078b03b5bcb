"""Weights reordered once into oneDNN's blocked layout (CPU), in the executor process: the
matrix products that are most of a CPU step then skip the per-call repacking of the plain
[out, in] weight; measured 2-3x faster per product in fp32 at batch 32 on the 2-core test
machine (docs/BENCHMARKS.md, "Packed weights")."""

from __future__ import annotations

import functools

import torch

from stages.executor.linear.base import Linear, LinearMethod


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype on this CPU: bf16 needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, which an AVX2-only CPU lacks (there F.linear runs it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class OneDnnPackedMethod(LinearMethod):
    name = "onednn-packed"

    @classmethod
    def unsupported(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"oneDNN packs weights on the CPU only, not {device.type}"
        if not can_pack(dtype):
            return f"oneDNN cannot pack {dtype} on this CPU"
        return None

    @classmethod
    def take(cls, layer: Linear) -> None:
        """Give `layer` (its plain weight loaded) to this method: a format that cannot run
        one of its layers hands it over here."""
        layer.method = cls()
        layer.method.process(layer)

    def process(self, layer: Linear) -> None:
        """The packed copy replaces the plain weight (a tied head's plain matrix stays the
        embedding's)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        del layer.weight
        layer.register_buffer("packed_weight", packed)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight,
                                                  layer.bias, "none", [], "")
