"""What a forward backend is, in the executor process: how a step's attention reads and writes
the paged KV cache, and which ops do a layer's elementwise work.

A backend says what it supports (`unsupported`, read by select.py), prepares only its own
host inputs (`host_inputs`: its staging fields and any host-side plan), builds its device
metadata once per step (`metadata`, from the unpacked staging views), and attends
(`attend`, once per layer, with this step's queries and keys before rope). A backend whose
steps can be replayed as CUDA graphs names their static inputs (`graph_fields`) and which
steps qualify (`graph_eligible`). The model holds its backend and calls nothing else: no
flags set on modules, no metadata types tested in the forward.

The cache of a layer is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token at
position p of a sequence lives in block block_table[p // block_size] at offset p % block_size,
in the block table of the layer's KV group (EngineLimits.kv_windows; LayerAttention.table):
a model whose windowed layers sit beside layers that read every key has several, over one pool
of blocks (the layers at the same place in each group share a cache tensor: kv_pool.py).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ipc.arch import ArchSpec, AttentionKind, UnsupportedModel
from ipc.config import EngineLimits
from stages.executor.staging import DeviceStep, StagedFields


def scale_by_rms(x: torch.Tensor, mean_square: torch.Tensor, weight: torch.Tensor,
                 eps: float, offset: bool = False) -> torch.Tensor:
    """x [T, n] scaled by 1 / sqrt(mean_square [T, 1] (float32) + eps) and by the weight,
    rounded as ForwardOps.rms_norm: that norm when mean_square is x's own, and a slice of a
    wider one's when it is the whole width's (a q/k norm split across ranks, blocks.py)."""
    dtype = x.dtype
    x = x.float() * torch.rsqrt(mean_square + eps)
    if offset:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


class ForwardOps:
    """A layer's elementwise work in PyTorch ops (any device, eager or compiled); a backend
    with fused kernels overrides them. Rounding follows Hugging Face's modules."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool = False) -> torch.Tensor:
        """offset: Gemma's norm, weights stored as w - 1: x scaled by 1 + w in float32 and
        rounded once (Llama's rounds x, then scales it in its dtype)."""
        return scale_by_rms(x, x.float().pow(2).mean(-1, keepdim=True), weight, eps, offset)

    def add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, rms_norm(x + h)): the residual stream after a block, and its norm."""
        x = x + h
        return x, self.rms_norm(x, weight, eps, offset)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after a block (a new tensor: a compiled layer must not mutate
        its input)."""
        return x + h

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def act_and_mul(self, activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gated MLP's op for an ArchSpec.activation."""
        return {"silu": self.silu_and_mul, "gelu_tanh": self.gelu_tanh_and_mul}[activation]


TORCH_OPS = ForwardOps()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] at positions whose tables are cos/sin [T, 1, D]."""
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class StepRows:
    """A step's rows as the host knows them: what a backend plans its inputs from."""

    query_lens: np.ndarray  # [R] tokens computed this step
    context_lens: np.ndarray  # [R] KV length after it
    slots: np.ndarray  # [R]
    starts: np.ndarray  # [R] first token of each row in the flattened batch
    forward: dict[str, np.ndarray]  # the ForwardFields (input_ids, positions, token_slots)

    @property
    def ends(self) -> np.ndarray:
        return self.starts + self.query_lens

    @functools.cached_property  # (a backend's host_inputs asks; made once a step)
    def decode_only(self) -> bool:
        """Every row has one query token: a steady decode's step, which backends lay out
        in fewer calls."""
        return bool((self.query_lens == 1).all())


@dataclass(frozen=True)
class HostInputs:
    arrays: dict[str, np.ndarray]  # the backend's staging fields (a padded forward: its own)
    plan: Any = None  # what the backend's metadata needs from the host (Python values)


@dataclass(frozen=True)
class ForwardTables:
    """The runner's device state a backend's metadata reads; it never moves."""

    # per KV group: [slots + 1, max_blocks] int32 (the last row: padding's)
    block_tables: Sequence[torch.Tensor]
    # (cos, sin) [max_len, D] in the model's dtype, one pair per rope kind of the layers
    # (LayerAttention.rope indexes them)
    ropes: Sequence[tuple[torch.Tensor, torch.Tensor]]
    num_cache_blocks: int  # blocks of each layer's cache, a scratch block included

    @property
    def block_table(self) -> torch.Tensor:
        """The first KV group's (every layer's, or the layers that read every key)."""
        return self.block_tables[0]


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends (its spec's AttentionKind, resolved for the backend)."""

    scale: float  # of the scores (head_dim ** -0.5, or the family's query scale)
    window: int | None = None  # a query at p sees keys p - window + 1 to p
    softcap: float | None = None  # scores through cap * tanh(score / cap)
    rope: int | None = 0  # which of ForwardTables.ropes; None: no rope
    # a learned logit per head joins each softmax's denominator (gpt-oss): `attend` takes
    # them as its `sinks` [H] (the attention module's parameter, this rank's heads)
    sinks: bool = False
    table: int = 0  # its KV group (ForwardTables.block_tables; AttentionBackend.kv_places)


class AttentionBackend(ABC):
    """One way of running the forward's attention over the paged cache (see the module's
    docstring). An instance serves one runner: `bind` hands it the runner's tables."""

    name: ClassVar[str]
    ops: ClassVar[ForwardOps] = TORCH_OPS
    # A compiled forward (compile.py compiles the layers): steps padded to its buckets,
    # padding tokens belong to slot max_num_seqs, whose block table row points at a scratch
    # block of the cache.
    compiled: ClassVar[bool] = False
    staging_fields: ClassVar[type[StagedFields]] = StagedFields  # (none)
    graph_fields: ClassVar[Sequence[str]] = ()  # a replayed graph's static inputs; () none
    softcap: ClassVar[bool] = False  # implements LayerAttention.softcap (Gemma 2)
    sinks: ClassVar[bool] = False  # implements LayerAttention.sinks (gpt-oss)

    def __init__(self, limits: EngineLimits, device: torch.device,
                 windows: Sequence[int] = ()) -> None:
        """windows: the distinct sliding windows of the model's layers (ArchSpec.windows)."""
        self.limits, self.device, self.windows = limits, device, tuple(windows)
        self._tables: ForwardTables | None = None
        # (KV group, window) of the layers: the block tables and windows a step's metadata
        # serves; each group's own window, and any other one a layer has (layer_attention)
        self.attentions: set[tuple[int, int | None]] = (
            {(0, w) for w in (None, *self.windows)} if len(limits.kv_windows) == 1
            else set(enumerate(limits.kv_windows)))

    @staticmethod
    def rope_keys(spec: ArchSpec) -> list[str]:
        """The rope kinds of the model's layers, in the order of ForwardTables.ropes."""
        return sorted({k.rope for k in spec.layers if k.rope is not None})

    def layer_attention(self, spec: ArchSpec, layer_idx: int) -> LayerAttention:
        """Layer `layer_idx`'s attention, or UnsupportedModel naming what this backend
        lacks (`unsupported`)."""
        kind = spec.layers[layer_idx]
        why = self.unsupported(kind)
        if why is not None:
            raise UnsupportedModel(f"{spec.family}: layer {layer_idx}: {why} on the "
                                   f"{self.name} forward")
        keys = self.rope_keys(spec)
        attention = LayerAttention(spec.scale, kind.window, kind.softcap,
                                   None if kind.rope is None else keys.index(kind.rope),
                                   kind.sinks, self.kv_places(spec)[layer_idx][0])
        self.attentions.add((attention.table, attention.window))
        return attention

    def kv_places(self, spec: ArchSpec) -> list[tuple[int, int]]:
        """Each layer's (KV group, place) in this run (ArchSpec.kv_places: the groups of
        EngineLimits.kv_windows, one group where it has one)."""
        return spec.kv_places(len(self.limits.kv_windows) > 1)

    def unsupported(self, kind: AttentionKind) -> str | None:
        """What of a layer's attention this backend does not implement (None: all of it).
        (Softcapping and sinks: a backend that implements them says so, `softcap`, `sinks`.)"""
        if kind.softcap is not None and not self.softcap:
            return "attention softcapping is not implemented"
        if kind.sinks and not self.sinks:
            return "attention sinks are not implemented"
        return None

    @property
    def scratch_blocks(self) -> int:
        """KV blocks beyond the usable ones: where padding tokens write."""
        return 1 if self.compiled else 0

    def bind(self, tables: ForwardTables) -> None:
        self._tables = tables

    @property
    def tables(self) -> ForwardTables:
        assert self._tables is not None, "bind() the runner's tables first"
        return self._tables

    def host_inputs(self, rows: StepRows) -> HostInputs:
        """This backend's staging arrays for a step (the ForwardFields may be replaced, e.g.
        padded), and its host-side plan; only numpy, no device work."""
        return HostInputs({})

    @abstractmethod
    def metadata(self, v: DeviceStep, plan: Any) -> Any:
        """The step's device-side metadata from its unpacked staging views `v` and the
        host plan; only Python values from the host, so nothing waits for the device."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: Any, layer: LayerAttention,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (this step's, before rope), kv_cache
        [2, NB, BS, KVH, D] -> [T, H, D]: rope, the cache write, attention, as `layer`
        says. `sinks` [H] (float, with `layer.sinks` only): each head's logit in the
        softmax's denominator, dropped from its weights."""

    def graph_eligible(self, decode_only: bool, num_prompt_logprobs: int) -> bool:
        """Whether a step may be replayed as a graph (only with `graph_fields`)."""
        return False

    def graph_plan(self) -> Any:
        """The host plan of a replayed step (the replay cannot take one per step)."""
        return None


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


def slot_mapping(block_table: torch.Tensor, token_slots: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[T] the flat cache index each token's key and value are written to."""
    return (block_table[token_slots, positions // block_size].long() * block_size
            + positions % block_size)
