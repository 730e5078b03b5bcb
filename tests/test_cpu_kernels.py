"""The CPU kernels (stages/executor/csrc/cpu_kernels.cpp) against the PyTorch code they replace:
attention with its rope and cache write, a sliding window, a softcap, reduced precision; the norms
with the residual add and SiLU-and-mul; their refusals; where the build is cached."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_marks import needs_kernels

from stages.executor import kernels
from stages.executor.backends.base import TORCH_OPS, LayerAttention, rotate_half
from stages.executor.backends.cpu_kernels import (
    KernelMetadata,
    KernelOps,
    kernel_paged_attention,
)
from stages.executor.backends.torch_sdpa import (
    DecodeGroup,
    PrefillRow,
    build_attention_metadata,
    paged_attention,
)
from stages.executor.models.blocks import RMSNorm
from stages.executor.staging import DeviceStep

pytestmark = needs_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 16, 4, 96
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _rope_tables(max_len: int, dtype: torch.dtype,
                 head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """As CausalLM.init_rope: float32 angles, then rounded to the model's dtype."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# (context after the step, queries): decodes (one across a page boundary), a prompt chunk with
# past, a prompt without past longer than the window, and one of 40 tokens (three tiles of the
# kernel, each over several pages)
MIXED_ROWS = [(21, 1), (5, 1), (30, 9), (12, 12), (17, 1), (45, 40)]
# Decodes of 1 to 3 parts of the kernel's 1,024 keys (a part's edge on each side of the last
# key), short ones, and two tokens of the vector loop over more than a part.
LONG_ROWS = [(2100, 1), (1025, 1), (1024, 1), (3, 1), (200, 1), (1100, 2), (1500, 1)]
# ... and as many short decodes beside them as make a step of enough units for the threads
# that no decode is split by KV head (cpu_kernels.cpp's kHeadSplitUnits, 8 a thread: up to 8
# threads).
MANY_ROWS = LONG_ROWS + [(5 + 3 * i, 1) for i in range(8 * 8)]


def _step(dtype: torch.dtype, window: int | None, head_dim: int = HEAD_DIM,
          block: int = BLOCK, heads: int = HEADS, rows: list[tuple[int, int]] | None = None):
    """A step of `rows` (MIXED_ROWS unless given); the cache holds each sequence's past. A
    sequence of more than 12 pages has blocks for its own; its table's row past them repeats
    its last (never read)."""
    gen = torch.Generator().manual_seed(7)
    rows = MIXED_ROWS if rows is None else rows
    pages = [max(12, -(-c // block)) for c, _ in rows]
    num_blocks = max(NUM_BLOCKS, sum(pages))
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.empty(len(rows), max(pages), dtype=torch.int32)
    for i, start in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        table[i] = order[start:start + pages[i]][torch.arange(max(pages)).clamp_max(pages[i] - 1)]
    kv_cache = torch.randn(2, num_blocks, block, KV_HEADS, head_dim, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(c - q, c) for c, q in rows])
    slots = torch.cat([torch.full((q,), s) for s, (_, q) in enumerate(rows)])
    total = len(positions)
    qkv = torch.randn(total, (heads + 2 * KV_HEADS) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=-1)
    q = q.view(total, heads, head_dim)  # strided views of one matrix, as the model has them
    k = k.view(total, KV_HEADS, head_dim)
    v = v.view(total, KV_HEADS, head_dim)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor([q for _, q in rows]), 0).tolist()])
    decode = [i for i, (_, q) in enumerate(rows) if q == 1]
    decode.sort(key=lambda i: rows[i][0])
    views = {"positions": positions, "token_slots": slots,
             "decode_token_idx": starts[decode], "decode_slots": torch.tensor(decode),
             "decode_lens": torch.tensor([rows[i][0] for i in decode])}
    groups = [DecodeGroup(0, len(decode), max(rows[i][0] for i in decode))]
    prefills = [PrefillRow(int(starts[i]), int(starts[i + 1]), i, c)
                for i, (c, q) in enumerate(rows) if q > 1]
    meta = build_attention_metadata(DeviceStep(views), groups, prefills, table, block,
                                    window)
    return q, k, v, kv_cache, table, slots, positions, meta


@pytest.mark.parametrize("heads", [4, HEADS, 8])  # 2, 3 or 4 query heads a KV head
# (16: a page is one chunk of the matrix form, and one tile of keys for a bf16 decode's scores
# on AMX; 32: two of each)
@pytest.mark.parametrize("block", [BLOCK, 16, 32])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])  # (64, 128: unrolled head sizes)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_ropes_writes_and_attends_as_the_pytorch_path(dtype: torch.dtype,
                                                                window: int | None,
                                                                head_dim: int,
                                                                block: int, heads: int) -> None:
    """Grouped query heads (2-4 a KV head): decodes take a group's heads together over each
    key (at head size 64; in bf16 on a CPU with AMX, scores as tile products), tiles of two
    tokens the vector loop (reduced-precision pages widened once a group), tiles of three or
    more the matrix form; a page of 4 keys is a short chunk of it, one of 16 a whole one."""
    q, k, v, kv_cache, table, slots, positions, meta = _step(dtype, window, head_dim, block,
                                                             heads)
    cos, sin = _rope_tables(64, dtype, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_cache = kv_cache.clone()
    expected = paged_attention(q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v,
                               expected_cache, meta, head_dim ** -0.5)
    kernel_meta = KernelMetadata([table], slots, positions, [(cos.float(), sin.float())])
    got = kernel_paged_attention(q, k, v, kv_cache, kernel_meta,
                                 LayerAttention(head_dim ** -0.5, window))
    assert got.dtype == dtype and got.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # the keys (roped in float32, rounded once) and values landed where the table says
    torch.testing.assert_close(kv_cache.float(), expected_cache.float(), atol=tol, rtol=tol)
    assert torch.equal(kv_cache[1], expected_cache[1])


# (dtype, head_dim, block, heads, extra): the decode forms at 64 (1, 3, 4 or 5 query heads a KV
# head: the vector loop, the group's heads together, on AMX tiles in bf16) in every dtype; the
# other head and page sizes; a softcap and sinks
LONG_CASES = [
    *((dtype, 64, 16, heads, None) for dtype in (torch.float32, torch.bfloat16, torch.float16)
      for heads in (2, 6, 8, 10)),
    *((dtype, head_dim, block, heads, None) for dtype in (torch.float32, torch.bfloat16)
      for head_dim, block in ((HEAD_DIM, BLOCK), (HEAD_DIM, 16), (64, BLOCK))
      for heads in (2, 6)),
    *((dtype, 64, 16, 6, extra) for dtype in (torch.float32, torch.bfloat16)
      for extra in ("softcap", "sinks")),
]


@pytest.mark.parametrize(("dtype", "head_dim", "block", "heads", "extra"), LONG_CASES)
@pytest.mark.parametrize("window", [None, 1100])
def test_long_decodes_in_parts_are_the_pytorch_path_and_their_own_alone(
        dtype: torch.dtype, window: int | None, head_dim: int, block: int, heads: int,
        extra: str | None) -> None:
    """A decode reads its keys in parts of 1,024 (whole pages), a unit of work each that any
    thread takes, merged in order: over 1 to 3 parts (a window of 1,100 leaves the first part
    partly out), with a softcap or sinks, in every form of a decode (a group's heads
    together, their scores on AMX tiles in bf16, the vector loop for one or five query heads a
    KV head), the output is the torch path's; and each long decode's output is the bits it has
    in a step of its own, where it is split by KV head too, as it is not among many (what a row
    reads, and in which order, depends on its position alone)."""
    q, k, v, kv_cache, table, slots, positions, meta = _step(dtype, window, head_dim, block,
                                                             heads, MANY_ROWS)
    if extra == "softcap":
        q = q * 4  # (scores of a few units: the cap of 1.5 bites)
    cos, sin = _rope_tables(int(positions.max()) + 1, dtype, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    scale = head_dim ** -0.5
    softcap = 1.5 if extra == "softcap" else None
    sinks = (torch.linspace(-1.0, 3.0, heads).to(dtype) if extra == "sinks" else None)
    expected = paged_attention(q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v,
                               kv_cache.clone(), meta, scale, softcap=softcap, sinks=sinks)
    layer = LayerAttention(scale, window, softcap)
    ropes = [(cos.float(), sin.float())]
    got = kernel_paged_attention(q, k, v, kv_cache.clone(), KernelMetadata(
        [table], slots, positions, ropes), layer, sinks)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    for slot in range(len(LONG_ROWS)):  # (each writes its own keys and values, as before)
        mine = slots == slot
        alone = kernel_paged_attention(q[mine], k[mine], v[mine], kv_cache, KernelMetadata(
            [table], slots[mine], positions[mine], ropes), layer, sinks)
        assert torch.equal(alone, got[mine]), f"row {LONG_ROWS[slot]}"


@pytest.mark.parametrize("heads", [4, 8])
@pytest.mark.parametrize("block", [BLOCK, 16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_attention_is_the_pytorch_path(dtype: torch.dtype, window: int | None,
                                                  head_dim: int, block: int,
                                                  heads: int) -> None:
    """Gemma 2's softcap (scores through cap * tanh(score / cap) before the softmax) in every
    form of the kernel (a decode's group of heads, the vector loop, the matrix form), against
    the torch backend's explicit scores; a cap of 1.5 bites on these scores (the output
    without it differs)."""
    q, k, v, kv_cache, table, slots, positions, meta = _step(dtype, window, head_dim, block,
                                                             heads)
    q = q * 4  # (scores of a few units: the cap changes them)
    cos, sin = _rope_tables(64, dtype, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    scale, cap = head_dim ** -0.5, 1.5
    expected = paged_attention(q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v,
                               kv_cache.clone(), meta, scale, softcap=cap)
    kernel_meta = KernelMetadata([table], slots, positions, [(cos.float(), sin.float())])
    got = kernel_paged_attention(q, k, v, kv_cache.clone(), kernel_meta,
                                 LayerAttention(scale, window, cap))
    uncapped = kernel_paged_attention(q, k, v, kv_cache.clone(), kernel_meta,
                                      LayerAttention(scale, window))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert (got.float() - uncapped.float()).abs().max() > 10 * tol


@pytest.mark.parametrize("block", [BLOCK, 16, 32])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_what_lies_past_a_sequence_is_never_read_into_it(dtype: torch.dtype,
                                                         window: int | None, head_dim: int,
                                                         block: int) -> None:
    """Every form reads whole pages, tiles of 16 keys or vectors of them, past a sequence's
    last key; those keys must weigh nothing. The cache's slots past each sequence's context
    and its unused blocks hold NaN and infinities (a block freed by a sequence that
    overflowed): the outputs are the bits of a clean cache's."""
    q, k, v, kv_cache, table, slots, positions, meta = _step(dtype, window, head_dim, block)
    cos, sin = _rope_tables(64, dtype, head_dim)
    kernel_meta = KernelMetadata([table], slots, positions, [(cos.float(), sin.float())])
    poisoned = kv_cache.clone()
    live = torch.zeros(NUM_BLOCKS, block, dtype=torch.bool)
    for slot in range(len(table)):
        context = int(positions[slots == slot].max()) + 1
        for pos in range(context):
            live[table[slot, pos // block], pos % block] = True
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    dead = ~live
    poisoned[:, dead] = garbage[torch.arange(int(dead.sum())) % 3][:, None, None]
    clean = kernel_paged_attention(q, k, v, kv_cache, kernel_meta,
                                   LayerAttention(head_dim ** -0.5, window))
    got = kernel_paged_attention(q, k, v, poisoned, kernel_meta,
                                 LayerAttention(head_dim ** -0.5, window))
    assert torch.isfinite(clean).all()
    assert torch.equal(got, clean)


def _takes(n: int, grain: int, runs: int, selves: list[int]) -> list[tuple[int, int]]:
    out = torch.ops.llm_cpu.work_queue_takes(n, grain, runs, selves)
    return [(int(b), int(e)) for b, e in out.tolist()]


def test_the_work_queue_hands_out_every_unit_once_own_runs_first() -> None:
    """csrc/work_queue.h, as the products use it: each thread's own run front to back, then
    the back of another's; every unit handed out exactly once, whoever asks in whatever order,
    then nothing."""
    # 10 units in 2 runs ([0, 5) and [5, 10)), chunks of 2
    assert _takes(10, 2, 2, [0, 1, 0, 0, 0, 0, 1]) == [
        (0, 2), (5, 7), (2, 4), (4, 5), (8, 10), (7, 8), (-1, -1)]
    # one run (the shared order): any thread's index takes the next chunk
    assert _takes(7, 3, 1, [0, 5, 2, 1]) == [(0, 3), (3, 6), (6, 7), (-1, -1)]
    # a grain larger than the runs, more runs than units
    assert _takes(3, 8, 3, [2, 2, 2, 0]) == [(2, 3), (0, 1), (1, 2), (-1, -1)]
    gen = torch.Generator().manual_seed(0)
    for n, grain, runs in [(47, 2, 3), (251, 7, 2), (1000, 1, 16), (5, 1, 5)]:
        selves = torch.randint(0, runs, (n + 4,), generator=gen).tolist()
        chunks = [c for c in _takes(n, grain, runs, selves) if c != (-1, -1)]
        covered = sorted(u for b, e in chunks for u in range(b, e))
        assert covered == list(range(n)), (n, grain, runs)
        assert all(0 < e - b <= grain for b, e in chunks)
    with pytest.raises(RuntimeError, match="units in"):
        _takes(1 << 31, 1, 2, [0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_work_pool_runs_every_unit_once_and_passes_errors_on(threads: int) -> None:
    """csrc/work_pool.h through parallel_for: over many calls in a row (the helpers spinning,
    then sleeping and woken between some), every unit is visited exactly once a call; a helper
    joins a job still open (the caller holding it open); one thread runs everything on the
    caller; an error raised in any thread reaches the caller, and the pool serves the next
    call."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    visits = torch.ops.llm_cpu.work_pool_visits
    try:
        for n, grain, repeats in [(1, 1, 10), (37, 1, 300), (1000, 16, 50), (64, 64, 50)]:
            out = visits(n, grain, repeats, -1, False)
            assert out[:n].eq(repeats).all(), (n, grain)
            if threads == 1:
                assert int(out[n]) == 0
        if threads > 1:
            time.sleep(0.01)  # (the helpers asleep past their spin: woken by the next job)
            out = visits(100, 1, 20, -1, True)
            assert out[:100].eq(20).all() and int(out[100]) == 20
        for fail_at in (0, 999):  # the caller's first chunk; likely a helper's last
            with pytest.raises(RuntimeError, match=f"unit {fail_at} failed"):
                visits(1000, 1, 20, fail_at, False)
        assert visits(100, 1, 5, -1, False)[:100].eq(5).all()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("width", [96, 100])  # 16 lanes at a time, and a remainder of 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [False, True])  # (Gemma's 1 + w)
def test_norms_and_act_and_mul_match_the_modules(dtype: torch.dtype, width: int,
                                                 offset: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, width, generator=gen).to(dtype)
    residual = torch.randn(37, width, generator=gen).to(dtype)
    norm = RMSNorm(width, 1e-5, TORCH_OPS, offset)
    norm.weight.data = torch.randn(width, generator=gen).to(dtype)
    fused = RMSNorm(width, 1e-5, KernelOps(), offset)
    fused.weight.data = norm.weight.data
    one_ulp = {torch.float32: {"atol": 1e-6, "rtol": 1e-6},
               torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
               torch.float16: {"atol": 2e-3, "rtol": 1e-3}}[dtype]
    with torch.inference_mode():
        want = norm(x)
        torch.testing.assert_close(fused(x), want, **one_ulp)
        summed = x.clone()
        same, got = KernelOps().add_rms_norm(summed, residual, norm.weight, norm.eps, offset)
        assert same is summed
        assert torch.equal(summed, x + residual)  # x updated in place, rounded as x + y
        torch.testing.assert_close(got, norm(x + residual), **one_ulp)
        gate_up = (torch.randn(9, 2 * (width - 56), generator=gen) * 6).to(dtype)
        gate_up[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])  # (NaN stays NaN)
        gate, up = gate_up.split(width - 56, dim=-1)
        torch.testing.assert_close(torch.ops.llm_cpu.silu_and_mul(gate_up), F.silu(gate) * up,
                                   equal_nan=True, **one_ulp)
        # (Gemma's gelu: as the PyTorch op both ways round, and as KernelOps runs it)
        gelu = torch.ops.llm_cpu.gelu_tanh_and_mul(gate_up)
        torch.testing.assert_close(gelu, F.gelu(gate, approximate="tanh") * up,
                                   equal_nan=True, **one_ulp)
        assert torch.equal(KernelOps().act_and_mul("gelu_tanh")(gate_up).nan_to_num(),
                           gelu.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torchs_argmax_ties_and_nans_included(dtype: torch.dtype) -> None:
    """The first of equal maxima, a NaN before any number (the first NaN), -inf rows: the
    index torch.argmax gives, for rows of every length around the 16 lanes and the parts a
    row is split in (one row, 49,152 wide), and for rows with a stride."""
    gen = torch.Generator().manual_seed(2)
    for n in (1, 5, 16, 17, 31, 32, 33, 100, 4099, 49152, 49155):
        x = torch.randn(6, n, generator=gen).to(dtype)
        x[1] = x[1].round()  # many ties
        x[2] = float("-inf")
        x[3, n // 2:] = float("nan")  # the first NaN, not the largest number
        x[4, n - 1] = float("nan")  # a NaN in the remainder
        x[5] = 0.0  # all equal: index 0
        x[5, n // 3] = 0.5 if n > 1 else 0.0
        for rows in (x, x[:1], x[1:2], x[3:4], x[:, : max(1, n - 3)]):  # strided rows too
            assert torch.equal(torch.ops.llm_cpu.argmax_rows(rows), rows.argmax(dim=-1)), n
    assert torch.ops.llm_cpu.argmax_rows(torch.ones(0, 8, dtype=dtype)).shape == (0,)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    q, k, v, kv_cache, table, slots, positions, _ = _step(torch.float32, None)
    cos, sin = _rope_tables(64, torch.float32)
    with pytest.raises(RuntimeError, match="kv_cache: the model's dtype, int8, float8_e4m3fn"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache.double(), table, slots, positions,
                                          cos, sin, 0.25, 0)
    with pytest.raises(RuntimeError, match="an int8 cache's rows: head size \\+ 2"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache.to(torch.int8), table, slots,
                                          positions, cos, sin, 0.25, 0)
    with pytest.raises(RuntimeError, match="q, k, v: one dtype"):
        torch.ops.llm_cpu.paged_attention(q, k.bfloat16(), v, kv_cache, table, slots,
                                          positions, cos, sin, 0.25, 0)
    with pytest.raises(RuntimeError, match="int32 rows"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, table.long(), slots, positions,
                                          cos, sin, 0.25, 0)
    with pytest.raises(RuntimeError, match="number of tokens"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, table, slots[:-1], positions,
                                          cos, sin, 0.25, 0)
    # indices the kernel would follow out of bounds: refused before anything is written
    before = kv_cache.clone()
    for bad, match in ((positions + 60, "outside the rope tables"),
                       (positions + 16, "past the block table"),
                       ):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, table, slots, bad, cos, sin,
                                              0.25, 0)
    with pytest.raises(RuntimeError, match="outside the block table's 6 rows"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, table, slots + 6, positions, cos,
                                          sin, 0.25, 0)
    with pytest.raises(RuntimeError, match="outside the cache's 96"):
        torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, table + 96, slots, positions, cos,
                                          sin, 0.25, 0)
    assert torch.equal(kv_cache, before)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.llm_cpu.silu_and_mul(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul: contiguous"):
        torch.ops.llm_cpu.gelu_tanh_and_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.llm_cpu.argmax_rows(torch.ones(4, 3).t())
    with pytest.raises(RuntimeError, match="weight \\[width\\]"):
        torch.ops.llm_cpu.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-5)


def test_the_build_is_keyed_by_source_and_cache(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = kernels._compiler()
    assert compiler is not None
    here = kernels.library_path(compiler)
    assert here.parent.parent.name == "kernels"
    monkeypatch.setenv("LLM_PIPELINE_CACHE", str(tmp_path))
    moved = kernels.library_path(compiler)
    assert moved.is_relative_to(tmp_path) and moved.parent.name == here.parent.name
    changed = tmp_path / "quant_kernels.cpp"
    changed.write_text(kernels.SOURCES[1].read_text() + "\n// changed\n")
    monkeypatch.setattr(kernels, "SOURCES", (kernels.SOURCES[0], changed))
    assert kernels.library_path(compiler).parent.name != here.parent.name


def test_switched_off_they_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels.load() == f"{kernels.ENV}=0" and not kernels.available()
