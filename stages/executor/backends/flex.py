"""Compiled attention: one FlexAttention call per layer over the whole batch, reading the cache
in place, in the executor process (needs torch.compile: eager FlexAttention materialises
every score). Steps are padded to a few token buckets, one compiled graph each; decode steps
can be replayed as CUDA graphs (graphs.py).

Queries sit in blocks of one page of positions of one sequence (`query_blocks`); a block's
keys are its sequence's earlier pages, whole, and its own page, masked by offset. A layer with
a sliding window reads another block mask, one per window a step (`SlidingWindows`): the
pages inside the window whole, the pages at its edges and its own masked by position.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ipc.config import EngineLimits
from stages.executor.backends.base import (
    AttentionBackend,
    ForwardTables,
    HostInputs,
    LayerAttention,
    StepRows,
    apply_rope,
    slot_mapping,
    write_kv,
)
from stages.executor.staging import DeviceStep, ForwardFields, Staged, StagedFields, per_token

# ------------------------------------------------------------------ buckets and query blocks


@functools.cache  # (asked once a step, by pad_forward_inputs)
def token_buckets(limits: EngineLimits) -> tuple[int, ...]:
    """Padded step sizes of a compiled forward, one compiled graph each: powers of two and
    1.5 times them (padding wastes at most a third of a step), then the token budget."""
    budget = limits.max_num_batched_tokens
    sizes = {1, 2, 4}
    size = 8
    while size < budget:
        sizes |= {size, size * 3 // 2}
        size *= 2
    return tuple(sorted(s for s in sizes if s < budget)) + (budget,)


def bucket(limits: EngineLimits, num_tokens: int) -> int:
    """The padded size of a step of num_tokens tokens (at most the token budget)."""
    return next(b for b in token_buckets(limits) if b >= num_tokens)


def max_query_blocks(limits: EngineLimits, num_tokens: int) -> int:
    """Attention query blocks (one page of positions of one sequence each) a step of
    `num_tokens` can need, plus one that padding tokens use: a row of L tokens spans at
    most L // block_size + 2 pages and never more than L."""
    rows = min(num_tokens, limits.max_num_seqs)
    return min(num_tokens, num_tokens // limits.block_size + 2 * rows) + 1


def _query_blocks_count(limits: EngineLimits) -> int:
    return max_query_blocks(limits, limits.max_num_batched_tokens)


def query_blocks(query_lens: np.ndarray, context_lens: np.ndarray, slots: np.ndarray,
                 block_size: int, decode_only: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled attention's query layout: each row's query positions cut at page
    boundaries into query blocks of block_size rows, row i of a block holding the position
    at page offset i (so causality inside a page is `key offset <= query offset` for every
    row alike). Returns the query row of each token [T], and the slot [Q] and page index [Q]
    of each query block. decode_only: every query_len is 1 (the same layout, in a few
    calls: one block a row, on the page of its one position)."""
    if decode_only:
        positions = context_lens - 1
        rows = np.arange(len(positions)) * block_size + positions % block_size
        return rows, slots, positions // block_size
    first = (context_lens - query_lens) // block_size  # page of each row's first query
    num = (context_lens - 1) // block_size - first + 1  # pages its queries span
    start = np.cumsum(num) - num
    page_of_block = np.repeat(first, num) + (np.arange(int(num.sum())) - np.repeat(start, num))
    positions = np.repeat(context_lens - query_lens, query_lens) + (
        np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                     query_lens))
    block_of_token = np.repeat(start - first, query_lens) + positions // block_size
    rows = block_of_token * block_size + positions % block_size
    return rows, np.repeat(slots, num), page_of_block


def pad_to(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    if len(values) == size:  # (a step the size of its bucket)
        return values
    return np.concatenate([values, np.full(size - len(values), fill, values.dtype)])


def pad_forward_inputs(forward: dict[str, np.ndarray],
                       limits: EngineLimits) -> dict[str, np.ndarray]:
    """The forward's inputs padded to the smallest bucket that holds the step: padding
    tokens belong to slot limits.max_num_seqs and use the last query block."""
    num_tokens = bucket(limits, len(forward["input_ids"]))
    num_blocks = max_query_blocks(limits, num_tokens)
    pad_slot, spare_row = limits.max_num_seqs, (num_blocks - 1) * limits.block_size
    return {
        "input_ids": pad_to(forward["input_ids"], num_tokens, 0),
        "positions": pad_to(forward["positions"], num_tokens, 0),
        "token_slots": pad_to(forward["token_slots"], num_tokens, pad_slot),
        "query_rows": pad_to(forward["query_rows"], num_tokens, spare_row),
        "qblock_slots": pad_to(forward["qblock_slots"], num_blocks, pad_slot),
        "qblock_pages": pad_to(forward["qblock_pages"], num_blocks, 0),
    }


# ------------------------------------------------------------------ metadata and attention


@dataclass
class FlexMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache index that each token's K/V is written to
    query_rows: torch.Tensor  # [T] row of each token in the query blocks
    block_mask: BlockMask  # query blocks [Q] x the cache's pages
    # each rope table at every token's position ([T, 1, D] cos and sin)
    ropes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the block mask of each KV group and sliding window of the layers (SlidingWindows)
    windowed: dict[tuple[int, int], BlockMask] = field(default_factory=dict)
    # KV groups past the first (EngineLimits.kv_windows): where each group's layers write
    # (index 0: slot_mapping's), and the block mask of each group whose layers read every
    # key (the first's: block_mask)
    slot_mappings: list[torch.Tensor] = field(default_factory=list)
    causal: dict[int, BlockMask] = field(default_factory=dict)


@functools.cache  # one function per page size: the compiled graph guards on its identity
def _same_page_causal(block_size: int):  # type: ignore[no-untyped-def]
    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx % block_size <= q_idx % block_size
    return mask_mod


def build_flex_metadata(v: DeviceStep, block_table: torch.Tensor,
                        block_size: int, num_cache_blocks: int,
                        per_row: bool = False) -> FlexMetadata:
    """Device-side metadata of the compiled attention from the unpacked step views `v`
    (tokens and query blocks, padded or not) and the block table [slots, max_blocks].

    The block mask's query blocks are the query blocks (a page of rows each), or with
    `per_row` every row of them on its own: a decode row then reads its keys once instead of
    once for each of its page's 16 rows (the CPU kernel computes every row of a block), and
    rows no token uses read nothing. Same query layout, same mask either way."""
    positions, own_fields = v.positions, FlexFields(v.views)
    pages_of_token = positions // block_size
    num_q = own_fields.qblock_slots.shape[0]
    # FlexAttention on the CPU wants index rows as long as the cache has pages.
    width = min(block_table.shape[1], num_cache_blocks)
    if per_row:
        rows, slots, own = own_fields.query_rows, v.token_slots, pages_of_token
        num_blocks = num_q * block_size
    else:
        rows, slots, own = None, own_fields.qblock_slots, own_fields.qblock_pages
        num_blocks = num_q
    tables = block_table[slots]  # [rows or Q, max_blocks] int32
    full = tables.new_zeros(num_blocks, num_cache_blocks)
    partial = tables.new_zeros(num_blocks, num_cache_blocks)
    num_full = tables.new_zeros(num_blocks)
    index = slice(None) if rows is None else rows
    full[index, :width] = tables[:, :width]
    partial[index, 0] = tables.gather(1, own[:, None])[:, 0]
    num_full[index] = own.int()
    # (a device-side fill: `num_partial[index] = 1` would copy the 1 from the host)
    num_partial = (tables.new_ones(num_blocks) if rows is None
                   else tables.new_zeros(num_blocks).index_fill_(0, rows, 1))
    mask_mod = _same_page_causal(block_size)
    block_mask = BlockMask.from_kv_blocks(
        num_partial[None, None], partial[None, None], num_full[None, None], full[None, None],
        BLOCK_SIZE=(1 if per_row else block_size, block_size),
        mask_mod=mask_mod,  # type: ignore[arg-type]
        seq_lengths=(num_q * block_size, num_cache_blocks * block_size),
        compute_q_blocks=False)
    return FlexMetadata(slot_mapping(block_table, v.token_slots, positions, block_size),
                        own_fields.query_rows, block_mask)


# Pages a query block (or row) of a windowed layer reads in part, at most: one or two at the
# window's far edge and its own.
WINDOW_PARTIAL_PAGES = 3


class SlidingWindows:
    """The block masks of the layers' sliding windows, built each step beside the full one.

    A window is a bound on positions, which the cache's pages do not carry: each window's mask
    function reads the position of each query block's page and of each key page from two
    buffers of this object, refilled each step (a new function each step would be a new
    compiled graph; these, one per window, are made once and keep their buffers, which a
    replayed CUDA graph needs too). A key page's position is that of the page in its
    sequence, the same in every sequence holding it: a page shared by a prefix-cache hit is
    at the same index in each, its key chaining over every earlier token
    (scheduler/sequence.py block_key)."""

    def __init__(self, windows: Sequence[int], block_size: int, num_query_blocks: int,
                 num_cache_blocks: int, device: torch.device) -> None:
        self.windows, self.block_size = tuple(windows), block_size
        self.qblock_pages = torch.zeros(num_query_blocks, dtype=torch.int64, device=device)
        self.page_index = torch.zeros(num_cache_blocks, dtype=torch.int64, device=device)
        self.mask_mods = {window: self._mask_mod(window) for window in self.windows}

    def _mask_mod(self, window: int):  # type: ignore[no-untyped-def]
        qblock_pages, page_index, bs = self.qblock_pages, self.page_index, self.block_size

        def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            q_pos = qblock_pages[q_idx // bs] * bs + q_idx % bs
            kv_pos = page_index[kv_idx // bs] * bs + kv_idx % bs
            return (kv_pos <= q_pos) & (kv_pos > q_pos - window)
        return mask_mod

    def block_masks(self, v: DeviceStep, block_table: torch.Tensor, num_cache_blocks: int,
                    per_row: bool) -> dict[int, BlockMask]:
        """Each window's block mask over the same query layout as build_flex_metadata's
        (query blocks of a page of rows, or with `per_row` each row its own)."""
        bs, own_fields = self.block_size, FlexFields(v.views)
        num_q = own_fields.qblock_slots.shape[0]
        self.qblock_pages[:num_q].copy_(own_fields.qblock_pages)
        if per_row:  # [T]: each token's row, at its position
            rows, slots, q_first = own_fields.query_rows, v.token_slots, v.positions
            q_last = q_first
        else:  # [Q]: each query block, a page of positions
            rows, slots = None, own_fields.qblock_slots
            q_first = own_fields.qblock_pages * bs
            q_last = q_first + bs - 1
        tables = block_table[slots]  # [R, max_blocks] int32
        return {window: self._block_mask(window, tables, q_first, q_last, rows, num_q,
                                         num_cache_blocks) for window in self.windows}

    def _block_mask(self, window: int, tables: torch.Tensor, q_first: torch.Tensor,
                    q_last: torch.Tensor, rows: torch.Tensor | None, num_q: int,
                    num_cache_blocks: int) -> BlockMask:
        """Pages every query of a block sees whole (after the window's far edge, before the
        first query) and the pages it sees in part (those at the far edge, up to its own),
        by page index in the sequence, then through its table."""
        bs, device = self.block_size, tables.device
        own = q_last // bs  # [R]
        first = (q_first - window + 1).clamp(min=0) // bs  # the first page with a key seen
        full_first = torch.div(q_last - window + bs, bs, rounding_mode="floor").clamp(min=0)
        full_last = (q_first + 1) // bs - 1
        num_full = (full_last - full_first + 1).clamp(min=0)
        has_full = num_full > 0
        num_low = torch.where(has_full, full_first - first, own - first + 1)
        num_high = torch.where(has_full, own - full_last, 0)
        i = torch.arange(WINDOW_PARTIAL_PAGES, device=device)[None]
        partial_pages = torch.where(i < num_low[:, None], first[:, None] + i,
                                    full_last[:, None] + 1 + i - num_low[:, None])
        # (entries past the count: still a page of the sequence, so its index is true)
        partial_pages = torch.minimum(partial_pages, own[:, None])
        partial = tables.gather(1, partial_pages)  # [R, 3] int32
        self.page_index.index_put_((partial.flatten().long(),), partial_pages.flatten())
        width = min(tables.shape[1], num_cache_blocks, window // bs + 1)
        full_pages = (full_first[:, None] + torch.arange(width, device=device)[None]).clamp(
            max=tables.shape[1] - 1)
        full = tables.gather(1, full_pages)  # [R, width] int32
        num_rows = num_q * bs if rows is not None else num_q
        index = slice(None) if rows is None else rows
        kv_full = tables.new_zeros(num_rows, num_cache_blocks)
        kv_partial = tables.new_zeros(num_rows, num_cache_blocks)
        kv_full[index, :width] = full
        num_partial_cols = min(WINDOW_PARTIAL_PAGES, num_cache_blocks)
        kv_partial[index, :num_partial_cols] = partial[:, :num_partial_cols]
        counts_full = tables.new_zeros(num_rows)
        counts_partial = tables.new_zeros(num_rows)
        counts_full[index] = num_full.int()
        counts_partial[index] = (num_low + num_high).int()
        return BlockMask.from_kv_blocks(
            counts_partial[None, None], kv_partial[None, None], counts_full[None, None],
            kv_full[None, None], BLOCK_SIZE=(1 if rows is not None else bs, bs),
            mask_mod=self.mask_mods[window],  # type: ignore[arg-type]
            seq_lengths=(num_q * bs, num_cache_blocks * bs), compute_q_blocks=False)


# On CUDA: Triton tiles of one page (the block mask's blocks are pages of 16 positions, see
# select.CUDA_PAGE_MULTIPLE; Inductor's default tiles are 32-128 and must divide them), and
# the main kernel for short queries too (the decoding kernel's tiles are larger still).
_CUDA_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 16}


def flex_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: FlexMetadata, scale: float,
                         window: int | None = None,
                         softcap: float | None = None, table: int = 0) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's, roped), kv_cache [2, NB, BS, KVH, D]
    -> [T, H, D]; `window`: a query at p sees keys p - window + 1 to p; `softcap`: scores
    through softcap * tanh(score / softcap) (a score_mod); `table`: the layer's KV group (its
    block table's masks and slot mapping). One FlexAttention call; to be
    run under torch.compile. (Sinks would be out * sigmoid(lse - sink), but Inductor's CPU
    FlexAttention does not return the LSE: FlexBackend refuses them.)"""
    write_kv(kv_cache, meta.slot_mappings[table] if table else meta.slot_mapping, k, v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if window is not None:
        block_mask = meta.windowed[table, window]
    else:
        block_mask = meta.causal[table] if table else meta.block_mask
    num_rows = block_mask.seq_lengths[0]
    # [1, H, rows, D], a 4-D buffer of its own (Inductor's CPU template wants one).
    queries = q.new_zeros(1, q.shape[1], num_rows, head_dim).index_copy_(
        2, meta.query_rows, q.transpose(0, 1)[None])
    keys = k_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)  # [1, KVH, NB*BS, D]
    values = v_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    score_mod = None
    if softcap is not None:
        cap = softcap

        def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any,
                      kv_idx: Any) -> torch.Tensor:
            return torch.tanh(score / cap) * cap

    out = flex_attention(queries, keys, values, score_mod=score_mod, block_mask=block_mask,
                         scale=scale, enable_gqa=True,
                         kernel_options=_CUDA_KERNEL_OPTIONS if q.is_cuda else None)
    return out[0].transpose(0, 1)[meta.query_rows]  # type: ignore[index]


class FlexFields(StagedFields):
    """This backend's packed fields (after the forward's, padded with them)."""

    query_rows = Staged("int64", per_token)  # row of each token in the blocks
    qblock_slots = Staged("int64", _query_blocks_count)  # Q: each block's slot
    qblock_pages = Staged("int64", _query_blocks_count)  # its page in the table


@dataclass(frozen=True)
class FlexPlan:
    # Decode steps on the CPU attend row by row (see build_flex_metadata); CUDA kernels take
    # a page of rows at once anyway.
    per_row: bool


class FlexBackend(AttentionBackend):
    """The compiled forward's attention (compile.py compiles the layers around it)."""

    name = "flex"
    compiled = True
    softcap = True
    staging_fields = FlexFields
    # The padded forward's inputs: ForwardFields and this backend's, packed first.
    graph_fields = (*ForwardFields.names(), *FlexFields.names())
    _windows: SlidingWindows | None = None  # (bind: where the layers have windows)

    def host_inputs(self, rows: StepRows) -> HostInputs:
        decode_only = rows.decode_only
        query_rows, qblock_slots, qblock_pages = query_blocks(
            rows.query_lens, rows.context_lens, rows.slots, self.limits.block_size,
            decode_only)
        arrays = pad_forward_inputs({**rows.forward, "query_rows": query_rows,
                                     "qblock_slots": qblock_slots,
                                     "qblock_pages": qblock_pages}, self.limits)
        return HostInputs(arrays, FlexPlan(decode_only and self.device.type == "cpu"))

    def bind(self, tables: ForwardTables) -> None:
        super().bind(tables)
        self._windows = (SlidingWindows(self.windows, self.limits.block_size,
                                        _query_blocks_count(self.limits),
                                        tables.num_cache_blocks, self.device)
                         if self.windows else None)

    def metadata(self, v: DeviceStep, plan: FlexPlan) -> FlexMetadata:
        t, bs = self.tables, self.limits.block_size
        meta = build_flex_metadata(v, t.block_table, bs, t.num_cache_blocks, plan.per_row)
        meta.ropes = [(cos[v.positions].unsqueeze(1), sin[v.positions].unsqueeze(1))
                      for cos, sin in t.ropes]  # [T, 1, D]
        if len(t.block_tables) > 1:  # (each KV group's layers write through its own table)
            meta.slot_mappings = [meta.slot_mapping] + [
                slot_mapping(table, v.token_slots, v.positions, bs)
                for table in t.block_tables[1:]]
        for table, window in self.attentions:
            if window is None and table:
                meta.causal[table] = build_flex_metadata(
                    v, t.block_tables[table], bs, t.num_cache_blocks, plan.per_row).block_mask
        if self._windows is not None:
            for table in sorted({g for g, w in self.attentions if w is not None}):
                masks = self._windows.block_masks(v, t.block_tables[table], t.num_cache_blocks,
                                                  plan.per_row)
                meta.windowed.update({(table, w): m for w, m in masks.items()})
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: FlexMetadata,
               layer: LayerAttention, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if layer.rope is not None:
            cos, sin = meta.ropes[layer.rope]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return flex_paged_attention(q, k, v, kv_cache, meta, layer.scale, layer.window,
                                    layer.softcap, layer.table)

    def graph_eligible(self, decode_only: bool, num_prompt_logprobs: int) -> bool:
        """Decode-only steps without prompt logprobs (their sizes are one bucket each)."""
        return decode_only and num_prompt_logprobs == 0

    def graph_plan(self) -> FlexPlan:
        return FlexPlan(self.device.type == "cpu")  # a replayed step is decode-only
