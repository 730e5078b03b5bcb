"""Attention over the paged cache against a plain reference, on mixed batches: decodes of very
different context lengths (several padding groups), prompt chunks with and without past, rows
crossing block boundaries, GQA, a page two sequences share (a prefix hit), with and without a
sliding window that the rows outgrow. Every implementation: eager PyTorch (SDPA per group and
row), compiled (one FlexAttention call, padded as a compiled step is, a block mask per window)
and the CPU kernel (one call, rope and the cache write inside).
The reference gathers each sequence's keys in order and does the softmax in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_marks import needs_kernels

from ipc.config import EngineLimits
from stages.executor.backends.base import LayerAttention
from stages.executor.backends.cpu_kernels import KernelMetadata, kernel_paged_attention
from stages.executor.backends.flex import (
    SlidingWindows,
    build_flex_metadata,
    flex_paged_attention,
    pad_forward_inputs,
    query_blocks,
)
from stages.executor.backends.torch_sdpa import (
    PrefillRow,
    build_attention_metadata,
    decode_attention,
    group_by_length,
    paged_attention,
)
from stages.executor.staging import DeviceStep

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 96


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              positions: list[int], scale: float, window: int | None = None) -> torch.Tensor:
    """q [n, H, D] at `positions`; keys/values [L, KVH, D] of the sequence: causal, over the
    last `window` positions where there is one."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for i, p in enumerate(positions):
        first = 0 if window is None else max(0, p - window + 1)
        for h in range(HEADS):
            k = keys[first:p + 1, h // group].double()
            v = values[first:p + 1, h // group].double()
            w = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v
    return out


# (context length after the step, query tokens): decodes (query 1) of lengths spread over
# several padding groups, a prompt with no past, chunks with past, block boundaries.
ROWS = [[(1, 1), (3, 1), (4, 1), (5, 1), (17, 1), (40, 1), (7, 7), (13, 5), (9, 1), (24, 8)],
        [(64, 1), (2, 1)],
        [(5, 5), (8, 4), (12, 3)],
        [(33, 1)],
        [(20, 1), (9, 3), (6, 6)]]
# More query tokens than a tile of the CPU kernel holds (16); beyond the compiled tests' budget.
LONG_ROWS = [(50, 37), (3, 1), (40, 40)]

CASES = [pytest.param(impl, rows, None, id=f"{impl}-{i}",
                      marks=[needs_kernels] if impl == "kernel"
                      else [pytest.mark.slow] if impl in ("paged", "per-row") else [])
         for impl, row_sets in (("eager", [*ROWS, LONG_ROWS]), ("paged", ROWS),
                                ("per-row", ROWS), ("kernel", [*ROWS, LONG_ROWS]))
         for i, rows in enumerate(row_sets)]
# Sliding windows of 5 (across pages) and 8 (two whole pages): decodes and chunks past them,
# a window's edge inside a page a prefix hit shares (ROWS[4]).
WINDOW_CASES = [pytest.param(impl, ROWS[i], window, id=f"{impl}-{i}-window{window}",
                             marks=[needs_kernels] if impl == "kernel"
                             else [pytest.mark.slow] if impl in ("paged", "per-row") else [])
                for impl, cases in (("eager", [(0, 5), (2, 5), (4, 5), (0, 8)]),
                                    ("kernel", [(0, 5), (2, 5), (4, 5), (0, 8)]),
                                    ("paged", [(0, 5), (4, 5), (0, 8)]),
                                    ("per-row", [(0, 5), (4, 8)]))
                for i, window in cases]


def _past(row: tuple[int, int]) -> int:
    return row[0] - row[1]


@pytest.mark.parametrize(("impl", "rows", "window"), CASES + WINDOW_CASES)
def test_paged_attention_matches_the_reference(rows: list[tuple[int, int]], impl: str,
                                               window: int | None) -> None:
    gen = torch.Generator().manual_seed(len(rows))
    scale = HEAD_DIM ** -0.5
    max_blocks = 20
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    block_table = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    seq_k, seq_v = [], []  # each sequence's whole K/V, as the reference sees it
    used = 0
    for slot, (ctx, _) in enumerate(rows):
        n = -(-ctx // BLOCK)
        block_table[slot, :n] = perm[used:used + n]  # scattered blocks
        used += n
        seq_k.append(torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen))
        seq_v.append(torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen))
        if slot == 1 and _past(rows[0]) >= BLOCK and _past(rows[1]) >= BLOCK:
            block_table[1, 0] = block_table[0, 0]  # a prefix hit: row 0's first page, shared
            seq_k[1][:BLOCK], seq_v[1][:BLOCK] = seq_k[0][:BLOCK], seq_v[0][:BLOCK]
        for p in range(ctx):  # the past is in the cache already (new ones are rewritten)
            b, o = int(block_table[slot, p // BLOCK]), p % BLOCK
            kv_cache[0, b, o], kv_cache[1, b, o] = seq_k[-1][p], seq_v[-1][p]
    q_lens = np.array([q for _, q in rows])
    ctx_lens = np.array([c for c, _ in rows])
    ends = np.cumsum(q_lens)
    starts = ends - q_lens
    positions = np.concatenate([np.arange(c - q, c) for c, q in rows])
    token_slots = np.repeat(np.arange(len(rows)), q_lens)
    decode = np.flatnonzero(q_lens == 1)
    decode = decode[np.argsort(ctx_lens[decode], kind="stable")]
    views = {name: torch.from_numpy(a) for name, a in (
        ("positions", positions), ("token_slots", token_slots),
        ("decode_token_idx", starts[decode]), ("decode_slots", decode),
        ("decode_lens", ctx_lens[decode]))}
    prefills = [PrefillRow(int(starts[r]), int(ends[r]), int(r), int(ctx_lens[r]))
                for r in np.flatnonzero(q_lens > 1)]
    total = int(ends[-1])
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.cat([seq_k[r][c - n:] for r, (c, n) in enumerate(rows)])  # this step's tokens
    v = torch.cat([seq_v[r][c - n:] for r, (c, n) in enumerate(rows)])
    if impl in ("paged", "per-row"):
        out = _compiled_attention(q, k, v, kv_cache, block_table, q_lens, ctx_lens, positions,
                                  token_slots, scale, impl == "per-row", window)
    elif impl == "kernel":  # a rope of angle 0 (cos 1, sin 0): the keys are written as given
        ones, zeros = torch.ones(64, HEAD_DIM), torch.zeros(64, HEAD_DIM)
        meta = KernelMetadata([block_table], views["positions"].new_tensor(token_slots),
                              views["positions"], [(ones, zeros)])
        out = kernel_paged_attention(q, k, v, kv_cache, meta, LayerAttention(scale, window))
    else:
        meta = build_attention_metadata(DeviceStep(views), group_by_length(ctx_lens[decode]),
                                        prefills, block_table, BLOCK, window)
        out = paged_attention(q, k, v, kv_cache, meta, scale)
    for r, (c, n) in enumerate(rows):
        want = reference(q[starts[r]:ends[r]], seq_k[r], seq_v[r], list(range(c - n, c)), scale,
                         window)
        torch.testing.assert_close(out[starts[r]:ends[r]].double(), want, atol=1e-5, rtol=1e-5)
    # This step's keys and values were written where the block table says.
    for r, (c, n) in enumerate(rows):
        for p in range(c - n, c):
            b, o = int(block_table[r, p // BLOCK]), p % BLOCK
            assert torch.equal(kv_cache[0, b, o], seq_k[r][p])
            assert torch.equal(kv_cache[1, b, o], seq_v[r][p])


def _compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor, q_lens: np.ndarray,
                        ctx_lens: np.ndarray, positions: np.ndarray, token_slots: np.ndarray,
                        scale: float, per_row: bool, window: int | None) -> torch.Tensor:
    """The step as the compiled forward sees it: padded to its bucket (padding tokens in the
    padding slot, whose table points at a scratch block), one compiled FlexAttention call,
    its query blocks a page of rows each or one row each, through the window's block mask
    where there is one."""
    slots = np.arange(len(q_lens))
    rows, qb_slots, qb_pages = query_blocks(q_lens, ctx_lens, slots, BLOCK)
    limits = EngineLimits(len(q_lens), 64, BLOCK, 20 * BLOCK, 100)
    padded = pad_forward_inputs({"input_ids": np.zeros(len(rows), np.int64),
                                 "positions": positions, "token_slots": token_slots,
                                 "query_rows": rows, "qblock_slots": qb_slots,
                                 "qblock_pages": qb_pages}, limits)
    scratch = NUM_BLOCKS - 1  # the tests' tables never reach it
    table = torch.cat([block_table, torch.full((1, block_table.shape[1]), scratch,
                                               dtype=torch.int32)])
    views = {name: torch.from_numpy(a) for name, a in padded.items()}
    num_tokens, num_pad = len(padded["input_ids"]), len(padded["input_ids"]) - len(rows)
    meta = build_flex_metadata(DeviceStep(views), table, BLOCK, NUM_BLOCKS, per_row)
    if window is not None:
        windows = SlidingWindows([window], BLOCK, len(padded["qblock_slots"]), NUM_BLOCKS,
                                 torch.device("cpu"))
        meta.windowed = {(0, w): mask for w, mask in windows.block_masks(
            DeviceStep(views), table, NUM_BLOCKS, per_row).items()}
    pad = torch.zeros(num_pad, *k.shape[1:])
    attend = torch.compile(flex_paged_attention, dynamic=False, fullgraph=True)
    # (one graph per case on the one code object: more than dynamo's default limit of 8)
    with torch._dynamo.config.patch(recompile_limit=64):
        out = attend(torch.cat([q, torch.zeros(num_pad, *q.shape[1:])]), torch.cat([k, pad]),
                     torch.cat([v, pad]), kv_cache, meta, scale, window)
    assert out.shape[0] == num_tokens
    return out[:len(rows)]


def test_decode_rows_of_very_different_lengths_fall_in_several_groups() -> None:
    groups = group_by_length(np.array([1, 3, 4, 5, 9, 17, 33, 40, 64, 200]))
    assert len(groups) > 1 and groups[0].start == 0 and groups[-1].end == 10
    for g in groups:  # padding at most doubles the keys a group reads (16 at least)
        assert g.max_len <= 2 * max(16, [1, 3, 4, 5, 9, 17, 33, 40, 64, 200][g.start])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa_in_float64(dtype: torch.dtype) -> None:
    """The decode path for reduced precision: grouped query heads, masked keys, GQA."""
    gen = torch.Generator().manual_seed(3)
    batch, length = 5, 24
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, length, HEAD_DIM, generator=gen)
    lens = torch.tensor([1, 5, 16, 17, 24])
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double().unsqueeze(2), k.double(), v.double(), attn_mask=mask, scale=0.3,
        enable_gqa=True).squeeze(2)
    got = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
