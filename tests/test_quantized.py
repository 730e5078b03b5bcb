"""Quantized weights (stages/executor/linear/quantized.py, csrc/quant_kernels.cpp): the blocks
hold what they should, the kernel computes what its PyTorch reference does for every format,
odd shape and dtype, bad inputs and unsupported setups are refused by name, and a quantized
model answers through the engine cores close to its float32 self."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from threads import at_thread_counts

from ipc.config import QUANTIZATIONS, ExecutorConfig
from ipc.errors import ConfigError
from stages.executor import preflight
from stages.executor.linear.quantized import (
    BLOCK,
    METHODS,
    join_rows,
    kernel_missing,
    quantize_blocks,
    quantize_int4,
    quantize_int8,
    reference_linear,
    tile_layout,
    widen,
)
from stages.executor.linear.select import select_linear_method

needs_kernel = pytest.mark.skipif(kernel_missing() is not None,
                                  reason=f"quantized kernels: {kernel_missing()}")
QUANTIZE = {8: quantize_int8, 5: lambda w: quantize_blocks(w, 5), 4: quantize_int4}


def test_the_formats_are_the_configs() -> None:
    assert tuple(METHODS) == QUANTIZATIONS


@pytest.mark.parametrize("bits", [8, 5, 4])
def test_blocks_round_each_weight_to_within_half_a_step(bits: int) -> None:
    w = torch.randn(5, 100) * torch.logspace(-3, 1, 100)  # blocks of very different scales
    q = QUANTIZE[bits](w)
    kp = 128  # 100 padded to a pair of blocks
    per_pair = {8: 64, 5: 40, 4: 32}[bits]
    assert q.codes.shape == (5, kp // 64 * per_pair) and q.d.shape == (5, kp // BLOCK)
    step = q.d.float().repeat_interleave(BLOCK, dim=1)[:, :100]
    # half a step, plus fp16's rounding of the block's scale times the code and of its minimum
    slack = (step * 2 ** bits + q.mn.float().abs().repeat_interleave(BLOCK, 1)[:, :100]) * 2 ** -11
    assert ((q.dequantize() - w).abs() <= step / 2 + slack + 1e-12).all()


def test_a_zero_block_and_exact_int4_grids_are_exact() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.arange(32).remainder(16).float() * 0.5 - 1.0  # a Q4_1 grid: min -1, d 0.5
    for bits in (8, 5, 4):
        assert torch.equal(QUANTIZE[bits](w).dequantize()[0], w[0])
    assert torch.equal(quantize_int4(w).dequantize(), w)


def test_parts_of_other_bits_join_at_the_widest_holding_the_same_values() -> None:
    """q, k and v of a GGUF file may come in 4, 5 and 8 bits: each part widens exactly."""
    gen = torch.Generator().manual_seed(3)
    parts = {bits: QUANTIZE[bits](torch.randn(3 + bits, 100, generator=gen))
             for bits in (4, 5, 8)}
    for bits, narrow in parts.items():
        for wider in (b for b in (4, 5, 8) if b >= bits):
            assert torch.equal(widen(narrow, wider).dequantize(), narrow.dequantize())
        if bits > 4:
            with pytest.raises(ValueError, match="do not fit"):
                widen(narrow, 4)
    for group, want in (((4, 5), 5), ((4, 4), 4), ((5, 8, 4), 8)):
        joined = join_rows([parts[b] for b in group])
        assert joined.bits == want
        assert torch.equal(joined.dequantize(),
                           torch.cat([parts[b].dequantize() for b in group]))


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 6, 40])
def test_any_number_of_threads_gives_the_same_bits(bits: int, m: int) -> None:
    """The threads take their tiles a chunk at a time and then another's last chunks
    (csrc/work_queue.h); each tile is computed whole by one thread, so the result cannot
    depend on how many ran or who took what, and a tile left out would show."""
    gen = torch.Generator().manual_seed(m + bits)
    n, k = 1003, 576  # 251 tiles of 4 rows, the last ragged: uneven runs and chunks
    q = QUANTIZE[bits](torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    tiles = tile_layout(q)
    results = at_thread_counts(lambda: torch.ops.llm_cpu.quantized_linear(x, tiles, bias, bits, n))
    want = reference_linear(x, q, bias)
    assert (results[0].float() - want).abs().max() <= 1e-2 * want.abs().max()
    for y in results[1:]:
        assert torch.equal(y, results[0])


@needs_kernel
@pytest.mark.parametrize("bits", [8, 5, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(7, 576), (13, 1536), (5, 960), (33, 100)])
def test_the_kernel_computes_its_reference(bits: int, dtype: torch.dtype, n: int,
                                           k: int) -> None:
    """Every token count through the 4-token tiles (1..9), rows past a tile of 4, K padded to
    64, a bias or none. float32 agrees to ~1e-4 of the largest output: the activations are
    quantized to ~16 bits in both, the sums run in another order; bf16 outputs round."""
    gen = torch.Generator().manual_seed(n * k + bits)
    w = torch.randn(n, k, generator=gen)
    q = QUANTIZE[bits](w)
    for m in range(1, 10):
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen) if m % 2 else None
        y = torch.ops.llm_cpu.quantized_linear(x, tile_layout(q), bias, bits, n)
        assert y.dtype == dtype and y.shape == (m, n)
        want = reference_linear(x, q, bias)
        exact = x.float() @ q.dequantize().T + (0 if bias is None else bias)
        scale = want.abs().max()
        tol = 3e-4 if dtype == torch.float32 else 1e-2
        assert (y.float() - want).abs().max() <= tol * scale, (m, bias is None)
        assert (y.float() - exact).abs().max() <= tol * scale  # the activations' rounding


@needs_kernel
def test_bad_inputs_are_refused_with_the_reason() -> None:
    q = quantize_int8(torch.randn(6, 64))
    t = tile_layout(q)  # 2 tiles of 288 bytes (one pair)
    x = torch.randn(2, 64)
    op = torch.ops.llm_cpu.quantized_linear
    cases = [((x, t, None, 6, 6), "bits must be 8, 5 or 4"),
             ((x, t, None, 4, 6), "not a whole number of 160-byte pairs"),
             ((x, t, None, 8, 9), "2 tiles of 4 rows for 9 outputs"),
             ((torch.randn(2, 200), t, None, 8, 6), "columns"),
             ((x.half(), t, None, 8, 6), "float32 or bfloat16"),
             ((x, t.view(torch.int8), None, 8, 6), "uint8"),
             ((x, t, torch.randn(3), 8, 6), "bias"),
             ((x.t(), t, None, 8, 6), "contiguous")]
    for args, why in cases:
        with pytest.raises(RuntimeError, match=why):
            op(*args)


def test_unsupported_setups_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        select_linear_method(torch.float32, torch.device("cuda"), False, quantization="int8")
    with pytest.raises(ValueError, match="leave out --compile"):
        select_linear_method(torch.float32, torch.device("cpu"), True, quantization="int4")
    with pytest.raises(ValueError, match="the formats are int8, int4"):
        select_linear_method(torch.float32, torch.device("cpu"), False, quantization="fp8")
    with pytest.raises(ConfigError, match="--quantization must be one of int8, int4"):
        ExecutorConfig(quantization="q4_k")
    with pytest.raises(ConfigError, match="needs a model"):
        ExecutorConfig.for_device("timed:1,0", quantization="int8")
    with pytest.raises(ConfigError, match="CPU only"):
        preflight.check_quantization("int8", "cuda:0", False)
    with pytest.raises(ConfigError, match="--compile"):
        preflight.check_quantization("int8", "cpu", True)
    monkeypatch.setattr(preflight, "cpu_flags", lambda: {"avx2", "avx512f", "avx512bw"})
    with pytest.raises(ConfigError, match="lacks AVX-512 with VNNI.*--dtype bfloat16"):
        preflight.check_quantization("int4", "cpu", False)


def _dequantized_copy(model_dir: Path, out: Path, bits: int) -> Path:
    """The model with each projection's weight replaced by what its blocks hold (the head by
    its int8 blocks' values, untied): a float32 model that a quantized run should reproduce
    up to the activations' rounding."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = QUANTIZE[bits](w).dequantize().contiguous()
    config = json.loads((out / "config.json").read_text())
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    weights["lm_head.weight"] = quantize_int8(head).dequantize().contiguous()
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    save_file(weights, out / "model.safetensors")
    return out


@needs_kernel
@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_a_quantized_model_is_its_dequantized_weights(tiny_model_dir: Path, tmp_path: Path,
                                                      name: str) -> None:
    """Through the scheduler and executor cores, a quantized run gives the greedy tokens of
    float32 on the weights its blocks hold, and prompt log-probs within 3e-3 of them (the
    activations' ~16-bit rounding): every projection, the head and the padding are right.
    The layers hold blocks in place of weights; int4 keeps the head at int8."""
    from ipc.messages import SamplingParams
    from stages.inprocess import InProcessEngine

    bits = METHODS[name].bits
    floats = _dequantized_copy(tiny_model_dir, tmp_path / "dequantized", bits)
    prompts = [[1, 5, 9, 14, 3, 7], [2, 8, 8, 8], [11, 4, 6, 2, 9, 10, 12, 1, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    quantized = InProcessEngine(str(tiny_model_dir), quantization=name)
    layer = quantized.runner.model.model.layers[0].mlp.down_proj
    assert not hasattr(layer, "weight") and layer.tiles.dtype == torch.uint8
    assert layer.method.name == name and quantized.runner.model.lm_head.method.name == "int8"
    got, want = quantized.run(requests), InProcessEngine(str(floats)).run(requests)
    for key, result in want.items():
        assert got[key].token_ids == result.token_ids, key
        deltas = [abs(a.logprob - b.logprob) for a, b in
                  zip(got[key].prompt_logprobs[1:], result.prompt_logprobs[1:], strict=True)]
        assert max(deltas) < 3e-3, (key, max(deltas))
