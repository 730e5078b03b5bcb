"""The forward backends behind one interface (stages/executor/backends): the selector's choices,
reasons and refusals; each backend's own host inputs; the same mixed step through every
backend's host_inputs -> pack -> metadata -> attend gives the same attention and the same
cache writes; the linear methods agree."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from kernel_marks import needs_kernels

from ipc.config import EngineLimits
from ipc.errors import ConfigError
from stages.executor import kernels
from stages.executor.backends.base import ForwardTables, LayerAttention, StepRows
from stages.executor.backends.select import ForwardRequest, select_backend
from stages.executor.models.base import rope_tables
from stages.executor.staging import StagingLayout

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, SEQS = 4, 2, 16, 4, 40, 4
LIMITS = EngineLimits(SEQS, 64, BLOCK, 64, 100)


def test_the_selector_says_which_forward_and_why() -> None:
    def pick(device: str, **kw: object) -> tuple[str, str]:
        s = select_backend(ForwardRequest(device, **kw), probe=False)  # type: ignore[arg-type]
        return s.backend, s.reason

    assert pick("cpu") == ("cpu_kernels", "eager, the default on the cpu: the CPU kernels "
                                          "(not yet loaded)")
    assert pick("cpu", cpu_kernels=False)[0] == "torch"
    assert pick("cuda")[0] == "flex"
    backend, why = pick("cuda", block_size=8)
    assert backend == "torch" and "multiple of 16" in why
    assert pick("cpu", compile=True, tensor_parallel_size=2)[0] == "flex"  # (tested live)
    with pytest.raises(ConfigError, match="tensor parallelism is tested on the CPU only"):
        pick("cuda", compile=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="CPU kernels serve the eager forward on the CPU only"):
        pick("cuda", cpu_kernels=True)
    with pytest.raises(ConfigError, match="CPU kernels serve the eager forward"):
        pick("cpu", compile=True, cpu_kernels=True)


def test_kernels_switched_off_fall_back_to_pytorch_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")
    chosen = select_backend(ForwardRequest("cpu"))
    assert chosen.backend == "torch" and f"{kernels.ENV}=0" in chosen.reason
    with pytest.raises(RuntimeError, match=f"{kernels.ENV}=0"):
        select_backend(ForwardRequest("cpu", cpu_kernels=True))


def test_the_launchers_preflight_imports_no_torch() -> None:
    code = ("import sys\n"
            "from stages.executor.backends.select import ForwardRequest, select_backend\n"
            "import stages.executor.preflight\n"
            "print(select_backend(ForwardRequest('cpu', True), probe=False).backend)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "flex"


# (context length after the step, query tokens): decodes, a prompt, a chunk with past.
ROWS = [(9, 1), (5, 5), (13, 6), (17, 1)]


# The sliding windows of the step's model: within a page, and across pages
WINDOWS = (3, 6)


def _step(backend_name: str, window: int | None, softcap: float | None = None,
          sinks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One mixed step through `backend_name`'s whole interface, for a model whose layers
    have WINDOWS, attending as a layer with `window` (and `softcap`, and `sinks`: a logit
    per head) does: its output and its cache."""
    from stages.executor.backends.select import Selection

    gen = torch.Generator().manual_seed(0)
    backend = Selection(backend_name, "test").load()(LIMITS, torch.device("cpu"), WINDOWS)
    q_lens = np.array([q for _, q in ROWS])
    ctx = np.array([c for c, _ in ROWS])
    slots = np.arange(len(ROWS))
    starts = np.cumsum(q_lens) - q_lens
    positions = np.concatenate([np.arange(c - q, c) for c, q in ROWS])
    forward = {"input_ids": np.zeros(len(positions), np.int64), "positions": positions,
               "token_slots": np.repeat(slots, q_lens)}
    host = backend.host_inputs(StepRows(q_lens, ctx, slots, starts, forward))
    assert set(host.arrays) - set(forward) == set(backend.staging_fields.names())
    layout = StagingLayout(backend.staging_fields)
    arrays = {f.name: np.zeros(0, np.int64) for f in layout.fields}
    arrays.update(forward)
    arrays.update(host.arrays)
    staging = np.zeros(layout.nbytes(LIMITS), np.uint8)
    counts, nbytes = layout.pack(arrays, staging)
    v = layout.unpack(torch.from_numpy(staging[:nbytes]), counts)
    table = torch.arange((SEQS + 1) * 16, dtype=torch.int32).view(SEQS + 1, 16) % NUM_BLOCKS
    table[SEQS] = NUM_BLOCKS - 1  # the padding slot's scratch block
    cos, sin = rope_tables({"rope_theta": 10000.0}, HEAD_DIM, 64)
    backend.bind(ForwardTables([table], [(cos, sin)], NUM_BLOCKS))
    meta = backend.metadata(v, host.plan)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    n, pad = len(positions), len(v.positions) - len(positions)  # (the compiled one pads)
    q, k, val = (torch.cat([torch.randn(n, heads, HEAD_DIM, generator=gen),
                            torch.zeros(pad, heads, HEAD_DIM)])
                 for heads in (HEADS, KV_HEADS, KV_HEADS))
    # The compiled backend runs under torch.compile, as its layers do (eager FlexAttention
    # reads the mask function alone, not the block mask's pages).
    attend = (torch.compile(backend.attend, dynamic=False, fullgraph=True) if backend.compiled
              else backend.attend)
    layer = LayerAttention(HEAD_DIM ** -0.5, window, softcap, sinks=sinks)
    head_sinks = torch.randn(HEADS, generator=gen) if sinks else None
    with torch.inference_mode():
        out = attend(q, k, val, cache, meta, layer, head_sinks)
    return out[:n], cache


@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("name", [
    "flex", pytest.param("cpu_kernels", marks=needs_kernels)])
def test_every_backend_attends_alike_through_the_interface(name: str,
                                                           window: int | None) -> None:
    """Against the eager PyTorch backend: rope inside attend, the cache write, attention
    over past and present keys, without a window and with each window of the model (the
    step's decodes and chunk with past outgrow them)."""
    want, want_cache = _step("torch", window)
    got, got_cache = _step(name, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    real = slice(0, NUM_BLOCKS - 1)  # (the compiled backend's padding writes the scratch)
    torch.testing.assert_close(got_cache[:, real], want_cache[:, real], atol=1e-6, rtol=1e-6)




@pytest.mark.parametrize("name, softcap, sinks", [
    ("flex", 0.5, False),  # (the compiled forward refuses sinks: no LSE from its CPU kernel)
    pytest.param("cpu_kernels", 0.5, False, marks=needs_kernels),
    pytest.param("cpu_kernels", None, True, marks=needs_kernels),
    pytest.param("cpu_kernels", 0.5, True, marks=needs_kernels)])
def test_softcaps_and_sinks_attend_alike_on_every_backend(name: str, softcap: float | None,
                                                          sinks: bool) -> None:
    """Gemma 2's softcapped scores and gpt-oss's sink logits (a windowed layer), against
    the eager PyTorch backend's explicit scores (a cap of 0.5 bends every score here)."""
    want, _ = _step("torch", WINDOWS[1], softcap, sinks)
    got, _ = _step(name, WINDOWS[1], softcap, sinks)
    plain, _ = _step("torch", WINDOWS[1])
    assert not torch.allclose(want, plain, atol=1e-3)  # (they change the output)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_linear_methods_agree_and_refuse_by_name() -> None:
    from stages.executor.linear.base import Linear, process_weights
    from stages.executor.linear.dense import DenseMethod
    from stages.executor.linear.onednn import OneDnnPackedMethod, can_pack
    from stages.executor.linear.select import select_linear_method

    cpu = torch.device("cpu")
    assert isinstance(select_linear_method(torch.float32, cpu, compiled=True), DenseMethod)
    assert isinstance(select_linear_method(torch.float32, cpu, False, pack=False), DenseMethod)
    with pytest.raises(ValueError, match="packed weights: oneDNN packs weights on the CPU only"):
        select_linear_method(torch.float32, torch.device("cuda"), False, pack=True)
    if not can_pack(torch.float32):
        pytest.skip("oneDNN cannot pack float32 here")
    gen = torch.Generator().manual_seed(2)
    layers = [Linear(24, 40, True, method) for method in (DenseMethod(), OneDnnPackedMethod())]
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    for layer in layers:
        layer.load_state_dict({"weight": weight, "bias": bias})
        assert process_weights(layer) == 1
    assert not hasattr(layers[1], "weight") and hasattr(layers[1], "packed_weight")
    x = torch.randn(7, 24, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(layers[1](x), layers[0](x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layers[0](x), x @ weight.T + bias)
