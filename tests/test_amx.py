"""bf16 products on AMX tiles (stages/executor/linear/amx.py, csrc/amx_linear.cpp) and, in the
same layout, on AVX512-BF16 (csrc/bf16_vector.cpp): the packed layout holds the weight, each
kernel computes x W^T + b to within bf16's rounding for every row count a step has (one row
pair, several, slabs of a long prompt, ragged ends) and odd output counts, with the same bits
at any number of threads and for a row whatever rows share the call, bad inputs are refused
by name, oneDNN's own AMX products still compute right beside it, and a model whose layers mix
it with oneDNN's packing gives the same bits in one call as in the Python layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from threads import at_thread_counts

from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_llama
from stages.executor.linear.amx import (
    AmxMethod,
    interleave_gate_up,
    kernel_missing,
    pack,
    packed_method,
    unpack,
    vector_kernel_missing,
)
from stages.executor.linear.base import Linear
from stages.executor.linear.onednn import OneDnnPackedMethod, can_pack
from stages.executor.linear.select import select_linear_method
from stages.inprocess import InProcessEngine

needs_amx = pytest.mark.skipif(kernel_missing() is not None, reason=f"AMX: {kernel_missing()}")
needs_vector = pytest.mark.skipif(vector_kernel_missing() is not None,
                                  reason=f"AVX512-BF16: {vector_kernel_missing()}")
# The packed bf16 method this CPU's forward takes (select.py), if any
PACKED = packed_method()
needs_packed = pytest.mark.skipif(PACKED is None, reason="neither AMX nor AVX512-BF16 here")


@pytest.fixture(params=[pytest.param("amx_linear", marks=needs_amx),
                        pytest.param("bf16_vector_linear", marks=needs_vector)])
def product(request: pytest.FixtureRequest) -> Any:
    """Each kernel of the packed layout this CPU runs."""
    return getattr(torch.ops.llm_cpu, request.param)


CPU = torch.device("cpu")
PROMPTS = [[1, 5, 9, 14, 3, 7], [2, 8, 8, 8, 4, 4, 1, 9, 9, 3, 2, 6, 7, 7, 1, 2, 3, 4, 5]]


def _answers(engine: InProcessEngine) -> dict:
    """Greedy tokens and prompt log-probs of PROMPTS (a 16-token budget: prefill chunks)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = engine.run([(str(i), p, params) for i, p in enumerate(PROMPTS)])
    return {key: (r.token_ids, [lp.logprob for lp in r.prompt_logprobs or []])
            for key, r in out.items()}


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


def _assert_rounded(y: torch.Tensor, exact: torch.Tensor, x: torch.Tensor,
                    w: torch.Tensor) -> None:
    """y is bf16 of the exact product: within half a bf16 step of it (2^-9 relative), plus
    float32 accumulation's error over K (a few ulps of the sum of |x| |w|)."""
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    magnitude = x.double().abs() @ w.double().abs().t()
    slack = exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20 + 1e-30
    assert ((y.double() - exact).abs() <= slack).all()


def test_the_layout_holds_the_weight_and_refuses_a_ragged_k() -> None:
    w = torch.randn(50, 96).to(torch.bfloat16)  # 50 outputs: a panel and a partial one
    packed = pack(w)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 96 // 32 * 2048)
    assert torch.equal(unpack(packed, 50), w)
    assert torch.equal(unpack(packed, 64)[50:], torch.zeros(14, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        pack(torch.randn(8, 40))


@pytest.mark.parametrize("n,k", [(50, 32), (96, 576), (960, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 100, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_product_rounded_once(product: Any, n: int, k: int, rows: int,
                                                with_bias: bool) -> None:
    # (1000 rows at K = 576: three slabs of 448 and a ragged last one; at K = 1536 seven)
    g = torch.Generator().manual_seed(n * 7 + rows)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = product(x, pack(w), bias, n)
    _assert_rounded(y, _reference(x, w, bias), x, w)


@pytest.mark.parametrize("rows", [1, 32, 100, 1000])
def test_any_number_of_threads_gives_the_same_bits(product: Any, rows: int) -> None:
    """The threads share the panels out as they go (csrc/work_queue.h: a decode step's from
    one queue, a prompt's from each thread's own run and then another's); each panel is
    computed whole by one thread, so the result cannot depend on how many ran or who took
    what, and a panel left out or computed into the wrong place would show."""
    g = torch.Generator().manual_seed(rows)
    n, k = 1496, 576  # 47 panels, the last ragged: uneven runs and chunks at any count
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    packed = pack(w)
    results = at_thread_counts(lambda: product(x, packed, bias, n))
    _assert_rounded(results[0], _reference(x, w, bias), x, w)
    for y in results[1:]:
        assert torch.equal(y, results[0])


@pytest.mark.parametrize("rows", [1, 17, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_it_is_silu_of_gate_times_up_rounded_once(product: Any, rows: int,
                                                       with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    inter, k = 48, 576  # three blocks of 16 gate and 16 up columns
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(2 * inter, generator=g) if with_bias else None
    packed = pack(interleave_gate_up(w))
    b = interleave_gate_up(bias) if bias is not None else None
    y = product(x, packed, b, 2 * inter, True)
    gate_up = _reference(x, w, bias)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    exact = torch.nn.functional.silu(gate) * up
    assert y.shape == (rows, inter) and y.dtype == torch.bfloat16
    magnitude = (x.double().abs() @ w.double().abs().t())
    slack = exact.abs() * 2.0 ** -8 + (magnitude[:, :inter] * up.abs()
                                       + magnitude[:, inter:] * gate.abs()) * 2.0 ** -19 + 1e-6
    assert ((y.double() - exact).abs() <= slack).all()
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        product(x, pack(w[:80]), None, 80 - 8, True)


@pytest.mark.parametrize("rows", [2, 3, 5, 9, 17, 40])
def test_a_rows_result_does_not_depend_on_the_others(product: Any, rows: int) -> None:
    """Each row alone gives the bits it gets among `rows` (every block shape: rows of 1 to 8
    and panels one or two at a time; 40: L2 groups): what the scheduler's batching identity
    needs of a product."""
    g = torch.Generator().manual_seed(rows)
    n, k = 200, 576
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    packed = pack(w)
    whole = product(x, packed, None, n)
    for i in range(rows):
        assert torch.equal(product(x[i:i + 1], packed, None, n)[0], whole[i])


def test_interleaving_puts_a_block_of_each_in_a_panel() -> None:
    w = torch.arange(64).float()[:, None].expand(64, 4)  # row i holds i: gate 0-31, up 32-63
    rows = interleave_gate_up(w)[:, 0].long().tolist()
    assert rows == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]


def test_no_rows_give_an_empty_result(product: Any) -> None:
    w = torch.randn(64, 64).to(torch.bfloat16)
    y = product(torch.empty(0, 64, dtype=torch.bfloat16), pack(w), None, 64)
    assert y.shape == (0, 64)


def test_bad_inputs_are_refused_with_the_reason(product: Any) -> None:
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed, x = pack(w), torch.randn(3, 64).to(torch.bfloat16)
    amx = product
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        amx(x.float(), packed, None, 64)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        amx(torch.randn(3, 40).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="bytes for 96 inputs"):
        amx(torch.randn(3, 96).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="panels of 32 for 100 outputs"):
        amx(x, packed, None, 100)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        amx(x, packed, torch.randn(64).to(torch.bfloat16), 64)


@needs_amx
@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_onednns_products_stay_right_beside_it() -> None:
    """oneDNN's bf16 products use the same tiles with palettes of their own: either kernel
    after the other (same threads) still computes its product."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 576, generator=g) * 0.05).to(torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    packed = pack(w)
    for rows in (1, 40, 300):
        x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
        exact = _reference(x, w, None)
        for _ in range(2):
            _assert_rounded(torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                            exact, x, w)
            _assert_rounded(torch.ops.llm_cpu.amx_linear(x, packed, None, 96), exact, x, w)


@needs_packed
def test_bf16_on_the_cpu_kernels_takes_it_and_other_setups_do_not() -> None:
    """AMX where the CPU has it, else AVX512-BF16; float32, the Python layers' forward and the
    compiled one take other formats."""
    assert PACKED is not None
    assert type(select_linear_method(torch.bfloat16, CPU, False, kernels=True)) is PACKED
    for other in (select_linear_method(torch.bfloat16, CPU, False, kernels=False),
                  select_linear_method(torch.float32, CPU, False, kernels=True),
                  select_linear_method(torch.bfloat16, CPU, True, kernels=True)):
        assert not isinstance(other, AmxMethod)  # (VectorBf16Method is one)
    assert "bfloat16, not torch.float32" in PACKED.unsupported(torch.float32, CPU)


@needs_packed
@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_a_layer_with_ragged_inputs_takes_onednns_packing() -> None:
    assert PACKED is not None
    layers = [Linear(k, 40, True, PACKED()) for k in (64, 24)]
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn(40, layer.in_features).to(torch.bfloat16),
                                          requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.randn(40).to(torch.bfloat16), requires_grad=False)
    expected = [torch.nn.functional.linear(torch.ones(3, lay.in_features, dtype=torch.bfloat16),
                                           lay.weight, lay.bias) for lay in layers]
    for layer in layers:
        layer.method.process(layer)
    assert layers[0].method.name == PACKED.name and not hasattr(layers[0], "weight")
    assert isinstance(layers[1].method, OneDnnPackedMethod)
    for layer, want in zip(layers, expected, strict=True):
        got = layer(torch.ones(3, layer.in_features, dtype=torch.bfloat16))
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)


@needs_packed
@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN cannot pack bf16 here")
def test_a_model_mixing_both_gives_the_same_bits_in_one_call(tmp_path: Path) -> None:
    """An MLP 100 wide: its down projection (100 inputs) is oneDNN's, the rest AMX's; the
    fused layers and the Python layers agree to the bit (greedy tokens, prompt log-probs)."""
    assert PACKED is not None
    folder = build_random_llama(tmp_path / "m", intermediate=100)
    engines = [InProcessEngine(str(folder), dtype=torch.bfloat16, max_num_batched_tokens=16)
               for _ in range(2)]
    mlp = engines[0].runner.model.model.layers[0].mlp
    assert (mlp.gate_up_proj.method.name, mlp.down_proj.method.name) == (PACKED.name,
                                                                           "onednn-packed")
    assert not mlp.gate_up_proj.fused_gate  # (100 gate rows: not whole blocks of 16)
    assert engines[0].runner.model.fused_layers is not None
    engines[1].runner.model.fused_layers = None
    results = [_answers(engine) for engine in engines]
    assert results[0] == results[1]


@needs_packed
def test_a_fused_gate_model_gives_the_same_bits_in_one_call_and_answers_as_unfused(
        tmp_path: Path) -> None:
    """gate/up with silu in the product's pass (an MLP 96 wide): the fused layers and the
    Python layers agree to the bit, and greedy tokens agree with the separate silu pass."""
    folder = build_random_llama(tmp_path / "m", intermediate=96, weight_std=0.05)
    engines = [InProcessEngine(str(folder), dtype=torch.bfloat16, max_num_batched_tokens=16)
               for _ in range(3)]
    gate_up = engines[0].runner.model.model.layers[0].mlp.gate_up_proj
    assert gate_up.fused_gate
    with pytest.raises(RuntimeError, match="call gated_forward"):
        gate_up(torch.ones(1, 64, dtype=torch.bfloat16))
    engines[1].runner.model.fused_layers = None
    for layer in engines[2].runner.model.model.layers:  # the separate pass, same weights
        mlp = layer.mlp.gate_up_proj
        mlp.fused_gate = False
        interleaved = unpack(mlp.amx_weight, mlp.out_features)  # back to gate rows, up rows
        mlp.amx_weight = pack(interleaved.view(-1, 2, 16, 64).transpose(0, 1).reshape(-1, 64))
    engines[2].runner.model.fused_layers = None
    results = [_answers(engine) for engine in engines]
    assert results[0] == results[1]
    for key, (tokens, logprobs) in results[2].items():
        assert tokens == results[0][key][0]
        fused = results[0][key][1]  # (the first prompt token has no log-prob)
        assert max(abs(a - b) for a, b in zip(logprobs[1:], fused[1:], strict=True)) < 0.1
