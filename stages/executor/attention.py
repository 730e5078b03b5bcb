"""Attention over the paged KV cache for a flattened mixed batch. Runs in the executor process.

The cache of a layer is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token at
position p of a sequence lives in block block_table[p // block_size] at offset p % block_size.

Three implementations:
- CPU kernels (`kernel_paged_attention`, the eager default on the CPU): one call per layer
  over the whole batch into csrc/cpu_kernels.cpp, which also ropes this step's keys and
  queries and writes the cache, and reads the cache in place; nothing gathered or padded.
- compiled (`flex_paged_attention`): one FlexAttention call per layer over the whole batch,
  reading the cache in place. Queries sit in blocks of one page of positions of one sequence
  (step_inputs.query_blocks); a block's keys are its sequence's earlier pages, whole, and its
  own page, masked by offset. Needs torch.compile (eager FlexAttention materialises every
  score).
- eager PyTorch (`paged_attention`: CUDA without compile, or a CPU without the kernels):
  rows with one query token (decodes) in batched SDPA calls, grouped by context length so
  that padding at most doubles the keys read; rows with several (prefill chunks) one by
  one, over keys gathered from the cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from stages.executor.step_inputs import DecodeGroup, PrefillRow


@dataclass
class PrefillAttention:
    start: int  # first token of the row in the flattened batch
    end: int
    block_row: torch.Tensor | None  # [num_blocks] blocks of the whole context; None: no past
    mask: torch.Tensor | None  # [1, 1, query_len, context_len] bool, with past only
    context_len: int


@dataclass
class DecodeAttention:
    token_idx: torch.Tensor  # [B] rows of the flattened batch
    block_tables: torch.Tensor  # [B, nb]
    mask: torch.Tensor  # [B, 1, 1, nb * block_size] bool


@dataclass
class KernelMetadata:
    block_table: torch.Tensor  # [slots, max_blocks] int32
    token_slots: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    rope_cos: torch.Tensor  # [max_len, D] float32: the model's tables (rounded to its dtype)
    rope_sin: torch.Tensor
    window: int  # a sliding window, or 0


def kernel_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, meta: KernelMetadata,
                           scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's, before rope), kv_cache
    [2, NB, BS, KVH, D] -> [T, H, D]. One call: rope, the cache write, attention."""
    return torch.ops.llm_cpu.paged_attention(q, k, v, kv_cache, meta.block_table,
                                             meta.token_slots, meta.positions, meta.rope_cos,
                                             meta.rope_sin, scale, meta.window)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache index that each token's K/V is written to
    decodes: list[DecodeAttention]
    prefills: list[PrefillAttention]


def build_attention_metadata(v: dict[str, torch.Tensor], decode_groups: list[DecodeGroup],
                             prefills: list[PrefillRow], block_table: torch.Tensor,
                             block_size: int, window: int | None = None) -> AttentionMetadata:
    """Device-side metadata from the unpacked step views `v` and the block table
    [slots, max_blocks]; only Python ints from the host, so nothing waits for the device.
    window: a sliding window (Mistral's): a query at position p sees keys p - window + 1 to
    p, as Hugging Face masks them."""
    positions = v["positions"]
    slot_mapping = (block_table[v["token_slots"], positions // block_size].long() * block_size
                    + positions % block_size)
    meta = AttentionMetadata(slot_mapping, [], [])
    for group in decode_groups:
        rows = slice(group.start, group.end)
        num_blocks = -(-group.max_len // block_size)
        tables = block_table[v["decode_slots"][rows], :num_blocks].long()
        keys = torch.arange(num_blocks * block_size, device=positions.device)
        lens = v["decode_lens"][rows][:, None]
        mask = keys[None, :] < lens
        if window is not None and group.max_len > window:
            mask &= keys[None, :] >= lens - window
        meta.decodes.append(DecodeAttention(v["decode_token_idx"][rows], tables,
                                            mask[:, None, None, :]))
    for row in prefills:
        qlen, clen = row.end - row.start, row.context_len
        windowed = window is not None and clen > window
        if qlen == clen and not windowed:  # no past: causal attention over the fresh keys
            meta.prefills.append(PrefillAttention(row.start, row.end, None, None, clen))
            continue
        block_row = block_table[row.slot, :-(-clen // block_size)].long()
        query_pos = torch.arange(clen - qlen, clen, device=positions.device)
        keys = torch.arange(clen, device=positions.device)
        mask = keys[None, :] <= query_pos[:, None]
        if windowed:
            mask &= keys[None, :] > query_pos[:, None] - window
        meta.prefills.append(PrefillAttention(row.start, row.end, block_row, mask[None, None],
                                              clen))
    return meta


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write this step's keys and values [T, KVH, D] at their flat cache indices, in place.
    Under torch.compile through an opaque op: as plain tensor code, the compiled graph would
    copy the whole cache to honour the mutation of its input. (Eager, the op's dispatch
    would cost milliseconds.)"""
    if torch.compiler.is_compiling():
        _write_kv_op(kv_cache, slot_mapping, k, v)
    else:
        _write_kv(kv_cache, slot_mapping, k, v)


def _write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


_write_kv_op = torch.library.custom_op("llm_pipeline::write_kv", _write_kv,
                                       mutates_args=("kv_cache",))
_write_kv_op.register_fake(lambda kv_cache, slot_mapping, k, v: None)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per row: q [B, H, D], k/v [B, KVH, L, D], mask [B, 1, 1, L] -> [B, H, D].
    Two batched matrix products with each KV head's query heads side by side (no repeated
    keys), softmax in float32. For bf16: on the CPU, SDPA's flash kernel took 4x longer
    (1.83 ms against 0.45 ms, 32 rows of 160 gathered keys); in fp32 SDPA was the faster
    (0.32 against 0.47 ms), so fp32 keeps it."""
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale  # [B, KVH, g, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(batch, heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's), kv_cache [2, NB, BS, KVH, D] -> [T, H, D]."""
    write_kv(kv_cache, meta.slot_mapping, k, v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    for group in meta.decodes:
        idx, tables = group.token_idx, group.block_tables
        batch = idx.shape[0]
        pages = tables.reshape(-1)  # index_select: 3-5x faster than k_cache[tables] here
        kd = k_cache.index_select(0, pages).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, pages).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        if q.dtype == torch.float32:
            od = F.scaled_dot_product_attention(q[idx].unsqueeze(2), kd, vd, scale=scale,
                                                attn_mask=group.mask, enable_gqa=True)
            out[idx] = od.squeeze(2)
        else:  # SDPA's CPU kernel is slow for one query in reduced precision
            out[idx] = decode_attention(q[idx], kd, vd, group.mask, scale)
    for row in meta.prefills:
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if row.block_row is None:
            kp = k[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q, D]
            vp = v[row.start:row.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=True)
        else:
            kp = k_cache.index_select(0, row.block_row).view(-1, num_kv_heads,
                                                             head_dim)[:row.context_len]
            vp = v_cache.index_select(0, row.block_row).view(-1, num_kv_heads,
                                                             head_dim)[:row.context_len]
            op = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=row.mask, scale=scale, enable_gqa=True)
        out[row.start:row.end] = op[0].transpose(0, 1)
    return out


@dataclass
class FlexMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache index that each token's K/V is written to
    query_rows: torch.Tensor  # [T] row of each token in the query blocks
    block_mask: BlockMask  # query blocks [Q] x the cache's pages


@functools.cache  # one function per page size: the compiled graph guards on its identity
def _same_page_causal(block_size: int):  # type: ignore[no-untyped-def]
    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx % block_size <= q_idx % block_size
    return mask_mod



def build_flex_metadata(v: dict[str, torch.Tensor], block_table: torch.Tensor,
                        block_size: int, num_cache_blocks: int,
                        per_row: bool = False) -> FlexMetadata:
    """Device-side metadata of the compiled attention from the unpacked step views `v`
    (tokens and query blocks, padded or not) and the block table [slots, max_blocks].

    The block mask's query blocks are the query blocks (a page of rows each), or with
    `per_row` every row of them on its own: a decode row then reads its keys once instead of
    once for each of its page's 16 rows (the CPU kernel computes every row of a block), and
    rows no token uses read nothing. Same query layout, same mask either way."""
    positions = v["positions"]
    pages_of_token = positions // block_size
    slot_mapping = (block_table[v["token_slots"], pages_of_token].long() * block_size
                    + positions % block_size)
    num_q = v["qblock_slots"].shape[0]
    # FlexAttention on the CPU wants index rows as long as the cache has pages.
    width = min(block_table.shape[1], num_cache_blocks)
    if per_row:
        rows, slots, own = v["query_rows"], v["token_slots"], pages_of_token
        num_blocks = num_q * block_size
    else:
        rows, slots, own = None, v["qblock_slots"], v["qblock_pages"]
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
    return FlexMetadata(slot_mapping, v["query_rows"], block_mask)


# On CUDA: Triton tiles of one page (the block mask's blocks are pages of 16 positions, see
# compile.CUDA_PAGE_MULTIPLE; Inductor's default tiles are 32-128 and must divide them), and
# the main kernel for short queries too (the decoding kernel's tiles are larger still).
_CUDA_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 16}


def flex_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: FlexMetadata,
                         scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's), kv_cache [2, NB, BS, KVH, D] -> [T, H, D].
    One FlexAttention call; to be run under torch.compile."""
    write_kv(kv_cache, meta.slot_mapping, k, v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_rows = meta.block_mask.seq_lengths[0]
    # [1, H, rows, D], a 4-D buffer of its own (Inductor's CPU template wants one).
    queries = q.new_zeros(1, q.shape[1], num_rows, head_dim).index_copy_(
        2, meta.query_rows, q.transpose(0, 1)[None])
    keys = k_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)  # [1, KVH, NB*BS, D]
    values = v_cache.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
    out = flex_attention(queries, keys, values, block_mask=meta.block_mask, scale=scale,
                         enable_gqa=True,
                         kernel_options=_CUDA_KERNEL_OPTIONS if q.is_cuda else None)
    return out[0].transpose(0, 1)[meta.query_rows]  # type: ignore[index]
