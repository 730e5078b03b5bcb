"""The KV cache's 8-bit formats (stages/executor/kv_pool.py, csrc/kv_formats.h): the CPU kernel
quantizes this step's keys and values as it writes them (a round trip within the format's
step), and attends over pages widened from the format exactly as over a float32 cache holding
the same values, in every form of the kernel, head size, page size and window; the pool's
arithmetic; the refusals."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import needs_kernels

from ipc.config import ExecutorConfig
from ipc.errors import ConfigError
from stages.executor.backends.base import LayerAttention, rotate_half
from stages.executor.backends.cpu_kernels import KernelMetadata, kernel_paged_attention
from stages.executor.backends.select import ForwardRequest, select_backend
from stages.executor.backends.torch_sdpa import paged_attention
from stages.executor.kv_pool import FORMATS, KVPool, KVShape, kv_format
from tests.test_cpu_kernels import LONG_ROWS, TOLERANCE, _rope_tables, _step

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# A value's largest rounding error in the format: half its mantissa's step, relative, and half
# the smallest subnormal's (below the normal range the step is that one).
FP8_STEP = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17)}


def dequantize(cache: torch.Tensor, name: str) -> torch.Tensor:
    """The float values an 8-bit cache [..., row] holds: int8 codes times the row's fp16 scale
    (its last two bytes), or the fp8 codes' own values (torch's conversion)."""
    if name == "int8":
        scale = cache[..., -2:].contiguous().view(torch.float16).float()
        return cache[..., :-2].float() * scale
    return cache.float()


def random_cache(shape: tuple[int, ...], name: str, gen: torch.Generator) -> torch.Tensor:
    """A cache of the format holding random keys and values (any codes the format allows)."""
    *dims, head_dim = shape
    if name == "int8":
        codes = torch.randint(-127, 128, (*dims, head_dim), generator=gen, dtype=torch.int8)
        scale = (torch.rand(*dims, 1, generator=gen) * 0.02 + 1e-3).half()
        return torch.cat([codes, scale.view(torch.int8)], dim=-1)
    return torch.randn(shape, generator=gen).to(FP8[name])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def on_int8_grid(q: torch.Tensor) -> torch.Tensor:
    """Each head vector [..., D] rounded to the nearest multiple of max|q| / 127."""
    step = q.abs().amax(-1, keepdim=True) / 127
    return torch.round(q / step.clamp_min(1e-30)) * step


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size d (Sylvester's; symmetric)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


def key_rotation(name: str, head_dim: int) -> torch.Tensor:
    """What the cache's keys (and the queries against them) are rotated by: int8 at a head
    size that is a power of 2 stores H k (H q . H k = q . k)."""
    if name == "int8" and head_dim & (head_dim - 1) == 0:
        return hadamard(head_dim)
    return torch.eye(head_dim)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [2, 6])  # 1 or 3 query heads a KV head
@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("head_dim", [24, 64, 128])  # (24: no unrolled size, a 16 and a tail)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_the_format_as_its_float_values(name: str, dtype: torch.dtype,
                                                        window: int | None, head_dim: int,
                                                        block: int, heads: int) -> None:
    """A mixed step (decodes, prompt chunks with and without past: the vector loop, a
    decode's heads together, the matrix form) over a cache in the format: the new keys
    (roped) and values land quantized within the format's step, and the output is the torch
    path's over a float32 cache of the values the format holds."""
    _check_format(name, dtype, window, head_dim, block, heads, None)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [2, 6])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("window", [None, 1100])
def test_long_decodes_in_parts_read_the_format_as_its_float_values(
        name: str, window: int | None, head_dim: int, heads: int) -> None:
    """Decodes over 1 to 3 parts of 1,024 keys (cpu_kernels.cpp's kPartitionKeys), merged: the
    same as the torch path over the format's float values."""
    _check_format(name, torch.bfloat16, window, head_dim, 16, heads, LONG_ROWS)


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [4, 6, 8])  # 2, 3 or 4 query heads a KV head
@pytest.mark.parametrize("extra", [None, "softcap", "sinks"])
def test_a_decodes_heads_together_read_the_format_with_a_softcap_or_sinks(
        name: str, heads: int, extra: str | None) -> None:
    """A decode's query heads of a KV head together (cpu_kernels.cpp's int8_group_keys over
    int8, group_keys over fp8) at each group size they take, with a softcap (scores large
    enough that it bites) or sinks: the torch path's over the format's float values."""
    _check_format(name, torch.bfloat16, None, 64, 16, heads, None, extra)


def _check_format(name: str, dtype: torch.dtype, window: int | None, head_dim: int, block: int,
                  heads: int, rows: list[tuple[int, int]] | None,
                  extra: str | None = None) -> None:
    q, k, v, native, table, slots, positions, meta = _step(dtype, window, head_dim, block, heads,
                                                           rows)
    if extra == "softcap":
        q = q * 4  # (with a cap of 1.5)
    softcap = 1.5 if extra == "softcap" else None
    sinks = torch.linspace(-1.0, 3.0, heads).to(dtype) if extra == "sinks" else None
    gen = torch.Generator().manual_seed(11)
    cache = random_cache((*native.shape[:-1], head_dim), name, gen)
    if name == "int8":
        assert cache.shape[-1] == head_dim + 2
    cos, sin = _rope_tables(int(positions.max()) + 1, dtype, head_dim)
    kernel_meta = KernelMetadata([table], slots, positions, [(cos.float(), sin.float())])
    got = kernel_paged_attention(q, k, v, cache, kernel_meta,
                                 LayerAttention(head_dim ** -0.5, window, softcap), sinks)
    assert got.dtype == dtype and got.shape == q.shape and torch.isfinite(got).all()
    held = dequantize(cache, name)  # [2, NB, BS, KVH, D] float32, this step's keys included

    # This step's keys (roped in float32) and values, where the table says, within a step.
    c, s = cos.float()[positions].unsqueeze(1), sin.float()[positions].unsqueeze(1)
    rotation = key_rotation(name, head_dim)
    fresh_k, fresh_v = _rope(k.float(), c, s) @ rotation, v.float()
    at = (table[slots, positions // block].long(), positions % block)
    for written, fresh in ((held[0][at], fresh_k), (held[1][at], fresh_v)):
        if name == "int8":  # half a code's step, the step max|x| / 127 (fp16, rounded up)
            step = fresh.abs().amax(-1, keepdim=True) / 127
            assert ((written - fresh).abs() <= step * 0.5 * 1.002 + 1e-6).all()
        else:
            relative, least = FP8_STEP[name]
            assert ((written - fresh).abs() <= fresh.abs() * relative + least + 1e-7).all()

    # The attention over them: the torch path on the float values, this step's included (over
    # int8, the queries as the kernel has them: roped, scaled, rotated, on their int8 grid).
    scale = head_dim ** -0.5
    queries = _rope(q.float(), c, s) @ rotation
    if name == "int8":
        queries = on_int8_grid(queries * scale) / scale
    expected = paged_attention(queries, held[0][at], held[1][at], held.clone(), meta, scale,
                               softcap=softcap, sinks=sinks)
    tol = TOLERANCE[dtype]
    if name == "int8":  # (a query element at a rounding tie may take the next code: the
        tol = max(tol, 3e-3)  # kernel rotates by butterflies, this by a matrix product)
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_saturates_and_int8_keeps_zero_rows(name: str) -> None:
    """Values past fp8's largest finite one are stored as it (vLLM's saturating conversion,
    not infinity or NaN); an all-zero row of int8 has scale 0 and reads back 0."""
    q, k, v, native, table, slots, positions, _ = _step(torch.float32, None, 64, 16, 6)
    big = 1e6
    v = v.clone()
    v[0, 0, 0], v[1, 0, 0] = big, -big
    cos, sin = _rope_tables(64, torch.float32, 64)
    meta = KernelMetadata([table], slots, positions, [(cos, sin)])
    cache = torch.zeros((*native.shape[:-1], 64), dtype=FP8[name])
    kernel_paged_attention(q, k, v, cache, meta, LayerAttention(0.125))
    values = cache[1].float()
    for t, sign in ((0, 1), (1, -1)):
        got = values[table[slots[t], positions[t] // 16], positions[t] % 16, 0, 0]
        assert got == sign * torch.finfo(FP8[name]).max
    assert torch.isfinite(values).all()

    int8 = torch.zeros((*native.shape[:-1], 66), dtype=torch.int8)
    zero_v = torch.zeros_like(v)
    kernel_paged_attention(q, k, zero_v, int8, meta, LayerAttention(0.125))
    at = (table[slots, positions // 16].long(), positions % 16)
    assert torch.equal(dequantize(int8, "int8")[1][at], torch.zeros_like(v))


@needs_kernels
def test_int8_keys_are_rotated_so_an_outlier_channel_costs_its_row_little() -> None:
    """Keys with one channel 50x the others (as models' keys have): stored rotated, every
    channel keeps ~1/100 of a unit's precision; quantized as they are, the others' codes
    would be steps of 50/127."""
    q, k, v, native, table, slots, positions, meta = _step(torch.float32, None, 64, 16, 6)
    k = k.clone()
    k[..., 5] *= 50
    cos, sin = _rope_tables(64, torch.float32, 64)
    cache = torch.zeros((*native.shape[:-1], 66), dtype=torch.int8)
    kernel_paged_attention(q, k, v, cache, KernelMetadata([table], slots, positions, [(cos, sin)]),
                           LayerAttention(0.125))
    at = (table[slots, positions // 16].long(), positions % 16)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    keys = dequantize(cache, "int8")[0][at] @ hadamard(64)  # (H H = I: back to the keys)
    fresh = _rope(k, c, s)
    error = (keys - fresh).abs()
    assert error.max() < 0.5 * 50 / 127  # half a step of the plain row's scale at most
    assert error.mean() < 0.05


def test_the_pool_holds_what_its_format_says() -> None:
    """Bytes per block and the caches' shape and dtype, per format: at head size 64 int8
    holds 1.94x and fp8 2x the blocks of bf16 in the same memory."""
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=64, model_dtype=torch.bfloat16)
    per_block = {n: KVPool.bytes_per_block(kv_format(n), shape, 16)
                 for n in ("auto", "int8", "fp8", "fp8_e5m2")}
    assert per_block["auto"] == 3 * 2 * 16 * 2 * 64 * 2
    assert per_block["int8"] == 3 * 2 * 16 * 2 * 66
    assert per_block["fp8"] == per_block["fp8_e5m2"] == 3 * 2 * 16 * 2 * 64
    memory = 1 << 24
    assert (memory // per_block["int8"]) / (memory // per_block["auto"]) >= 1.9
    pool = KVPool(kv_format("int8"), shape, 5, 16, torch.device("cpu"))
    assert len(pool.caches) == 3 and pool.caches[0].shape == (2, 5, 16, 2, 66)
    assert pool.caches[0].dtype == torch.int8 and pool.describe() == "int8"
    assert KVPool(FORMATS["auto"], shape, 1, 16, torch.device("cpu")).describe() == "bfloat16"
    assert kv_format("fp8") is FORMATS["fp8_e4m3"]


def test_a_format_the_forward_cannot_read_is_refused_by_name() -> None:
    """The torch and flex forwards keep the model's dtype: asked for an 8-bit cache, the
    selection says which format and which forward; the timed device has no cache."""
    for req in (ForwardRequest("cuda", kv_cache_dtype="fp8"),
                ForwardRequest("cpu", cpu_kernels=False, kv_cache_dtype="int8"),
                ForwardRequest("cpu", compile=True, kv_cache_dtype="int8")):
        with pytest.raises(ConfigError, match=rf"--kv-cache-dtype {req.kv_cache_dtype}: the "
                                              rf"(flex|torch) forward"):
            select_backend(req, probe=False)
    assert select_backend(ForwardRequest("cpu", kv_cache_dtype="int8"),
                          probe=False).backend == "cpu_kernels"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        ExecutorConfig(kv_cache_dtype="q4_0")
    with pytest.raises(ConfigError, match="needs a model"):
        ExecutorConfig.for_device("timed:2,0", kv_cache_dtype="int8")



@needs_kernels
def test_int8_prefix_hits_and_preemption_give_a_roomy_caches_outputs(tiny_model_dir) -> None:
    """Over an int8 cache, a request that finds its prefix written by another, and sequences
    preempted and resumed in a cache too small for them all, give the greedy outputs of one
    roomy enough that neither happens (each prompt on its own)."""
    from transformers import AutoTokenizer

    from ipc.messages import SamplingParams
    from stages.inprocess import InProcessEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = tok("You are a careful assistant. Answer briefly and exactly. " * 2)["input_ids"]
    prompts = [system + tok(q)["input_ids"] for q in ("Why?", "How many?", "Where is it")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def engine(blocks: int, **kw) -> InProcessEngine:
        return InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_dtype="int8",
                               kv_cache_memory=blocks * per_block, **kw)

    probe = InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_dtype="int8")
    per_block = KVPool.bytes_per_block(kv_format("int8"), probe.runner.model.kv_shape, 4)
    expected = [engine(64).generate([p], params)[0] for p in prompts]

    shared = engine(64, max_num_seqs=4)
    assert shared.generate(prompts[:1], params) == expected[:1]
    assert shared.generate(prompts[1:], params) == expected[1:]
    assert shared.scheduler.prefix_cache_hits >= len(system) // 4 * 4 - 4

    small = engine(len(system) // 4 + 8, max_num_seqs=3)
    assert small.generate(prompts, params) == expected
    assert small.scheduler.num_preemptions > 0
