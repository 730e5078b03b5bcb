"""LoRA adapters in the forward, in the executor process: several adapters and the base model
in one batch, without merged copies of the weights.

Each projection of a decoder layer runs its base product once over every row of the step
(its own linear method, any format), then the adapters' products, with the scale folded into
B at load. With the CPU kernels (float32, bf16): one call per projection,
torch.ops.llm_cpu.lora_add (csrc/lora_products.cpp), which gives each token only its own
adapter's products, part by part (vLLM's punica/SGMV on the CPU). Without them, in torch: one
adapter's rows alone, y += (x @ A^T) @ B^T; a mix, the projection's adapters stacked and each
token's other columns masked out (LoraState.add_deltas). A fused projection (q/k/v, gate/up)
holds one (A, B) pair per adapter: the parts' A stacked [sum r, in] and their B as a
block-diagonal [out, sum r] (a part the adapter does not target: zero rows), so one pair of
torch products serves every part; the kernel reads each part's block alone (`parts`).

Which rows take which adapter is the step's (`StepAdapters`, made by prepare from the step's
per-row adapter ids); the model's `LoraState` holds it for the forward, as vLLM's punica
wrapper does, since a projection has no other way to see the rows' adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ipc.lora import ENTRY, AdapterSpec, read_adapter
from ipc.messages import LoraLoad
from stages.executor.linear.amx import GATE_BLOCK
from stages.executor.linear.base import Linear, LinearMethod

logger = logging.getLogger(__name__)

# Which of a decoder layer's projections holds each adapter target, and which of its parts
# (CausalLM's fused layers: blocks.py)
PROJECTIONS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
               "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
               "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
               "down_proj": ("mlp.down_proj", 0)}


class LoraWeights(NamedTuple):
    """One adapter's pair for one projection: a [R, in] and b [out, R], b scaled; `parts`,
    where b is a fused projection's block-diagonal: each part's (first column of a, its
    rank, first output, end of its outputs). Empty: one part, every column and output."""

    a: torch.Tensor
    b: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...] = ()

    def blocks(self) -> tuple[tuple[int, int, int, int], ...]:
        return self.parts or ((0, self.a.shape[0], 0, self.b.shape[0]),)


@dataclass(frozen=True)
class StepAdapters:
    """A step's rows by adapter: each token's adapter id (`token_adapter` [T], 0 the base
    model's), the one adapter of every token where there is one (`only`, else None), the
    adapted tokens grouped by adapter for the kernel (`rows` int32 [n]; `groups` int64 [G, 3]:
    adapter, begin, end of rows), and the torch path's column masks, made once per layout of
    stacked adapters (`masks`)."""

    token_adapter: torch.Tensor
    only: int | None
    rows: torch.Tensor
    groups: torch.Tensor
    masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = field(default_factory=dict,
                                                                    compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_adapter.shape[0])

    def mask(self, stack: Stacked, dtype: torch.dtype) -> torch.Tensor:
        """[T, C]: 1 where column c of `stack` is the adapter of token t's row, else 0."""
        mask = self.masks.get(stack.layout)
        if mask is None:
            mask = (self.token_adapter[:, None] == stack.owner[None, :]).to(dtype)
            self.masks[stack.layout] = mask
        return mask

    def select(self, keep: torch.Tensor) -> StepAdapters:
        """The StepAdapters of the tokens `keep` (their order): the rows of the last layer's
        output projection and MLP, where the forward trims it (CausalLM.hidden_states)."""
        return _grouped(self.token_adapter[keep].numpy())


def step_adapters(adapter_id: np.ndarray, query_len: np.ndarray) -> StepAdapters | None:
    """The step's StepAdapters from its rows' adapter ids and query lengths; None where every
    row is the base model's (the common case: one check)."""
    if not adapter_id.any():
        return None
    return _grouped(np.repeat(adapter_id.astype(np.int64), query_len))


def _grouped(per_token: np.ndarray) -> StepAdapters:
    """StepAdapters of tokens whose adapter ids (int64) are `per_token`."""
    first = int(per_token[0]) if len(per_token) else 0
    only = first if (per_token == first).all() else None
    order = np.argsort(per_token, kind="stable")
    order = order[per_token[order] != 0]
    ids, begins, counts = np.unique(per_token[order], return_index=True, return_counts=True)
    groups = np.stack([ids, begins, begins + counts], axis=1).astype(np.int64)
    return StepAdapters(torch.from_numpy(per_token), only,
                        torch.from_numpy(order.astype(np.int32)), torch.from_numpy(groups))


class Packed(NamedTuple):
    """A projection's adapters as the kernel reads them: a (each adapter's A transposed,
    [in, its columns rounded up to 16], flat), b (each part's B block transposed, [rank, its
    outputs], flat), parts int64 [P, 9] (adapter, its offset in a, its width there, first
    column, rank, first output, outputs, offset in b, and the stride of its chunks of 16
    outputs: 16, or 32 for a fused gate/up product's interleaved gate and up). With bf16 pairs
    (LoraState.pairs), a and each B block hold their rows two by two, each value beside the
    next row's ([rows / 2, columns, 2], an odd count padded with a zero row), as AVX512-BF16's
    pair products read them (csrc/lora_products.cpp)."""

    a: torch.Tensor
    b: torch.Tensor
    parts: torch.Tensor
    made_from: tuple[tuple[int, LoraWeights], ...]  # (held: their ids stay theirs)


class Stacked(NamedTuple):
    """A projection's adapters side by side: a [C, in] (their A's stacked), b [out, C] (their
    B's), owner [C] (each column's adapter id), layout ((adapter, its columns), ...)."""

    a: torch.Tensor
    b: torch.Tensor
    owner: torch.Tensor
    layout: tuple[tuple[int, int], ...]
    made_from: tuple[tuple[int, LoraWeights], ...]  # (held: their ids stay theirs)


@dataclass
class LoraState:
    """The model's adapters: each adapted projection's weights by adapter id (`weights`, by
    the layer), and the step the forward runs (`step`, set by the runner before each
    forward; None: the base model alone)."""

    max_loras: int
    max_rank: int = 16
    kernel: bool = False  # torch.ops.llm_cpu.lora_add (the CPU kernels are loaded)
    pairs: bool = False  # the kernel's bf16 pairs (AVX512-BF16: Packed)
    step: StepAdapters | None = None
    kept: StepAdapters | None = None  # the step's trimmed rows (StepAdapters.select)
    loaded: dict[int, AdapterSpec] = field(default_factory=dict)
    weights: dict[Linear, dict[int, LoraWeights]] = field(default_factory=dict)
    # made from `weights`, as steps need them
    stacks: dict[Linear, Stacked] = field(default_factory=dict)
    packs: dict[Linear, Packed] = field(default_factory=dict)

    def unload(self, adapter: int) -> None:
        """Drop adapter `adapter`'s weights (its id is not used again: adapters.py)."""
        for pairs in self.weights.values():
            pairs.pop(adapter, None)
        self.stacks.clear()  # (made again as steps need them, without its weights)
        self.packs.clear()
        spec = self.loaded.pop(adapter, None)
        if spec is not None:
            logger.info("LoRA adapter %r (adapter %d) evicted", spec.name, adapter)

    def swap(self, layers: torch.nn.ModuleList, dtype: torch.dtype, loads: list[LoraLoad],
             evictions: list[int]) -> None:
        """A step's runtime adapters (StepPlan.lora_loads, stages/scheduler/adapters.py):
        `evictions` dropped, then each of `loads` read from its folder, before the forward
        that needs it. The server checked each folder when it was loaded (read_adapter);
        it is checked again here, and a folder that changed since then raises."""
        for adapter in evictions:
            self.unload(adapter)
        for load in loads:
            spec = read_adapter(load.name, load.path, self.max_rank, len(layers))
            load_adapter(layers, self, load.adapter_id, spec, dtype)

    def add_deltas(self, layer: Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base product of x [T, in]) plus each row's adapter's product. With
        the kernel: one call, each token its own adapter's parts alone. In torch, a step of
        one adapter's rows alone: its pair, on every row; else the projection's adapters
        stacked, in two products over every row, the columns of other rows' adapters masked
        out: three calls however many adapters the step mixes, for products over every
        resident adapter's columns (docs/BENCHMARKS.md counts what that costs)."""
        step = self._rows_of(x)
        if step is None:
            return y
        weights = self.weights.get(layer)
        if not weights:
            return y
        if self.kernel:
            pack = self._pack(layer, weights)
            torch.ops.llm_cpu.lora_add(y, x, step.rows, step.groups, *pack[:3], self.pairs)
            return y
        if step.only is not None:
            w = weights.get(step.only)
            if w is not None:  # (None: this adapter does not target this projection)
                y.addmm_(x @ w.a.T, w.b.T)
            return y
        stack = self._stack(layer, weights)
        y.addmm_((x @ stack.a.T).mul_(step.mask(stack, x.dtype)), stack.b.T)
        return y

    def adapts(self, layer: Linear) -> bool:
        """Whether this step adds any adapter's products to `layer`'s outputs."""
        return self.step is not None and bool(self.weights.get(layer))

    def _rows_of(self, x: torch.Tensor) -> StepAdapters | None:
        """The step's StepAdapters for the rows x holds: the step's, or past the last layer's
        attention where it is trimmed, its kept rows' (None: the base model alone)."""
        step = self.step
        if step is None or x.shape[0] == step.num_tokens:
            return step
        if self.kept is None or x.shape[0] != self.kept.num_tokens:
            raise RuntimeError(f"LoRA: {x.shape[0]} rows where the step has {step.num_tokens}")
        return self.kept

    def _pack(self, layer: Linear, weights: dict[int, LoraWeights]) -> Packed:
        """The layer's Packed, made again when its adapters changed (a load or unload)."""
        pack = self.packs.get(layer)
        if pack is not None and _made_from(pack.made_from, weights):
            return pack
        pairs = sorted(weights.items(), key=lambda pair: pair[0])
        a_blocks, b_blocks, rows, a_offset, b_offset = [], [], [], 0, 0
        for adapter, w in pairs:
            columns, inputs = w.a.shape
            width = -(-columns // 16) * 16  # (the kernel's vectors of 16 columns)
            at = w.a.new_zeros(inputs, width)
            at[:, :columns] = w.a.T
            at = _as_pairs(at) if self.pairs else at
            a_blocks.append(at.reshape(-1))
            for c0, rank, o0, o1 in w.blocks():
                block = w.b[o0:o1, c0:c0 + rank].T
                block = (_as_pairs(block) if self.pairs else block).contiguous().reshape(-1)
                b_blocks.append(block)
                first, stride = o0, 16
                if getattr(layer, "fused_gate", False):  # (amx.py interleave_gate_up)
                    first, stride = (0 if o0 < layer.out_features // 2 else GATE_BLOCK), 32
                rows.append((adapter, a_offset, width, c0, rank, first, o1 - o0, b_offset,
                             stride))
                b_offset += block.numel()
            a_offset += at.numel()
        pack = Packed(torch.cat(a_blocks), torch.cat(b_blocks),
                      torch.tensor(rows, dtype=torch.int64), tuple(pairs))
        self.packs[layer] = pack
        return pack

    def _stack(self, layer: Linear, weights: dict[int, LoraWeights]) -> Stacked:
        """The layer's Stacked, made again when its adapters changed (a load or unload)."""
        stack = self.stacks.get(layer)
        if stack is None or not _made_from(stack.made_from, weights):
            pairs = sorted(weights.items(), key=lambda pair: pair[0])
            layout = tuple((a, w.a.shape[0]) for a, w in pairs)
            owner = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in layout])
            stack = Stacked(torch.cat([w.a for _, w in pairs]).contiguous(),
                            torch.cat([w.b for _, w in pairs], dim=1).contiguous(),
                            owner.to(pairs[0][1].a.device), layout, tuple(pairs))
            self.stacks[layer] = stack
        return stack


def _made_from(made_from: tuple[tuple[int, LoraWeights], ...],
               weights: dict[int, LoraWeights]) -> bool:
    """Whether a layer's Packed or Stacked was made from exactly its adapters now (each
    projection asks, every step: a few dict lookups, no sort)."""
    return len(made_from) == len(weights) and all(weights.get(a) is w for a, w in made_from)


def _as_pairs(m: torch.Tensor) -> torch.Tensor:
    """[R, C] as [ceil(R / 2), C, 2]: rows 2i and 2i + 1 side by side (R odd: a zero row)."""
    if m.shape[0] % 2:
        m = torch.cat([m, m.new_zeros(1, m.shape[1])])
    return m.reshape(m.shape[0] // 2, 2, m.shape[1]).transpose(1, 2).contiguous()


class LoraMethod(LinearMethod):
    """A layer's own format (`base`) plus the adapters' products (LoraState.add_deltas). The
    head keeps the base format alone (adapters of the head are refused: ipc/lora.py)."""

    def __init__(self, base: LinearMethod, state: LoraState) -> None:
        self.base, self.state = base, state
        self.name = f"{base.name}+lora"
        self.takes_blocks = base.takes_blocks

    def process(self, layer: Linear) -> None:
        if not self.state.kernel:  # (torch's products add to gate and up in their own order)
            layer.gated = False
        self.base.process(layer)
        if layer.method is not self:  # (the base format handed the layer on: OneDnn's take)
            layer.method = LoraMethod(layer.method, self.state)

    def for_head(self) -> LinearMethod:
        return self.base.for_head()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.state.add_deltas(layer, x, self.base.apply(layer, x))

    def apply_gated(self, layer: Linear, x: torch.Tensor,
                    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A fused gate/up product (bf16's packed forms: amx.py; quantized products widened
        on AMX: quantized.py) keeps its fused activation where the step adds no adapter
        here; else its gate and up columns come interleaved
        (16 of each in turn), the kernel adds each token's adapter to them in that order,
        and the activation reads them so (silu_and_mul's `interleaved`: fused gates are
        silu's, blocks.py)."""
        if not getattr(layer, "fused_gate", False):
            return silu_and_mul(self.apply(layer, x))
        if not self.state.adapts(layer):
            return self.base.apply_gated(layer, x, silu_and_mul)
        y = self.state.add_deltas(layer, x, self.base.apply_interleaved(layer, x))
        return torch.ops.llm_cpu.silu_and_mul(y, True)  # type: ignore[no-any-return]


def load_adapter(layers: torch.nn.ModuleList, state: LoraState, adapter: int,
                 spec: AdapterSpec, dtype: torch.dtype) -> None:
    """Adapter `spec`'s weights, in `dtype`, for every projection of the decoder `layers` it
    targets, into `state` under id `adapter`."""
    from safetensors import safe_open

    if adapter < 1 or (adapter not in state.loaded and len(state.loaded) >= state.max_loras):
        raise ValueError(f"adapter id {adapter}: {len(state.loaded)} adapters of "
                         f"{state.max_loras} loaded")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(f"{spec.path}/adapter_model.safetensors", "pt") as f:
        for entry in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            match = ENTRY.fullmatch(entry)
            assert match is not None  # (read_adapter checked every entry)
            key = (int(match.group(1)), match.group(3))
            pairs.setdefault(key, {})[match.group(4)] = f.get_tensor(entry)
    by_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (index, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {spec.name!r}: layer {index} {target} lacks "
                             f"lora_{'B' if 'A' in ab else 'A'}")
        module, part = PROJECTIONS[target]
        by_layer.setdefault((index, module), {})[part] = (ab["A"], ab["B"])
    for (index, module), parts in by_layer.items():
        layer = layers[index].get_submodule(module)
        assert isinstance(layer, Linear) and isinstance(layer.method, LoraMethod)
        state.weights.setdefault(layer, {})[adapter] = _fused_pair(layer, parts, spec, dtype)
    state.loaded[adapter] = spec
    logger.info("LoRA adapter %r (rank %d, scale %g, %s) as adapter %d", spec.name, spec.rank,
                spec.scale, "/".join(spec.targets), adapter)


def _fused_pair(layer: Linear, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                spec: AdapterSpec, dtype: torch.dtype) -> LoraWeights:
    """One (A, B) pair for `layer` from its parts' pairs: the A's stacked, the B's as a
    block-diagonal (rows of the part's outputs, columns of its rank), B scaled."""
    sizes = getattr(layer, "parts", (layer.out_features,))
    rank = spec.rank
    a = torch.zeros(rank * len(parts), layer.in_features, dtype=torch.float32)
    b = torch.zeros(layer.out_features, rank * len(parts), dtype=torch.float32)
    blocks = []
    for j, (part, (pa, pb)) in enumerate(sorted(parts.items())):
        start = sum(sizes[:part])
        if tuple(pa.shape) != (rank, layer.in_features) or tuple(pb.shape) != (sizes[part], rank):
            raise ValueError(f"LoRA adapter {spec.name!r}: shapes {tuple(pa.shape)} and "
                             f"{tuple(pb.shape)} for a projection of {layer.in_features} "
                             f"inputs and {sizes[part]} outputs")
        a[j * rank:(j + 1) * rank] = pa.float()
        b[start:start + sizes[part], j * rank:(j + 1) * rank] = pb.float() * spec.scale
        blocks.append((j * rank, rank, start, start + sizes[part]))
    held = next(iter([*layer.parameters(), *layer.buffers()]), None)
    where = held.device if held is not None else torch.device("cpu")
    return LoraWeights(a.to(where, dtype).contiguous(), b.to(where, dtype).contiguous(),
                       tuple(blocks))
