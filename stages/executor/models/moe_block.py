"""The sparse MLP every mixture-of-experts family shares, in the executor process: a router
picks each token's top k experts (ipc/arch.py MoESpec says how its weights are made), each
expert is a gated MLP run only on the tokens routed to it, and a shared expert (Qwen2-MoE)
runs on every token.

The step's (token, expert) pairs are sorted by expert and each expert that has any runs once
on its group of rows: its weights stream once per step, not once per token, and it is an
ordinary pair of Linear layers (gate/up fused, then down), so every weight format the engine
has (dense, oneDNN/MKL/AMX packed, --quantization int8/int4) applies to experts unchanged.
Which experts run is read on the host (a device sync on CUDA; plain PyTorch ops, no CPU-only
op), so the block runs in the eager forwards only: the compiled one is refused for these
models (backends/select.py).

Where every routed expert is packed bf16 with SiLU fused into its gate/up product (amx.py's
layout on AVX512-BF16, a CPU without AMX), or quantized (--quantization int8/int4, a GGUF
file's blocks) with a SiLU MLP, the experts' weights are stacked once loaded and a step's
routed experts run in one kernel call (csrc/moe_experts.cpp, csrc/quant_kernels.cpp
quantized_moe): no Python, dispatch or thread barrier per expert, and each expert's weights
streamed once per step by all of torch's threads. float32 weights, AMX tiles and gpt-oss's
clamped SwiGLU run the experts one by one as above."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ipc.arch import ArchSpec, MoESpec, UnsupportedModel
from stages.executor.backends.base import ForwardOps
from stages.executor.linear.amx import AmxMethod, VectorBf16Method
from stages.executor.linear.base import Linear, LinearMethod
from stages.executor.linear.dense import DenseMethod
from stages.executor.linear.quantized import QuantizedMethod
from stages.executor.models.blocks import dense_mlp
from stages.executor.sharding import ColumnParallelLinear, RowParallelLinear, Shard

logger = logging.getLogger(__name__)
_logged: set[str] = set()  # why experts ran one by one, as told to the log


class PartialRowLinear(RowParallelLinear):
    """A row-parallel projection whose ranks' partial outputs its caller sums (the MoE block
    sums every expert's first, then all-reduces once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ClampedSwiGLU:
    """gpt-oss's expert activation of gate/up [T, 2I] (gate first, then up: the loader
    de-interleaves its checkpoint's rows): gate <= limit, |up| <= limit, then
    (up + 1) * gate * sigmoid(alpha * gate), rounded as transformers' GptOssExperts."""

    def __init__(self, limit: float, alpha: float) -> None:
        self.limit, self.alpha = limit, alpha

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class Expert(nn.Module):
    """act(x W_gate) * (x W_up) W_down over this rank's intermediate rows, not summed over the
    ranks. Checkpoint names as transformers saves them (gate_proj/up_proj fill gate_up_proj).
    `act`: an activation of gate/up other than the family's `activation` (gpt-oss's
    ClampedSwiGLU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str,
                 ops: ForwardOps, linear: LinearMethod, shard: Shard,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = (
            act if act is not None else ops.act_and_mul(activation))
        self.gate_up_proj = ColumnParallelLinear(hidden, (intermediate, intermediate), bias,
                                                 linear, shard)
        # (AMX fuses SiLU-and-mul)
        self.gate_up_proj.gated = act is None and activation == "silu"
        self.down_proj = PartialRowLinear(intermediate, hidden, bias, linear, shard)
        # (quantized experts keep quantized_linear's tiles, which quantized_moe stacks)
        self.gate_up_proj.routed_expert = self.down_proj.routed_expert = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated_forward(x, self.act_and_mul))


class StackedExperts(NamedTuple):
    """Every routed expert's weights in their format and float32 biases (or None), stacked:
    `kind` "bf16" (packed panels, gate and up interleaved) or "quantized" (tiles, of bits13
    and bits2 bits)."""
    kind: str
    w13: torch.Tensor  # uint8 [E, ...]: gate/up
    b13: torch.Tensor | None  # [E, 2I]
    bits13: int
    w2: torch.Tensor  # uint8 [E, ...]: down
    b2: torch.Tensor | None  # [E, H]
    bits2: int


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k]: float32 (MoESpec.float_weights) or the model's dtype
    experts: torch.Tensor  # [T, k] int64, each token's experts by descending weight


def route(logits: torch.Tensor, moe: MoESpec) -> Routing:
    """Each token's top k experts from its router logits [T, E] (the model's dtype), in
    float32 as transformers computes them (its *TopKRouter): a softmax over every expert, the
    top k (ties as torch.topk breaks them), renormalised over those k with norm_topk; or
    ("topk_softmax") a softmax over the top k's logits."""
    if moe.routing == "topk_softmax":
        top, experts = torch.topk(logits, moe.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights if moe.float_weights else weights.to(logits.dtype), experts)


class MoEBlock(nn.Module):
    """x [T, hidden] -> the weighted sum of each token's k experts' outputs (+ the shared
    expert's), summed over the ranks. Parameter names as transformers' checkpoints have them:
    `gate` (the router, [E, hidden], replicated, kept in the model's dtype whatever the
    experts' format: routing is what a quantized weight must not change; packed where the
    model's bf16 products are), `experts.E.*`,
    `shared_expert.*` and `shared_expert_gate` ([1, hidden], replicated). `expert_linear`:
    the routed experts' weight format where it is not the model's (gpt-oss's MXFP4 blocks)."""

    def __init__(self, spec: ArchSpec, moe: MoESpec, ops: ForwardOps, linear: LinearMethod,
                 shard: Shard, expert_linear: LinearMethod | None = None) -> None:
        super().__init__()
        if not 0 < moe.top_k <= moe.num_experts:
            raise UnsupportedModel(f"{spec.family}: num_experts_per_tok = {moe.top_k} of "
                                   f"{moe.num_experts} experts")
        self.moe, self.shard = moe, shard
        # (packed bf16 where the model's products are: F.linear's took ~0.1 ms a call at one
        # token on the AMD host, 2% of a mid-size MoE's step)
        router = linear if isinstance(linear, AmxMethod) else DenseMethod()
        self.gate = Linear(spec.hidden, moe.num_experts, moe.router_bias, router)
        act = (ClampedSwiGLU(moe.swiglu_limit, moe.swiglu_alpha)
               if moe.swiglu_limit is not None else None)
        self.experts = nn.ModuleList(
            Expert(spec.hidden, moe.intermediate, moe.expert_bias, spec.activation, ops,
                   expert_linear or linear, shard, act) for _ in range(moe.num_experts))
        self.shared_expert = (Expert(spec.hidden, moe.shared_intermediate, False,
                                     spec.activation, ops, linear, shard)
                              if moe.shared_intermediate else None)
        self.shared_expert_gate = (Linear(spec.hidden, 1, False, DenseMethod())
                                   if moe.shared_gate else None)
        self.stacked: StackedExperts | None = None  # (weights_processed)

    def weights_processed(self) -> None:
        """Once the experts' weights are in their format: where one kernel takes them all
        (every routed expert packed bf16 on AVX512-BF16 with SiLU fused into gate/up, for
        moe_experts; or quantized with a SiLU MLP, for quantized_moe), they are stacked for it
        ([E, ...]), each expert keeping a view of its slice (one copy in memory). The stacks
        are the experts' weights from then on: a module conversion (.to()) after this would
        leave them behind."""
        if self.stacked is not None:
            return
        kind = self._stackable()
        if kind not in ("bf16", "quantized"):
            if kind not in _logged:  # (once, not once a layer)
                _logged.add(kind)
                logger.info("the routed experts run one by one: %s", kind)
            return
        buffer = "amx_weight" if kind == "bf16" else "tiles"
        stacks: list[Any] = []
        for name in ("gate_up_proj", "down_proj"):
            layers = [getattr(e, name) for e in self.experts]
            weight = torch.stack([getattr(layer, buffer) for layer in layers])
            bias = (torch.stack([layer.bias_f32 for layer in layers])
                    if layers[0].bias_f32 is not None else None)
            for i, layer in enumerate(layers):
                setattr(layer, buffer, weight[i])
                if bias is not None:
                    layer.bias_f32 = bias[i]
            stacks += [weight, bias, getattr(layers[0], "bits", 0)]
        self.stacked = StackedExperts(kind, *stacks)

    def _stackable(self) -> str:
        """"bf16" or "quantized": the kernel that takes these experts; else why none does.
        (On AMX the experts keep amx_linear's tiles, one expert at a time: moe_experts runs
        on AVX512-BF16, which has not been measured against the tiles there.)"""
        kinds = set()
        for expert in self.experts:
            gate_up, down = expert.gate_up_proj, expert.down_proj
            methods = (gate_up.method, down.method)
            if not gate_up.gated:
                return "their activation is not SiLU"
            if all(isinstance(m, VectorBf16Method) for m in methods) and gate_up.fused_gate:
                kinds.add(("bf16", gate_up.amx_weight.shape, down.amx_weight.shape))
            elif all(isinstance(m, QuantizedMethod) for m in methods):
                kinds.add(("quantized", gate_up.tiles.shape, gate_up.bits, down.tiles.shape,
                           down.bits))
            else:
                return (f"their weights are {gate_up.method.name}/{down.method.name}; one "
                        "kernel takes avx512-bf16 with SiLU fused into gate/up, or quantized "
                        "weights")
        if len(kinds) > 1:
            return "the experts' weights differ in format or shape"
        return str(next(iter(kinds))[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.gate(x), self.moe)
        s = self.stacked
        if s is not None and x.device.type == "cpu":
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            if s.kind == "bf16":
                out = torch.ops.llm_cpu.moe_experts(rows, routing.experts, routing.weights,
                                                    s.w13, s.b13, s.w2, s.b2)
            else:
                out = torch.ops.llm_cpu.quantized_moe(
                    rows, routing.experts, routing.weights, s.w13, s.b13, s.bits13, s.w2, s.b2,
                    s.bits2, self.experts[0].down_proj.in_features)
            out = out.view(x.shape)
        else:
            out = self.routed(x, routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [T, hidden]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.shard.reduce(out)

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden] (this rank's part), rounded as
        transformers' grouped experts do: each pair's output times its weight, then the k of a
        token summed in their order."""
        num_tokens, hidden = x.shape
        k = self.moe.top_k
        pairs = routing.experts.flatten()  # [T * k]: pair p is token p // k's (p % k)-th
        order = torch.argsort(pairs, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(pairs, minlength=self.moe.num_experts).tolist()  # (host)
        rows = x[order // k]  # [T * k, hidden]: each pair's input, by expert
        outs = []
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                outs.append(expert(rows[start:start + n]))
                start += n
        done = torch.cat(outs) if outs else x.new_empty(0, hidden)  # (no tokens: none)
        by_expert = done * routing.weights.flatten()[order].unsqueeze(1)
        by_pair = torch.empty_like(by_expert)
        by_pair[order] = by_expert
        return by_pair.view(num_tokens, k, hidden).sum(dim=1).to(x.dtype)

    def fast_path(self) -> str:
        """The fused CPU call (fused.py) runs dense MLPs only: which experts a token takes
        is known once its router has run, inside the layer."""
        return "a mixture of experts (the fused call runs dense MLPs only)"


def sparse_mlp(spec: ArchSpec, layer_idx: int, ops: ForwardOps, linear: LinearMethod,
               shard: Shard, expert_linear: LinearMethod | None = None) -> nn.Module:
    """Layer `layer_idx`'s MLP: the MoE block, or a dense one where the spec says so."""
    if spec.moe is not None and spec.sparse(layer_idx):
        return MoEBlock(spec, spec.moe, ops, linear, shard, expert_linear)
    return dense_mlp(spec, ops, linear, shard)
