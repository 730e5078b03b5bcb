"""Quantized products widened on AMX tiles (csrc/amx_linear.cpp's amx_quantized_linear,
stages/executor/linear/quantized.py's panel layout): every code width against a float
reference, odd shapes, row counts around the tiles' edges, one and two threads; a row's
result whatever rows share the call; the gated form; the form's choice per model at load;
and through an engine, the fused layers' bits and a batch's tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ipc.messages import SamplingParams
from stages.executor.linear import amx
from stages.executor.linear.base import Linear
from stages.executor.linear.quantized import (
    AMX_ROWS,
    Int4Method,
    Int8Method,
    QuantizedMethod,
    interleave_rows,
    kernel_missing,
    panel_layout,
    products_for,
    quantize_blocks,
    reference_widened,
    set_weight,
)

pytestmark = pytest.mark.skipif(
    amx.kernel_missing() is not None or kernel_missing() is not None,
    reason=f"AMX tiles and the quantized kernels: {amx.kernel_missing() or kernel_missing()}")

ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 100, 300]


def product(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, bits: int,
            n: int, gated: bool = False) -> torch.Tensor:
    return torch.ops.llm_cpu.amx_quantized_linear(x, panels, bias, bits, n, gated)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [8, 5, 4])
@pytest.mark.parametrize("n,k", [(40, 32), (96, 96), (200, 576), (33, 1536)])
def test_every_width_against_the_widened_reference(threads: int, bits: int, n: int,
                                                   k: int) -> None:
    """y = x W^T + b with W the blocks widened to bf16: within the bf16 output's rounding
    (AMX sums each row in its own order), for every row count of ROWS; N not a multiple of
    the 32-wide panels, K of one chunk to 48."""
    torch.manual_seed(bits * 1000 + n + k)
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]  # (rows of unlike scales)
    q = quantize_blocks(w, bits)
    panels, bias = panel_layout(q), torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        y = product(x, panels, bias, bits, n)
        want = reference_widened(x, q, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        scale = want.abs().amax(dim=1, keepdim=True) + 1e-3
        assert ((y.float() - want).abs() / scale).max() < 1.6e-2, m


@pytest.mark.parametrize("bits", [8, 5, 4])
def test_a_rows_result_is_the_same_whatever_rows_share_the_call(bits: int) -> None:
    """Each row of a call of 1, 17, 32 (a decode step's path) or 300 rows (a prompt's slabs,
    widened a group of panels at a time) is the same bits as that row alone."""
    torch.manual_seed(bits)
    n, k = 136, 320
    q = quantize_blocks(torch.randn(n, k) * 0.1, bits)
    panels, bias = panel_layout(q), torch.randn(n)
    x = torch.randn(300, k).bfloat16()
    alone = torch.cat([product(x[i:i + 1].contiguous(), panels, bias, bits, n)
                       for i in range(300)])
    for m in (17, 32, 300):
        assert torch.equal(product(x[:m].contiguous(), panels, bias, bits, n), alone[:m]), m


@pytest.mark.parametrize("m", [1, 32, 70])
def test_the_gated_form_writes_silu_of_gate_times_up(m: int) -> None:
    """With gate/up rows interleaved 16 at a time, gated=True gives silu(gate) * up of the
    ungated product's columns, each half in its place."""
    torch.manual_seed(m)
    inter, k = 64, 96
    q = interleave_rows(quantize_blocks(torch.randn(2 * inter, k) * 0.2, 4))
    bias = amx.interleave_gate_up(torch.randn(2 * inter)).contiguous()
    panels = panel_layout(q)
    x = torch.randn(m, k).bfloat16()
    plain = product(x, panels, bias, 4, 2 * inter).float()
    blocks = plain.view(m, -1, 2, 16)  # [m, panel, gate/up, 16]
    gate, up = blocks[:, :, 0].reshape(m, -1), blocks[:, :, 1].reshape(m, -1)
    gated = product(x, panels, bias, 4, 2 * inter, gated=True)
    assert gated.shape == (m, inter)
    want = torch.nn.functional.silu(gate) * up
    assert (gated.float() - want).abs().max() < 2e-2 * (want.abs().max() + 1)


def test_bad_arguments_are_refused() -> None:
    q = quantize_blocks(torch.randn(40, 64), 4)
    panels = panel_layout(q)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bits must be 8, 5 or 4, got 6"):
        product(x, panels, None, 6, 40)
    with pytest.raises(RuntimeError, match="a panel of 1280 bytes for 64 inputs"):
        product(x, panels, None, 8, 40)
    with pytest.raises(RuntimeError, match="2 panels of 32 for 80 outputs"):
        product(x, panels, None, 4, 80)
    with pytest.raises(RuntimeError, match="bf16 matrix"):
        product(x.float(), panels, None, 4, 40)
    with pytest.raises(RuntimeError, match="gated outputs come in panels"):
        product(x, panels, None, 4, 40, gated=True)
    with pytest.raises(ValueError, match="72 inputs, not a multiple of 32"):
        panel_layout(quantize_blocks(torch.randn(8, 72), 8))


def test_the_form_is_chosen_per_model_at_load() -> None:
    """AMX for bf16 activations where a step may hold AMX_ROWS rows; VNNI for float32 or
    fewer rows. A layer takes its method's form, except a routed expert (quantized_moe stacks
    the tiles) and inputs that are not whole chunks; a SiLU gate/up layer runs gated."""
    assert products_for(torch.bfloat16, AMX_ROWS) == "amx"
    assert products_for(torch.bfloat16, AMX_ROWS - 1) == "vnni"
    assert products_for(torch.float32, 64) == "vnni"
    assert Int4Method("amx").for_head().products == "amx"
    with pytest.raises(ValueError, match="vnni or amx, not 'avx'"):
        Int8Method("avx")

    def layer(method: QuantizedMethod, n: int, k: int, gated: bool = False,
              expert: bool = False) -> Linear:
        out = Linear(k, n, True, method)
        out.gated, out.routed_expert = gated, expert
        with torch.no_grad():
            out.weight.normal_()
            out.bias.normal_()
        method.process(out)
        return out

    dense = layer(Int8Method("amx"), 64, 96, gated=True)
    assert dense.products == "amx" and dense.fused_gate and not hasattr(dense, "tiles")
    assert layer(Int8Method("amx"), 64, 96, expert=True).products == "vnni"
    assert layer(Int8Method("amx"), 64, 80).products == "vnni"  # (80 inputs)
    assert layer(Int8Method("vnni"), 64, 96).products == "vnni"
    plain = layer(Int4Method("amx"), 40, 64)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(plain(x), product(x, plain.panels, plain.bias_f32, 4, 40))
    with pytest.raises(RuntimeError, match="call gated_forward"):
        dense(torch.randn(3, 96).bfloat16())
    with pytest.raises(ValueError, match="a \\[40, 64\\] quantized weight for a \\[40, 32\\]"):
        set_weight(Linear(32, 40, False, Int8Method("amx")),
                   quantize_blocks(torch.randn(40, 64), 8))


def test_the_choice_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="stages.executor.linear.quantized"):
        products_for(torch.bfloat16, 8)
        products_for(torch.float32, 8)
        products_for(torch.bfloat16, 1)
    assert "widened to bf16 on AMX tiles (steps of up to 8 rows)" in caplog.text
    assert "integer dot products (torch.float32 activations)" in caplog.text
    assert f"(steps of at most 1 rows (max_num_seqs < {AMX_ROWS}))" in caplog.text


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_an_engine_gives_a_prompts_tokens_alone_or_in_a_batch(tmp_path: Path,
                                                             quantization: str) -> None:
    """Through an engine (bf16, max_num_seqs 8: every quantized projection on AMX, the gate/up
    products gated, the fused decoder layers' kinds), each prompt's greedy tokens are the
    same run alone as among seven others, and prompt log-probs the same bits."""
    from pipeline.tools.random_model import build_random_llama
    from stages.inprocess import InProcessEngine

    folder = build_random_llama(tmp_path / "m", arch="llama")
    engine = InProcessEngine(str(folder), dtype=torch.bfloat16, quantization=quantization,
                             max_num_seqs=8)
    model = engine.runner.model
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.products == "amx" and mlp.gate_up_proj.fused_gate
    assert model.lm_head.products == "amx"
    assert engine.runner.model.fused_layers is not None
    prompts = [[3 + i, 17, 40 + 5 * i, 9, 250 - i] * (1 + i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0)
    together = engine.run([(str(i), p, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = engine.run([("a", p, params)])["a", 0]
        assert alone.token_ids == together[str(i), 0].token_ids, i
        assert ([x.logprob for x in alone.prompt_logprobs[1:]]
                == [x.logprob for x in together[str(i), 0].prompt_logprobs[1:]]), i
