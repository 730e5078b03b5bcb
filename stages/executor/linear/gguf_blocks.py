"""llama.cpp's block formats as this engine's quantized blocks (quantized.py: per 32 inputs,
unsigned codes, w = d * code + mn, fp16 d and mn), in the executor process, at load, one
tensor at a time, never widened to floats whole:

- Q4_0, Q4_1: 4-bit blocks of 32, exactly (Q4_0: mn = -8 d);
- Q5_0, Q5_1: 5-bit blocks, exactly (Q5_0: mn = -16 d);
- Q8_0: 8-bit blocks, exactly (code = q + 128, mn = -128 d);
- Q4_K (4-bit), Q5_K (5-bit): super-blocks of 256 with a 6-bit scale and minimum per
  sub-block of 32, w = (d sc) q - (dmin m): each sub-block is one of our blocks with
  d' = d sc and mn' = -dmin m, each rounded once to fp16 (relative 2^-11, far below the
  codes' step);
- Q6_K: sub-blocks of 16 with their own int8 scales, which no one scale per 32 holds: its
  values (gguf's reference dequantization) requantized to 8-bit blocks (256 codes where the
  file has 64: within half our step);
- MXFP4: a block of 32 e2m1 values and one e8m0 scale, as 5-bit blocks exactly (mxfp4.py,
  which takes gpt-oss's safetensors layout: ggml's block is that scale byte, then 16 bytes
  whose low nibbles are elements 0..15 and high ones 16..31, where the safetensors layout
  pairs elements 2j, 2j + 1 in byte j).

The byte layouts are ggml's (ggml-common.h); the tests check every type against the `gguf`
package's reference dequantization."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from stages.executor.linear.mxfp4 import mxfp4_blocks
from stages.executor.linear.quantized import QuantizedWeight, from_codes, quantize_int8


def _halves(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] -> float32 [...] (little-endian fp16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: 4 bytes (a little-endian uint32) -> bit j of each of `count`."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minima (get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """[N, nb, bytes] blocks -> codes uint8 [N, nb, 32 or 256], d and mn float32 per 32 codes
    ([N, nb, 1 or 8]), and the codes' bits."""
    if kind == "Q8_0":
        d = _halves(blocks[..., 0:2])[..., None]
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 8
    if kind in ("Q4_0", "Q4_1"):
        d = _halves(blocks[..., 0:2])[..., None]
        mn = -8 * d if kind == "Q4_0" else _halves(blocks[..., 2:4])[..., None]
        return _nibbles(blocks[..., -16:]), d, mn, 4
    if kind in ("Q5_0", "Q5_1"):
        d = _halves(blocks[..., 0:2])[..., None]
        mn = -16 * d if kind == "Q5_0" else _halves(blocks[..., 2:4])[..., None]
        at = 2 if kind == "Q5_0" else 4
        codes = _nibbles(blocks[..., at + 4:at + 20]) | (_high_bits(blocks[..., at:at + 4], 32)
                                                         << 4)
        return codes, d, mn, 5
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _halves(blocks[..., 0:2])[..., None], _halves(blocks[..., 2:4])[..., None]
        sc, m = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 32)  # a chunk per 64 codes
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [..., 4, 2, 32]: sub-blocks 2c, 2c+1
        if kind == "Q5_K":
            qh = blocks[..., 16:48][..., None, None, :]  # bit 2c + h of byte l: code l of 2c+h
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            codes = codes | (((qh >> shifts) & 1) << 4)
        codes = codes.reshape(*blocks.shape[:-1], 256)
        return codes, d * sc, -(dmin * m), 4 if kind == "Q4_K" else 5
    raise ValueError(f"no direct conversion of {kind} blocks")


def gguf_blocks(data: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
    """A GGUF tensor of `kind` blocks, uint8 [N, bytes per row], as our blocks ([N, K])."""
    qtype = GGMLQuantizationType[kind]
    per_block, size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    if in_features % per_block or data.shape[1] != in_features // per_block * size:
        raise ValueError(f"{kind} rows of {data.shape[1]} bytes for {in_features} inputs")
    if kind == "MXFP4":
        return _mxfp4(np.asarray(data).reshape(n, -1, size))
    if kind == "Q6_K":
        values = quants.dequantize(np.asarray(data), qtype)
        return quantize_int8(torch.from_numpy(np.ascontiguousarray(values, np.float32)))
    codes, d, mn, bits = _decode(np.asarray(data).reshape(n, -1, size), kind)
    d16, mn16 = (torch.from_numpy(np.ascontiguousarray(v.reshape(n, -1))).half()
                 for v in (d, mn))
    if not (torch.isfinite(d16).all() and torch.isfinite(mn16).all()):
        raise ValueError(f"a {kind} block's scale or minimum is past float16's range")
    return from_codes(torch.from_numpy(np.ascontiguousarray(codes.reshape(n, -1))), d16, mn16,
                      bits)


def _mxfp4(blocks: np.ndarray) -> QuantizedWeight:
    """ggml's MXFP4 blocks uint8 [N, G, 17] in the safetensors layout mxfp4_blocks takes."""
    elements = _nibbles(blocks[..., 1:])  # [N, G, 32] in order
    paired = elements[..., 0::2] | (elements[..., 1::2] << 4)  # [N, G, 16]
    return mxfp4_blocks(torch.from_numpy(np.ascontiguousarray(paired)),
                        torch.from_numpy(np.ascontiguousarray(blocks[..., 0])))
