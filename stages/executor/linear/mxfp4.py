"""OCP MXFP4 blocks (gpt-oss's expert weights, as its checkpoints ship them: `*_blocks` and
`*_scales`) as this engine's quantized blocks (quantized.py), exactly, in the executor
process at load. A block is 32 FP4 (e2m1) values, two to a byte (the low nibble the even
element), and one shared power of two (an e8m0 exponent, bias 127). The e2m1 values are
{0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}: twice them are the integers -12..12, so
code = 2 v + 12 (0..24) is a 5-bit code with d = 2^(e - 127) / 2 and mn = -12 d, both
powers of two (times 12) that float16 holds exactly for exponents 2^-24 to 2^15. Each block
then runs on the quantized kernels' 5-bit path (GGUF's Q5 types), at 5/4.25 of MXFP4's
bytes. A scale past float16's range (which every block format here keeps its scales in) is
refused by name."""

from __future__ import annotations

import torch

from stages.executor.linear.base import Linear
from stages.executor.linear.quantized import GgufMethod, QuantizedWeight, from_codes

# twice the e2m1 value of each 4-bit code (codes 8-15: the negatives of 0-7)
# (on the CPU whatever device is the default where this is first imported: the model's
# module imports it while the model is built on the meta device)
_TWICE = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                      dtype=torch.int16, device="cpu")
_FP16_EXPONENTS = (-24, 15)  # 2^e that float16 holds exactly (subnormals included)


def mxfp4_values(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, G * 32] of blocks uint8 [N, G, 16] and scales uint8 [N, G] (the
    reference: transformers' convert_moe_packed_tensors, before its transpose)."""
    twice = _codes(blocks).float() - 12  # [N, G, 32]
    return torch.ldexp(twice / 2, scales.to(torch.int32)[..., None] - 127).flatten(1)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [N, G, 16] -> 2 v + 12 as uint8 [N, G, 32] (low nibbles the even elements)."""
    b = blocks.to(torch.int64)
    twice = torch.stack([_TWICE[b & 0x0F], _TWICE[b >> 4]], dim=-1).flatten(-2)
    return (twice + 12).to(torch.uint8)


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """MXFP4 rows (blocks uint8 [N, G, 16], scales uint8 [N, G]: N outputs of G * 32
    inputs) as 5-bit blocks holding the same values."""
    n, groups, width = blocks.shape
    if width != 16 or scales.shape != (n, groups):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} with scales "
                         f"{tuple(scales.shape)}: 16 bytes (32 values) a block, one scale each")
    exponents = scales.to(torch.int32) - 128  # of d = 2^(e - 127) / 2
    lo, hi = _FP16_EXPONENTS
    if int(exponents.min()) < lo or int(exponents.max()) > hi - 4:  # (mn = -12 d < 2^hi)
        raise ValueError(f"MXFP4 scales from 2^{int(exponents.min()) + 1} to "
                         f"2^{int(exponents.max()) + 1}: the engine's blocks hold scales "
                         f"from 2^{lo + 1} to 2^{hi - 3} (float16)")
    d = torch.ldexp(torch.ones(n, groups, device=blocks.device), exponents).half()
    return from_codes(_codes(blocks).view(n, -1), d, -12 * d, 5)


class Mxfp4Method(GgufMethod):
    """A checkpoint's MXFP4 layers (gpt-oss's experts), given their blocks by the loader
    (mxfp4_blocks) and run on the quantized kernels, whatever format the model's other
    layers have."""

    name = "mxfp4"

    def process(self, layer: Linear) -> None:
        if not hasattr(layer, "tiles"):
            raise ValueError(f"{layer}: the checkpoint gave this layer no MXFP4 blocks")
