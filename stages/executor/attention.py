"""Attention over the paged KV cache for a flattened mixed batch. Runs in the executor process.

Rows with one query token (decodes) are attended in batched calls, grouped by context length
so that padding at most doubles the keys read; rows with several (prefill chunks) one by one.
The cache of a layer is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token at
position p of a sequence lives in block block_table[p // block_size] at offset p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache index that each token's K/V is written to
    decodes: list[DecodeAttention]
    prefills: list[PrefillAttention]


def build_attention_metadata(v: dict[str, torch.Tensor], decode_groups: list[DecodeGroup],
                             prefills: list[PrefillRow], block_table: torch.Tensor,
                             block_size: int) -> AttentionMetadata:
    """Device-side metadata from the unpacked step views `v` and the block table
    [slots, max_blocks]; only Python ints from the host, so nothing waits for the device."""
    positions = v["positions"]
    slot_mapping = (block_table[v["token_slots"], positions // block_size].long() * block_size
                    + positions % block_size)
    meta = AttentionMetadata(slot_mapping, [], [])
    for group in decode_groups:
        rows = slice(group.start, group.end)
        num_blocks = -(-group.max_len // block_size)
        tables = block_table[v["decode_slots"][rows], :num_blocks].long()
        keys = torch.arange(num_blocks * block_size, device=positions.device)
        mask = (keys[None, :] < v["decode_lens"][rows][:, None])[:, None, None, :]
        meta.decodes.append(DecodeAttention(v["decode_token_idx"][rows], tables, mask))
    for row in prefills:
        qlen, clen = row.end - row.start, row.context_len
        if qlen == clen:  # no past: causal attention over the fresh keys
            meta.prefills.append(PrefillAttention(row.start, row.end, None, None, clen))
            continue
        block_row = block_table[row.slot, :-(-clen // block_size)].long()
        query_pos = torch.arange(clen - qlen, clen, device=positions.device)
        keys = torch.arange(clen, device=positions.device)
        mask = (keys[None, :] <= query_pos[:, None])[None, None]
        meta.prefills.append(PrefillAttention(row.start, row.end, block_row, mask, clen))
    return meta


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's), kv_cache [2, NB, BS, KVH, D] -> [T, H, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for group in meta.decodes:
        idx, tables = group.token_idx, group.block_tables
        batch = idx.shape[0]
        kd = k_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[idx].unsqueeze(2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask,
                                            scale=scale, enable_gqa=True)
        out[idx] = od.squeeze(2)
    for row in meta.prefills:
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if row.block_row is None:
            kp = k[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q, D]
            vp = v[row.start:row.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=True)
        else:
            kp = k_cache[row.block_row].view(-1, num_kv_heads, head_dim)[:row.context_len]
            vp = v_cache[row.block_row].view(-1, num_kv_heads, head_dim)[:row.context_len]
            op = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=row.mask, scale=scale, enable_gqa=True)
        out[row.start:row.end] = op[0].transpose(0, 1)
    return out
