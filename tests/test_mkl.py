"""float32 products on MKL's packed sgemm (stages/executor/linear/mkl.py, csrc/mkl_linear.cpp):
the product to within float32's rounding for every row count a step has and odd shapes, each
row's bits independent of the rows beside it and of the thread count (what batching and
speculative decoding's identity rest on), bad inputs refused by name, and the float32 forward
on the CPU kernels taking it, with the same greedy tokens as oneDNN's packed products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from threads import at_thread_counts

from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_llama
from stages.executor.linear import mkl
from stages.executor.linear.base import Linear
from stages.executor.linear.mkl import (
    MklPackedMethod,
    kernel_missing,
    one_row_threads,
    rows_independent,
)
from stages.executor.linear.onednn import OneDnnPackedMethod
from stages.executor.linear.select import select_linear_method
from stages.inprocess import InProcessEngine

pytestmark = pytest.mark.skipif(kernel_missing() is not None, reason=f"MKL: {kernel_missing()}")
CPU = torch.device("cpu")
SHAPES = [(2, 8), (37, 19), (100, 64), (960, 576), (576, 1536)]  # (N, K)
# What batching rests on, where MKL serves: on a CPU where its rows depend on the call,
# the products are oneDNN's (test_a_cpu_whose_rows_depend_on_the_call_gets_onednn).
rows_independent_here = pytest.mark.skipif(
    kernel_missing() is None and rows_independent() is not None,
    reason=f"MKL is not used on this CPU: {kernel_missing() or rows_independent()}")


def _product(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return w, b, torch.ops.llm_cpu.mkl_pack(w)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 300])
def test_the_kernel_is_the_product_within_float32_rounding(n: int, k: int, rows: int) -> None:
    for bias in (False, True):
        w, b, packed = _product(n, k, bias, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
        b_before = b.clone() if b is not None else None
        want = x.double() @ w.double().t() + (b.double() if b is not None else 0)
        # (a lone row: as two, or MKL's one-row path at the thread count running)
        for one_row in (0, torch.get_num_threads()):
            got = torch.ops.llm_cpu.mkl_linear(x, packed, b, n, one_row)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # each sum's rounding: K terms of float32 products, |terms| ~ sqrt(K)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=k * 2 ** -21)
        if b is not None:  # the bias is read, never written (C starts as a copy of it)
            assert torch.equal(b, b_before)


@rows_independent_here
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_bits_do_not_depend_on_its_neighbours_or_the_threads(n: int, k: int) -> None:
    """A row alone, any prefix of the rows and the whole call give the same bits, at 1, 2 and
    3 threads (one row alone took another path that rounds differently: run as two)."""
    w, b, packed = _product(n, k, True)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
    full = at_thread_counts(lambda: torch.ops.llm_cpu.mkl_linear(x, packed, b, n))
    assert all(torch.equal(full[0], other) for other in full[1:])
    for rows in (1, 2, 3, 7, 16, 17, 64, 65, 129):
        got = torch.ops.llm_cpu.mkl_linear(x[:rows].contiguous(), packed, b, n)
        assert torch.equal(got, full[0][:rows]), rows
    for i in range(0, 300, 23):
        assert torch.equal(torch.ops.llm_cpu.mkl_linear(x[i:i + 1].contiguous(), packed, b, n),
                           full[0][i:i + 1]), i


@rows_independent_here
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES + [(128, 64), (96, 576)])
def test_a_layer_takes_the_one_row_path_only_where_it_gives_the_same_bits(
        n: int, k: int, bias: bool) -> None:
    """The load-time check (one_row_threads, 4 probe rows) holds for other rows: a layer's
    lone row has the bits it has among 300, whichever path the check chose, and at another
    thread count (where the check did not run) a lone row runs as two."""
    layer = Linear(k, n, bias, MklPackedMethod())
    g = torch.Generator().manual_seed(n * k)
    layer.weight = torch.nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    layer.method.process(layer)
    assert layer.mkl_one_row in (0, torch.get_num_threads())
    x = torch.randn(300, k, generator=g)
    full = layer(x)
    for i in range(0, 300, 13):
        assert torch.equal(layer(x[i:i + 1]), full[i:i + 1]), (i, layer.mkl_one_row)
    if layer.mkl_one_row:  # (the one-row path itself, called directly, agrees)
        alone = torch.ops.llm_cpu.mkl_linear(x[:1], layer.mkl_weight, layer.bias, n,
                                             layer.mkl_one_row)
        assert torch.equal(alone, full[:1])
    for lone in at_thread_counts(lambda: layer(x[:1]), (1, 3)):
        assert torch.equal(lone, full[:1])


def test_the_default_models_projections_take_the_one_row_path() -> None:
    """What batch 1 in float32 runs: large outputs without a bias (on this kind of CPU; the
    check may say otherwise elsewhere, and a lone row then runs as two, still right)."""
    agreeing = []
    for n, k in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        _, _, packed = _product(n, k, False)
        agreeing.append(one_row_threads(packed, None, k, n) == torch.get_num_threads())
    if not any(agreeing):
        pytest.skip("MKL's one-row path rounds otherwise on this CPU")
    assert all(agreeing)


def test_a_cpu_whose_rows_depend_on_the_call_gets_onednn(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """MKL is refused, with the reason, where the probe finds a row's bits depending on its
    call, and the float32 products fall back to oneDNN's packed ones; the probe's refusal on
    this CPU, if any, is true."""
    cpu_kernels = (torch.float32, CPU, False)
    why = rows_independent()
    if why is None:
        assert isinstance(select_linear_method(*cpu_kernels, kernels=True), MklPackedMethod)
    else:  # (the row counts it names do differ from the whole call)
        n, k = (int(v) for v in why.split("(")[-1].split(")")[0].split(" x "))
        w, b, packed = _product(n, k, True)
        x = torch.randn(129, k, generator=torch.Generator().manual_seed(2))
        whole = torch.ops.llm_cpu.mkl_linear(x, packed, b, n)
        assert any(not torch.equal(torch.ops.llm_cpu.mkl_linear(x[:r], packed, b, n),
                                   whole[:r]) for r in (1, 2, 3, 7, 15)) or "1 thread" in why
    monkeypatch.setattr(mkl, "rows_independent", lambda: "rows differ (a test's CPU)")
    assert MklPackedMethod.unsupported(torch.float32, CPU) == "rows differ (a test's CPU)"
    assert isinstance(select_linear_method(*cpu_kernels, kernels=True), OneDnnPackedMethod)


def test_no_rows_give_an_empty_result() -> None:
    _, _, packed = _product(37, 19, False)
    assert torch.ops.llm_cpu.mkl_linear(torch.empty(0, 19), packed, None, 37).shape == (0, 37)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    w, b, packed = _product(37, 19, True)
    x = torch.randn(3, 19)
    with pytest.raises(RuntimeError, match="must be float32"):
        torch.ops.llm_cpu.mkl_pack(w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.llm_cpu.mkl_linear(x.double(), packed, b, 37)
    with pytest.raises(RuntimeError, match="is 37 x 19, not 370 x 19"):
        torch.ops.llm_cpu.mkl_linear(x, packed, None, 370)
    with pytest.raises(RuntimeError, match="is 37 x 19, not 37 x 20"):
        torch.ops.llm_cpu.mkl_linear(torch.randn(3, 20), packed, None, 37)
    with pytest.raises(RuntimeError, match="not mkl_pack's"):
        torch.ops.llm_cpu.mkl_linear(x, w, None, 37)
    with pytest.raises(RuntimeError, match="copied or moved since mkl_pack made it"):
        torch.ops.llm_cpu.mkl_linear(x, packed.clone(), None, 37)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[37\]"):
        torch.ops.llm_cpu.mkl_linear(x, packed, b[:5], 37)


def test_float32_on_the_cpu_kernels_takes_it_and_other_setups_do_not() -> None:
    """(Where it serves: test_a_cpu_whose_rows_depend_on_the_call_gets_onednn.)"""
    for dtype, compiled, kernels in ((torch.float32, False, False), (torch.float32, True, True),
                                     (torch.bfloat16, False, False)):
        assert not isinstance(select_linear_method(dtype, CPU, compiled, kernels=kernels),
                              MklPackedMethod)
    assert "float32, not torch.bfloat16" in MklPackedMethod.unsupported(torch.bfloat16, CPU)
    assert "not meta" in MklPackedMethod.unsupported(torch.float32, torch.device("meta"))


def test_a_layer_packs_and_one_output_takes_onednns_packing() -> None:
    layers = [Linear(24, n, True, MklPackedMethod()) for n in (40, 1)]
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn(layer.out_features, 24),
                                          requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.randn(layer.out_features), requires_grad=False)
    x = torch.randn(2, 3, 24)  # (leading dims as a model's: flattened and restored)
    expected = [torch.nn.functional.linear(x, lay.weight, lay.bias) for lay in layers]
    for layer in layers:
        layer.method.process(layer)
    assert layers[0].method.name == "mkl-packed" and not hasattr(layers[0], "weight")
    assert isinstance(layers[1].method, OneDnnPackedMethod)
    for layer, want in zip(layers, expected, strict=True):
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@rows_independent_here
def test_a_model_answers_as_with_onednns_products(tmp_path: Path) -> None:
    """The same random model in float32 on MKL's and on oneDNN's packed products: the same
    greedy tokens, prompt log-probs within float32's rounding."""
    folder = build_random_llama(tmp_path / "m", weight_std=0.05)
    engines = [InProcessEngine(str(folder), dtype=torch.float32, max_num_batched_tokens=16)
               for _ in range(2)]
    assert engines[0].runner.model.model.layers[0].mlp.down_proj.method.name == "mkl-packed"
    for layer in engines[1].runner.model.modules():  # oneDNN's packing of the same weights
        if isinstance(layer, Linear) and layer.method.name == "mkl-packed":
            layer.weight = torch.nn.Parameter(_unpacked(layer), requires_grad=False)
            del layer.mkl_weight
            layer.method = OneDnnPackedMethod()
            layer.method.process(layer)
    engines[1].runner.model.fused_layers = None  # (and the Python layers)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompts = [[1, 5, 9, 14, 3, 7], [2, 8, 8, 8, 4, 4, 1, 9, 9, 3, 2, 6, 7, 7, 1, 2, 3, 4, 5]]
    mkl, onednn = (e.run([(str(i), p, params) for i, p in enumerate(prompts)])
                   for e in engines)
    for key, result in mkl.items():
        assert result.token_ids == onednn[key].token_ids
        torch.testing.assert_close([lp.logprob for lp in result.prompt_logprobs[1:]],
                                   [lp.logprob for lp in onednn[key].prompt_logprobs[1:]],
                                   rtol=0, atol=1e-4)


def _unpacked(layer: Linear) -> torch.Tensor:
    """The float32 [N, K] weight packed in `layer.mkl_weight`: its product with the identity."""
    eye = torch.eye(layer.in_features)
    y = torch.ops.llm_cpu.mkl_linear(eye, layer.mkl_weight, None, layer.out_features)
    return y.t().contiguous()
