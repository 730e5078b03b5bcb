"""Quantized weights on the CPU, in the executor process: `--quantization int8` (8-bit codes
with an fp16 scale and minimum per block of 32 inputs) and `int4` (4-bit codes, a scale and a
minimum per block of 32: llama.cpp's Q4_1), made from the loaded float weights.

One format holds them all: per block of 32 along the input, unsigned codes and two fp16
numbers, w = d * code + mn. The product is csrc/quant_kernels.cpp's `quantized_linear`: the
activations are quantized per block of 32 as it runs, in two int8 parts (about 16 bits; one
part, as llama.cpp's Q8_1, cost more accuracy than the weights' rounding), so each block is
integer dot products (AVX512-VNNI). Decode streams a quarter (int8) or an eighth (int4) of
fp32's weight bytes.

The input dimension is padded to a multiple of 64 (a pair of blocks) with blocks of d = mn = 0.
Inside each pair the values are interleaved four at a time (b0[0:4], b1[0:4], b0[4:8], ...),
so that each int32 lane of the kernel's dot products belongs to one block; int8 codes are one
byte each in that order, int4 codes two to a byte (positions 0..31 of a pair in the low
nibbles, 32..63 in the high ones). 5-bit codes (GGUF's Q5 types, gguf_blocks.py) are int4's
bytes of their low four bits followed, per pair, by 8 bytes (a little-endian 64-bit word)
whose bit i is the fifth bit of position i.

On a CPU with AMX and bf16 activations, an engine that may run several rows a step takes the
same blocks in a second layout (`panel_layout`): csrc/amx_linear.cpp's
`amx_quantized_linear` widens each block to bf16 (w = d * code + mn, rounded once) in L1 as
the product runs and multiplies on AMX-BF16 tiles, the activations as they are. At 32 rows
takes a sixth of quantized_linear's time, about bf16's own (docs/BENCHMARKS.md), but at one
row it is bound by the widening, 1.2-2.4x slower. A row's result differs between the two
forms, and must not depend on how many rows share a step, so the form is chosen once per
model at load (`products_for`): AMX where a step may hold AMX_ROWS rows or more."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from stages.executor import kernels
from stages.executor.linear import amx
from stages.executor.linear.base import Linear, LinearMethod, over_rows

logger = logging.getLogger(__name__)

BLOCK = 32
PAIR = 64
QUANTIZATIONS = ("int8", "int4")
# The fewest rows a decode step may hold (the engine's max_num_seqs) for which quantized
# products run widened on AMX tiles: at 8 rows they took half quantized_linear's time or
# less, at one row 1.2-2.4 times it (docs/BENCHMARKS.md).
AMX_ROWS = 4


@dataclass
class QuantizedWeight:
    """A [N, K] weight as quantized_linear takes it: codes uint8 [N, Kp] (8 bits),
    [N, Kp / 2] (4 bits) or [N, Kp / 64 * 40] (5 bits), d and mn float16 [N, Kp / 32]; Kp is
    K padded to 64."""

    codes: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor
    bits: int
    in_features: int

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight these blocks hold (the reference the kernel is tested
        against)."""
        n, blocks = self.d.shape
        codes = _block_order(_unpack(self))
        w = (codes.view(n, blocks, BLOCK).float() * self.d.float()[..., None]
             + self.mn.float()[..., None])
        return w.reshape(n, -1)[:, : self.in_features]


def _pair_order(v: torch.Tensor) -> torch.Tensor:
    """[N, Kp] from block order to pair order (b0[0:4], b1[0:4], b0[4:8], b1[4:8], ... in
    each pair of blocks)."""
    n, kp = v.shape
    return v.view(n, kp // PAIR, 2, 8, 4).transpose(2, 3).reshape(n, kp).contiguous()


def _block_order(v: torch.Tensor) -> torch.Tensor:
    """[N, Kp] from pair order back to block order."""
    n, kp = v.shape
    return v.view(n, kp // PAIR, 8, 2, 4).transpose(2, 3).reshape(n, kp).contiguous()


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [N, Kp / 32, 32], zero-padded to a multiple of 64 inputs."""
    n, k = w.shape
    kp = -(-k // PAIR) * PAIR
    padded = torch.nn.functional.pad(w.float(), (0, kp - k))
    return padded.view(n, kp // BLOCK, BLOCK)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """8-bit blocks with a minimum: mn = min, d = (max - min) / 255, code = round((w - mn) / d).
    (llama.cpp's Q8_0 is symmetric, mn = -128 d; a minimum costs nothing in the kernel, uses
    all 256 codes when a block is lopsided, and holds a Q4_1 grid such as the default model's
    weights to fp16's rounding of d.)"""
    return quantize_blocks(w, 8)


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """4-bit blocks with a minimum (Q4_1): mn = min, d = (max - min) / 15,
    code = round((w - mn) / d); the codes packed two to a byte."""
    return quantize_blocks(w, 4)


def quantize_blocks(w: torch.Tensor, bits: int) -> QuantizedWeight:
    """Blocks of codes of `bits` (8, 5 or 4) with a minimum: mn = min,
    d = (max - min) / (2**bits - 1), code = round((w - mn) / d)."""
    if bits not in (8, 5, 4):
        raise ValueError(f"codes of 8, 5 or 4 bits, not {bits}")
    q = _quantize_min_scale(w, bits)
    return q if bits == 8 else _pack(q, bits)


def _quantize_min_scale(w: torch.Tensor, bits: int) -> QuantizedWeight:
    """Codes in pair order, one a byte, rounded against the fp16 d and mn the kernel will
    use."""
    blocks = _blocks(w)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    top = 2 ** bits - 1
    mn, d = lo.half(), ((hi - lo) / top).half()
    scale = d.float()[..., None]
    q = torch.where(scale > 0, (blocks - mn.float()[..., None])
                    / scale.clamp_min(torch.finfo(torch.float32).tiny), 0)
    codes = q.round().clamp(0, top).to(torch.uint8).view(len(w), -1)
    return QuantizedWeight(_pair_order(codes), d, mn, bits, w.shape[1])


def from_codes(codes: torch.Tensor, d: torch.Tensor, mn: torch.Tensor,
               bits: int) -> QuantizedWeight:
    """The blocks that hold w = d * code + mn for codes already made (a GGUF file's):
    `codes` uint8 [N, K] in block order, one a byte (< 2**bits), `d` and `mn` float16
    [N, K / 32]; K a multiple of 32, padded here to 64 with blocks of d = mn = 0."""
    n, k = codes.shape
    if k % BLOCK or d.shape != (n, k // BLOCK) or mn.shape != d.shape:
        raise ValueError(f"codes {tuple(codes.shape)} with scales {tuple(d.shape)} and minima "
                         f"{tuple(mn.shape)}: one scale and minimum per {BLOCK} codes")
    if int(codes.max()) >= 2 ** bits:
        raise ValueError(f"a code of {int(codes.max())} does not fit in {bits} bits")
    pad = -k % PAIR
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
        d = torch.nn.functional.pad(d, (0, pad // BLOCK))
        mn = torch.nn.functional.pad(mn, (0, pad // BLOCK))
    q = QuantizedWeight(_pair_order(codes), d.contiguous(), mn.contiguous(), 8, k)
    return q if bits == 8 else _pack(q, bits)


def widen(weight: QuantizedWeight, bits: int) -> QuantizedWeight:
    """The same values in codes of `bits` (no fewer than the weight's own)."""
    if bits < weight.bits:
        raise ValueError(f"{weight.bits}-bit codes do not fit in {bits} bits")
    if bits == weight.bits:
        return weight
    codes = QuantizedWeight(_unpack(weight), weight.d, weight.mn, 8, weight.in_features)
    return codes if bits == 8 else _pack(codes, bits)


def join_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of a fused projection (q, k, v) stacked by rows, at the widest parts' bits."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError(f"parts of {[p.in_features for p in parts]} inputs cannot be joined")
    bits = max(p.bits for p in parts)
    parts = [widen(p, bits) for p in parts]
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                           torch.cat([p.mn for p in parts]), bits, parts[0].in_features)


def _pack(q: QuantizedWeight, bits: int) -> QuantizedWeight:
    """8-bit-a-byte codes (< 2**bits) in pair order as 4 or 5 bits: the low four bits two to
    a byte (positions 0..31 of each pair in the low nibbles, 32..63 in the high ones); at 5
    bits, each pair's 32 bytes followed by its fifth bits, bit i of a little-endian 64-bit
    word for position i."""
    n = len(q.d)
    codes = q.codes.view(n, -1, PAIR)
    low = codes & 0x0F
    packed = low[..., :32] | (low[..., 32:] << 4)
    if bits == 5:
        weights = 1 << torch.arange(8, dtype=torch.uint8)  # bit j of byte b: position 8 b + j
        fifth = ((codes >> 4) & 1).view(n, -1, 8, 8) * weights
        packed = torch.cat([packed, fifth.sum(-1, dtype=torch.uint8)], dim=-1)
    return QuantizedWeight(packed.reshape(n, -1).contiguous(), q.d, q.mn, bits, q.in_features)


def _unpack(q: QuantizedWeight) -> torch.Tensor:
    """A weight's codes one a byte, uint8 [N, Kp] in pair order."""
    if q.bits == 8:
        return q.codes
    n = len(q.d)
    per_pair = 32 if q.bits == 4 else 40
    pairs = q.codes.view(n, -1, per_pair)
    packed = pairs[..., :32]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    if q.bits == 5:
        bits = (pairs[..., 32:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        codes |= bits.reshape(n, -1, PAIR) << 4
    return codes.reshape(n, -1)


def tile_layout(weight: QuantizedWeight) -> torch.Tensor:
    """The blocks in the order quantized_linear streams them (csrc/quant_kernels.cpp):
    uint8 [ceil(N / 4), pairs * chunk], each tile of 4 rows (N padded with zero rows) pair
    after pair, a pair's chunk the 4 rows' codes, at 5 bits their fifth bits (per two rows,
    a 64-bit mask of both rows' positions 0..31, then one of 32..63), then their d, then their
    mn (fp16, the pair's two blocks a row)."""
    n, pairs = len(weight.d), weight.d.shape[1] // 2
    tiles = -(-n // 4)

    def rows(v: torch.Tensor) -> torch.Tensor:  # [N, pairs * X] -> [T, 4, pairs, X]
        v = torch.nn.functional.pad(v.view(torch.uint8), (0, 0, 0, 4 * tiles - n))
        return v.view(tiles, 4, pairs, -1)

    def by_tile(v: torch.Tensor) -> torch.Tensor:  # [T, 4, pairs, X] -> [T, pairs, 4 * X]
        return v.transpose(1, 2).reshape(tiles, pairs, -1)

    codes = rows(weight.codes)
    parts = [by_tile(codes[..., :32] if weight.bits == 5 else codes)]
    if weight.bits == 5:  # [T, 2 (row pair), 2 (row), pairs, 2 (half), 4 bytes]
        fifth = codes[..., 32:].reshape(tiles, 2, 2, pairs, 2, 4)
        parts.append(fifth.permute(0, 3, 1, 4, 2, 5).reshape(tiles, pairs, 32))
    chunks = torch.cat([*parts, by_tile(rows(weight.d)), by_tile(rows(weight.mn))], dim=-1)
    return chunks.reshape(tiles, -1).contiguous()


def panel_layout(weight: QuantizedWeight) -> torch.Tensor:
    """The blocks as amx_quantized_linear streams them (csrc/amx_linear.cpp): uint8
    [ceil(N / 32), K / 32 * chunk], a panel of 32 outputs (N padded with zero rows) chunk
    after chunk, a chunk one block of each output: the codes in the order of the bf16 B tiles
    they widen into (per 16 outputs, per pair p of inputs, W[n][2p], W[n][2p + 1] for each n),
    8 bits a byte, or 4 bits, value i of a row's 32 in byte i % 16's low (i < 16) or high
    nibble, then at 5 bits a 32-bit word a row of the values' fifth bits; then the 32 outputs'
    d, then their mn (fp16). K must be a multiple of 32."""
    n, k = len(weight.d), weight.in_features
    if k % BLOCK:
        raise ValueError(f"panel layout: {k} inputs, not a multiple of {BLOCK}")
    chunks, panels = k // BLOCK, -(-n // amx.PANEL)
    pad = panels * amx.PANEL - n
    codes = torch.nn.functional.pad(_block_order(_unpack(weight))[:, :k], (0, 0, 0, pad))
    # [panel, half, column, chunk, pair, 2] -> [panel, chunk, half x pair (32 rows), 32]
    rows = codes.view(panels, 2, 16, chunks, 16, 2).permute(0, 3, 1, 4, 2, 5)
    rows = rows.reshape(panels, chunks, 32, 32)
    if weight.bits == 8:
        parts = [rows.reshape(panels, chunks, -1)]
    else:
        low = rows & 0x0F
        parts = [(low[..., :16] | (low[..., 16:] << 4)).reshape(panels, chunks, -1)]
        if weight.bits == 5:
            bit = ((rows >> 4) & 1).to(torch.int64) << torch.arange(32)
            words = bit.sum(-1).to(torch.int32)  # (wraps to the same 32 bits)
            parts.append(words.view(torch.uint8).reshape(panels, chunks, -1))

    def by_chunk(v: torch.Tensor) -> torch.Tensor:  # [N, blocks] fp16 -> [panels, chunks, 64]
        v = torch.nn.functional.pad(v[:, :chunks], (0, 0, 0, pad))
        return v.view(panels, amx.PANEL, chunks).transpose(1, 2).contiguous().view(torch.uint8)

    parts += [by_chunk(weight.d), by_chunk(weight.mn)]
    return torch.cat(parts, dim=-1).reshape(panels, -1).contiguous()


def interleave_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """A gate/up weight's rows 16 gate then 16 up at a time (amx.interleave_gate_up), so a
    panel's product is a block of gate and the matching block of up."""
    return QuantizedWeight(amx.interleave_gate_up(weight.codes),
                           amx.interleave_gate_up(weight.d), amx.interleave_gate_up(weight.mn),
                           weight.bits, weight.in_features)


def reference_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What quantized_linear computes, in float32 PyTorch: x quantized per block of 32 as the
    kernel does (dx = amax / 127; x = dx (hi + lo / 256), both parts int8), times the
    dequantized weight."""
    k = weight.in_features
    kp = weight.d.shape[1] * BLOCK
    xb = torch.nn.functional.pad(x.float(), (0, kp - k)).view(len(x), -1, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.clamp_min(torch.finfo(torch.float32).tiny), 0)
    scaled = xb * inv
    hi = scaled.round()
    lo = ((scaled - hi) * 256).round().clamp(-127, 127)
    xq = (hi + lo / 256) * (amax / 127)
    y = xq.view(len(x), kp)[:, :k] @ weight.dequantize().T
    return y if bias is None else y + bias.float()


def reference_widened(x: torch.Tensor, weight: QuantizedWeight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """What amx_quantized_linear computes, in float32 PyTorch: x (bf16) times the weight
    widened to bf16 from one fused multiply-add, d * code + mn."""
    n, blocks = weight.d.shape
    codes = _block_order(_unpack(weight)).view(n, blocks, BLOCK).double()
    w = codes * weight.d.double()[..., None] + weight.mn.double()[..., None]  # (exact)
    w = w.float().bfloat16().float().reshape(n, -1)[:, : weight.in_features]
    y = x.float() @ w.T
    return y if bias is None else y + bias.float()


@functools.cache
def kernel_missing() -> str | None:
    """Why quantized_linear cannot run on this machine (None: it can)."""
    return kernels.op_missing("quantized_linear_available",
                              "this CPU lacks AVX512-VNNI, which the quantized kernels need")


def products_for(dtype: torch.dtype, rows: int) -> str:
    """The form of a model's quantized products (module docstring): "amx" for bf16
    activations on a CPU with AMX where a step may hold `rows` >= AMX_ROWS, else "vnni"."""
    why = (f"{dtype} activations" if dtype != torch.bfloat16
           else f"steps of at most {rows} rows (max_num_seqs < {AMX_ROWS})" if rows < AMX_ROWS
           else amx.kernel_missing())
    if why is None:
        logger.info("quantized products: widened to bf16 on AMX tiles (steps of up to %d rows)",
                    rows)
        return "amx"
    logger.info("quantized products: AVX512-VNNI integer dot products (%s)", why)
    return "vnni"


class QuantizedMethod(LinearMethod):
    """Weights quantized at load (`process`) and multiplied by quantized_linear or, where
    `products` is "amx" (products_for), amx_quantized_linear."""

    name: str
    bits: int

    def __init__(self, products: str = "vnni") -> None:
        if products not in ("vnni", "amx"):
            raise ValueError(f"quantized products are vnni or amx, not {products!r}")
        self.products = products

    @classmethod
    def unsupported(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if device.type != "cpu":
            return (f"quantized weights run on the CPU only, not {device.type}; "
                    "leave out --quantization there")
        if dtype not in (torch.float32, torch.bfloat16):
            return f"quantized weights take float32 or bfloat16 activations, not {dtype}"
        return kernel_missing()

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        return quantize_int8(w) if self.bits == 8 else quantize_int4(w)

    def process(self, layer: Linear) -> None:
        """The blocks replace the plain weight (a tied head's plain matrix stays the
        embedding's); the bias becomes float32, as the kernel adds it."""
        set_weight(layer, self.quantize(layer.weight.detach()))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.products == "amx":
            if layer.fused_gate:
                raise RuntimeError(f"{layer}: its gate and up rows are interleaved; "
                                   "call gated_forward")
            return self._widened(layer, x, False)
        return over_rows(x, lambda rows: torch.ops.llm_cpu.quantized_linear(
            rows, layer.tiles, layer.bias_f32, layer.bits, layer.out_features))

    def fused_product(self, layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return self._widened(layer, x, gated)

    @staticmethod
    def _widened(layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return over_rows(x, lambda rows: torch.ops.llm_cpu.amx_quantized_linear(
            rows, layer.panels, layer.bias_f32, layer.bits, layer.out_features, gated))


def set_weight(layer: Linear, weight: QuantizedWeight) -> None:
    """Give `layer` these blocks in place of its plain weight, in its method's form of
    products: amx (panel_layout; a SiLU gate/up weight's rows interleaved so that the product
    writes silu(gate) * up) unless the layer is a routed expert (quantized_moe runs those, in
    tiles), its inputs are not a multiple of 32, or the method is vnni."""
    if weight.in_features != layer.in_features or len(weight.d) != layer.out_features:
        raise ValueError(f"a [{len(weight.d)}, {weight.in_features}] quantized weight for a "
                         f"[{layer.out_features}, {layer.in_features}] layer")
    if "weight" in layer._parameters:
        del layer.weight
    products = getattr(layer.method, "products", "vnni")
    if getattr(layer, "routed_expert", False) or weight.in_features % BLOCK:
        products = "vnni"
    layer.products, layer.bits = products, weight.bits
    bias = layer.bias.detach().float().contiguous() if layer.bias is not None else None
    layer.fused_gate = (products == "amx" and layer.gated
                        and layer.out_features % (2 * amx.GATE_BLOCK) == 0)
    if layer.fused_gate:
        weight = interleave_rows(weight)
        bias = amx.interleave_gate_up(bias).contiguous() if bias is not None else None
    if products == "amx":
        layer.register_buffer("panels", panel_layout(weight))
    else:
        layer.register_buffer("tiles", tile_layout(weight))
    layer.register_buffer("bias_f32", bias)


class Int8Method(QuantizedMethod):
    name, bits = "int8", 8


class Int4Method(QuantizedMethod):
    """4-bit weights; the head (the logits product, where errors are the most visible) gets
    8 bits, as llama.cpp's Q4 files keep their output matrix at 6 or 8."""

    name, bits = "int4", 4

    def for_head(self) -> LinearMethod:
        return Int8Method(self.products)


class GgufMethod(QuantizedMethod):
    """A GGUF file's blocks (gguf_blocks.py), set on each layer by the loader: 4 or 8 bits
    per layer, as the file has them. A float tensor among them is quantized to 8 bits."""

    name, bits, takes_blocks = "gguf", 8, True

    def process(self, layer: Linear) -> None:
        if not hasattr(layer, "bits"):
            raise ValueError(f"{layer}: the GGUF file gave this layer no weight")


METHODS: dict[str, type[QuantizedMethod]] = {"int8": Int8Method, "int4": Int4Method}
