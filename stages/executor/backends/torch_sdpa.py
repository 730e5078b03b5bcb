"""Attention in eager PyTorch ops, in the executor process: CUDA without compile, or a CPU
without the C++ kernels. Rows with one query token (decodes) attend in batched SDPA calls,
grouped by context length so that padding at most doubles the keys read; rows with several
(prefill chunks) one by one, over keys gathered from the cache. Layers with a softcap (Gemma 2)
or attention sinks (gpt-oss) attend by explicit scores instead (SDPA has neither)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stages.executor.backends.base import (
    AttentionBackend,
    HostInputs,
    LayerAttention,
    StepRows,
    apply_rope,
    slot_mapping,
    write_kv,
)
from stages.executor.staging import DeviceStep, Staged, StagedFields, per_seq


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) of the (length-sorted) decode arrays, attended in one call
    with keys padded to max_len."""

    start: int
    end: int
    max_len: int


def group_by_length(lens: np.ndarray, max_ratio: float = 2.0) -> list[DecodeGroup]:
    """Split ascending context lengths into runs whose longest is at most max_ratio times
    their shortest, so padding never more than doubles the keys a group reads."""
    if not len(lens):
        return []
    if lens[-1] <= max_ratio * max(lens[0], 16):  # the common case: one group
        return [DecodeGroup(0, len(lens), int(lens[-1]))]
    values = lens.tolist()  # Python ints: a loop over numpy scalars costs ~1 us a row
    groups, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] > max_ratio * max(values[start], 16):
            groups.append(DecodeGroup(start, i, values[i - 1]))
            start = i
    return groups


@dataclass(frozen=True)
class PrefillRow:
    start: int  # first token of the row in the flattened batch
    end: int
    slot: int
    context_len: int  # KV length after this step


@dataclass(frozen=True)
class TorchPlan:
    """The host side of a step: decode rows by length, prefill rows one by one."""

    decode_groups: list[DecodeGroup]
    prefills: list[PrefillRow]


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


@dataclass
class TorchMetadata:
    """A step's attention metadata for each KV group and window of the model's layers (None:
    no window), and each rope table at every token's position ([T, 1, D] cos and sin)."""

    by_window: dict[tuple[int, int | None], AttentionMetadata]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]


def build_attention_metadata(v: DeviceStep, decode_groups: list[DecodeGroup],
                             prefills: list[PrefillRow], block_table: torch.Tensor,
                             block_size: int, window: int | None = None) -> AttentionMetadata:
    """Device-side metadata from the unpacked step views `v` and the block table
    [slots, max_blocks]. window: a sliding window (Mistral's): a query at position p sees
    keys p - window + 1 to p, as Hugging Face masks them."""
    positions, decodes = v.positions, TorchFields(v.views)
    meta = AttentionMetadata(slot_mapping(block_table, v.token_slots, positions, block_size),
                             [], [])
    for group in decode_groups:
        rows = slice(group.start, group.end)
        num_blocks = -(-group.max_len // block_size)
        tables = block_table[decodes.decode_slots[rows], :num_blocks].long()
        keys = torch.arange(num_blocks * block_size, device=positions.device)
        lens = decodes.decode_lens[rows][:, None]
        mask = keys[None, :] < lens
        if window is not None and group.max_len > window:
            mask &= keys[None, :] >= lens - window
        meta.decodes.append(DecodeAttention(decodes.decode_token_idx[rows], tables,
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


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, q, D], k/v [B, KVH, L, D], mask [B or 1, 1, q, L] bool -> [B, H, q, D], by
    explicit scores: through softcap * tanh(score / softcap) before the mask (Gemma 2's), and
    with each head's sink logit (sinks [H]) a column of the scores for the softmax, dropped
    from its weights (gpt-oss's); transformers' eager attention of each, in its order of
    roundings."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    weights = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA over q [B, H, q, D], k/v [B, KVH, L, D] (mask None: causal), or by explicit
    scores with a softcap or sinks."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return explicit_attention(q, k, v, mask, scale, softcap, sinks)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's, roped), kv_cache [2, NB, BS, KVH, D]
    -> [T, H, D]; sinks [H]: each head's sink logit."""
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
        if q.dtype == torch.float32 or softcap is not None or sinks is not None:
            out[idx] = _attend(q[idx].unsqueeze(2), kd, vd, group.mask, scale, softcap,
                               sinks).squeeze(2)
        else:  # SDPA's CPU kernel is slow for one query in reduced precision
            out[idx] = decode_attention(q[idx], kd, vd, group.mask, scale)
    for row in meta.prefills:
        qp = q[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if row.block_row is None:
            kp = k[row.start:row.end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q, D]
            vp = v[row.start:row.end].transpose(0, 1).unsqueeze(0)
            op = _attend(qp, kp, vp, None, scale, softcap, sinks)
        else:
            kp = k_cache.index_select(0, row.block_row).view(-1, num_kv_heads,
                                                             head_dim)[:row.context_len]
            vp = v_cache.index_select(0, row.block_row).view(-1, num_kv_heads,
                                                             head_dim)[:row.context_len]
            op = _attend(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                         row.mask, scale, softcap, sinks)
        out[row.start:row.end] = op[0].transpose(0, 1)
    return out


class TorchFields(StagedFields):
    """This backend's packed fields: B decode rows, ordered by context length."""

    decode_token_idx = Staged("int64", per_seq)
    decode_slots = Staged("int64", per_seq)
    decode_lens = Staged("int64", per_seq)


class TorchBackend(AttentionBackend):
    """Eager PyTorch attention: any device, any model the engine loads."""

    name = "torch"
    staging_fields = TorchFields
    softcap = True
    sinks = True

    def host_inputs(self, rows: StepRows) -> HostInputs:
        q, ctx, slots, starts = rows.query_lens, rows.context_lens, rows.slots, rows.starts
        prefills = []
        if rows.decode_only:  # (the steady state: every row decodes)
            decode = np.argsort(ctx, kind="stable")
        else:
            decode = np.flatnonzero(q == 1)
            decode = decode[np.argsort(ctx[decode], kind="stable")]
            prefill = np.flatnonzero(q > 1)
            prefills = [PrefillRow(*row) for row in zip(  # (Python ints, from a list each)
                starts[prefill].tolist(), rows.ends[prefill].tolist(), slots[prefill].tolist(),
                ctx[prefill].tolist(), strict=True)]
        decode_lens = ctx[decode]
        arrays = {"decode_token_idx": starts[decode], "decode_slots": slots[decode],
                  "decode_lens": decode_lens}
        return HostInputs(arrays, TorchPlan(group_by_length(decode_lens), prefills))

    def metadata(self, v: DeviceStep, plan: TorchPlan) -> TorchMetadata:
        t = self.tables
        by_window = {(table, window): build_attention_metadata(
            v, plan.decode_groups, plan.prefills, t.block_tables[table], self.limits.block_size,
            window) for table, window in self.attentions}
        ropes = [(cos[v.positions].unsqueeze(1), sin[v.positions].unsqueeze(1))
                 for cos, sin in t.ropes]  # [T, 1, D]
        return TorchMetadata(by_window, ropes)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: TorchMetadata,
               layer: LayerAttention, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if layer.rope is not None:
            cos, sin = meta.ropes[layer.rope]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return paged_attention(q, k, v, kv_cache, meta.by_window[layer.table, layer.window],
                               layer.scale,
                               layer.softcap, sinks)
