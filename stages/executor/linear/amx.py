"""bf16 weights for AMX tiles (csrc/amx_linear.cpp), in the executor process: the bf16
forward's products on a CPU with AMX-BF16, in place of oneDNN's packed ones; and the same
layout on AVX512-BF16 (csrc/bf16_vector.cpp) where a CPU lacks the tiles (AMD Zen 4 and 5).

oneDNN's packed product and AMX's here run on the same tiles; the difference is how the
weights stream. A decode step reads
every weight once, and oneDNN's packed product does so at 14-16 GB/s at one token and 8-10
GB/s at 64 on the 2-core test machine (whose memory gives ~20); here each thread reads one
contiguous run of 2 KB chunks, the next panel prefetched as it goes, which keeps the products
near the memory's speed from 1 to 64 tokens (docs/BENCHMARKS.md, "AMX products").

The layout (the kernel's header says it whole): panels of 32 output columns, each K / 32
chunks of two 1 KB B tiles in AMX's pair layout. N is padded to a panel with zero columns,
which the kernel never writes out; K must be a multiple of 32 (every model we load has
that), and a layer whose K is not gets oneDNN's packed weights instead.

An MLP's gate/up layer has its rows interleaved 16 by 16 (gate, up, gate, ...) so that each
panel holds 16 gate and the matching 16 up columns: the kernel then writes silu(gate) * up
straight from its float32 tiles (`gated_forward`), and neither the [T, 2I] product nor a
separate silu_and_mul pass goes through memory.
"""

from __future__ import annotations

import torch

from stages.executor import kernels
from stages.executor.linear.base import Linear, LinearMethod, over_rows
from stages.executor.linear.onednn import OneDnnPackedMethod

PANEL = 32  # output columns a panel
CHUNK = 32  # inputs a chunk
GATE_BLOCK = 16  # gate (then up) columns a panel of a fused gate/up product


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[2I, ...] rows gate 0..I-1 then up 0..I-1 -> blocks of 16: gate 0..15, up 0..15,
    gate 16..31, ... (I a multiple of 16), so a panel holds one block of each."""
    half = w.shape[0] // 2
    blocks = w.view(2, half // GATE_BLOCK, GATE_BLOCK, *w.shape[1:]).transpose(0, 1)
    return blocks.reshape(w.shape)


def pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K a multiple of 32) -> uint8 [ceil(N / 32), K / 32 * 2048]: per panel,
    per chunk of 32 inputs, the two 16-column halves, each 16 pairs of inputs x 16 columns
    x 2."""
    n, k = w.shape
    if k % CHUNK:
        raise ValueError(f"amx pack: {k} inputs, not a multiple of {CHUNK}")
    padded = -(-n // PANEL) * PANEL
    w = torch.nn.functional.pad(w.to(torch.bfloat16), (0, 0, 0, padded - n))
    # [panel, half, column, chunk, pair, 2] -> [panel, chunk, half, pair, column, 2]
    tiles = w.view(padded // PANEL, 2, 16, k // CHUNK, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.contiguous().view(torch.uint8).view(padded // PANEL, -1)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bf16 [N, K] weight `pack` made `packed` from (tests)."""
    panels = packed.shape[0]
    k = packed.shape[1] // 64
    tiles = packed.view(torch.bfloat16).view(panels, k // CHUNK, 2, 16, 16, 2)
    return tiles.permute(0, 2, 4, 1, 3, 5).reshape(panels * PANEL, k)[:n]


def kernel_missing() -> str | None:
    """Why amx_linear cannot run here (None: it can)."""
    return kernels.op_missing("amx_linear_available",
                              "this CPU (or its kernel) gives no AMX-BF16 tiles")


class AmxMethod(LinearMethod):
    name = "amx-bf16"
    instructions = "AMX-BF16"  # what the form runs on (its refusals name it)

    @staticmethod
    def kernel_missing() -> str | None:
        return kernel_missing()

    @classmethod
    def unsupported(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"{cls.instructions} is a CPU's, not {device.type}'s"
        if dtype != torch.bfloat16:
            return f"{cls.instructions} multiplies bfloat16, not {dtype}"
        return cls.kernel_missing()

    def process(self, layer: Linear) -> None:
        """The packed copy replaces the plain weight (a tied head's plain matrix stays the
        embedding's); the bias becomes float32, as the kernel adds it. A layer whose inputs
        are not a multiple of 32 takes oneDNN's packed weights."""
        if layer.in_features % CHUNK:
            OneDnnPackedMethod.take(layer)
            return
        weight = layer.weight.detach()
        bias = layer.bias.detach().float() if layer.bias is not None else None
        layer.fused_gate = layer.gated and layer.out_features % (2 * GATE_BLOCK) == 0
        if layer.fused_gate:  # panels of 16 gate and 16 up columns: silu in the product's pass
            weight = interleave_gate_up(weight)
            bias = interleave_gate_up(bias) if bias is not None else None
        packed = pack(weight)
        del layer.weight
        layer.register_buffer("amx_weight", packed)
        layer.register_buffer("bias_f32", bias.contiguous() if bias is not None else None)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.fused_gate:
            raise RuntimeError(f"{layer}: its gate and up columns are interleaved; "
                               "call gated_forward")
        return self._run(layer, x, False)

    def fused_product(self, layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return self._run(layer, x, gated)

    @staticmethod
    def _run(layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return over_rows(x, lambda rows: torch.ops.llm_cpu.amx_linear(
            rows, layer.amx_weight, layer.bias_f32, layer.out_features, gated))


def vector_kernel_missing() -> str | None:
    """Why bf16_vector_linear cannot run here (None: it can)."""
    return kernels.op_missing("bf16_vector_available", "this CPU (or its compiler) lacks "
                              "AVX512-BF16")


class VectorBf16Method(AmxMethod):
    """AmxMethod's layout and fused gate on AVX512-BF16 (csrc/bf16_vector.cpp), for a CPU
    without AMX: there oneDNN's packed bf16 product reads its weights at ~0.7x the host's
    bandwidth at one row, this at ~0.9x (docs/BENCHMARKS.md, "bf16 products without AMX")."""

    name = "avx512-bf16"
    instructions = "AVX512-BF16"

    @staticmethod
    def kernel_missing() -> str | None:
        return vector_kernel_missing()

    @staticmethod
    def _run(layer: Linear, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return over_rows(x, lambda rows: torch.ops.llm_cpu.bf16_vector_linear(
            rows, layer.amx_weight, layer.bias_f32, layer.out_features, gated))


def packed_method() -> type[AmxMethod] | None:
    """The packed bf16 form this CPU runs: AMX's tiles, else AVX512-BF16, else none."""
    for method in (AmxMethod, VectorBf16Method):
        if method.unsupported(torch.bfloat16, torch.device("cpu")) is None:
            return method
    return None
