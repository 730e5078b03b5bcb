"""Attention over the paged KV cache for a flattened mixed batch. Runs in the executor process.

Rows with one query token (decodes) are attended together in one batched call; rows with
several (prefill chunks) one by one. The cache of a layer is [2, num_blocks, block_size,
num_kv_heads, head_dim]; a token at position p of a sequence lives in block
block_table[p // block_size] at offset p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillRow:
    start: int  # first token of the row in the flattened batch
    end: int
    block_row: torch.Tensor | None  # [num_blocks] blocks of the whole context; None: no past
    mask: torch.Tensor | None  # [1, 1, query_len, context_len] bool, with past only
    context_len: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache index that each token's K/V is written to
    decode_token_idx: torch.Tensor | None  # [B]
    decode_block_tables: torch.Tensor | None  # [B, nb]
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool
    prefills: list[PrefillRow]


@dataclass
class StepTensors:
    """Everything the model needs for one step, on the device."""

    positions: torch.Tensor  # [T]
    token_slots: torch.Tensor  # [T] executor slot of each token
    logits_indices: torch.Tensor  # [S_sampled]
    sample_slots: torch.Tensor  # [S_sampled]
    meta: AttentionMetadata


def build_step_tensors(query_len: np.ndarray, context_len: np.ndarray, seq_slot: np.ndarray,
                       do_sample: np.ndarray, block_table: torch.Tensor, block_size: int,
                       device: torch.device) -> StepTensors:
    """From the step's host rows (numpy, [S] each) and the device block table [slots, max_nb]."""
    q = query_len.astype(np.int64)
    ctx = context_len.astype(np.int64)
    ends = np.cumsum(q)
    starts = ends - q
    num_tokens = int(ends[-1])
    offsets = np.arange(num_tokens) - np.repeat(starts, q)
    positions_np = np.repeat(ctx - q, q) + offsets
    positions = torch.from_numpy(positions_np).to(device, non_blocking=True)
    token_slots = torch.from_numpy(np.repeat(seq_slot.astype(np.int64), q)).to(device)
    slot_mapping = (block_table[token_slots, positions // block_size].long() * block_size
                    + positions % block_size)
    sampled = np.flatnonzero(do_sample)
    logits_indices = torch.from_numpy(ends[sampled] - 1).to(device)
    sample_slots = torch.from_numpy(seq_slot[sampled].astype(np.int64)).to(device)
    meta = AttentionMetadata(slot_mapping, None, None, None, [])
    _add_decodes(meta, q, ctx, starts, seq_slot, block_table, block_size, device)
    _add_prefills(meta, q, ctx, starts, seq_slot, block_table, block_size, device)
    return StepTensors(positions, token_slots, logits_indices, sample_slots, meta)


def _add_decodes(meta: AttentionMetadata, q: np.ndarray, ctx: np.ndarray, starts: np.ndarray,
                 seq_slot: np.ndarray, block_table: torch.Tensor, block_size: int,
                 device: torch.device) -> None:
    rows = np.flatnonzero(q == 1)
    if not len(rows):
        return
    num_blocks = int(-(-ctx[rows].max() // block_size))
    slots = torch.from_numpy(seq_slot[rows].astype(np.int64)).to(device)
    meta.decode_token_idx = torch.from_numpy(starts[rows]).to(device)
    meta.decode_block_tables = block_table[slots, :num_blocks].long()
    lens = torch.from_numpy(ctx[rows]).to(device)
    keys = torch.arange(num_blocks * block_size, device=device)
    meta.decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]


def _add_prefills(meta: AttentionMetadata, q: np.ndarray, ctx: np.ndarray, starts: np.ndarray,
                  seq_slot: np.ndarray, block_table: torch.Tensor, block_size: int,
                  device: torch.device) -> None:
    for row in np.flatnonzero(q > 1):
        start, qlen, clen = int(starts[row]), int(q[row]), int(ctx[row])
        if qlen == clen:
            meta.prefills.append(PrefillRow(start, start + qlen, None, None, clen))
            continue
        num_blocks = -(-clen // block_size)
        block_row = block_table[int(seq_slot[row]), :num_blocks].long()
        query_pos = torch.arange(clen - qlen, clen, device=device)
        keys = torch.arange(clen, device=device)
        mask = (keys[None, :] <= query_pos[:, None])[None, None]
        meta.prefills.append(PrefillRow(start, start + qlen, block_row, mask, clen))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's), kv_cache [2, NB, BS, KVH, D] -> [T, H, D]."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.decode_token_idx is not None:
        idx, tables = meta.decode_token_idx, meta.decode_block_tables
        batch = idx.shape[0]
        kd = k_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[tables].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[idx].unsqueeze(2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
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
