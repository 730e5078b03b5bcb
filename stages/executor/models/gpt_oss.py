"""gpt-oss (ipc/families/gpt_oss.py reads its config), in the executor process: the pre-norm
layer of blocks.py (attention with a sink logit per head, alternate layers windowed, biased
projections) with the MoE block of moe_block.py as its MLP (a biased router, softmax over the
top k's logits, biased experts with the clamped SwiGLU).

Its checkpoints store each layer's experts fused and transposed: `mlp.experts.gate_up_proj`
[E, hidden, 2I] (gate and up interleaved along 2I) and `down_proj` [E, I, hidden], with
biases [E, 2I] and [E, hidden]; as shipped, the projections are MXFP4 instead
(`*_blocks` [E, out, in / 32, 16] uint8 and `*_scales` [E, out, in / 32], rows [out, in],
gate/up rows interleaved). `checkpoint_entries` splits them into each expert's gate, up and
down entries. MXFP4 experts stay in their blocks (linear/mxfp4.py, on the quantized
kernels) where those run; elsewhere (no AVX512-VNNI, a GPU, several ranks) they are
dequantized to the model's dtype, said once in the log."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from ipc.arch import ArchSpec
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod
from stages.executor.linear.mxfp4 import Mxfp4Method, mxfp4_blocks
from stages.executor.models.base import CausalLM, CheckpointEntry
from stages.executor.models.blocks import DecoderLayer
from stages.executor.models.moe_block import sparse_mlp
from stages.executor.sharding import Shard

if TYPE_CHECKING:
    from stages.executor.parallel import PipelineParallel, TensorParallel

logger = logging.getLogger(__name__)

# A layer's fused experts: (prefix, projection, what of it)
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")


class GptOss(CausalLM):
    """Checkpoint names as transformers saves gpt-oss's: mlp.router (the MoE block's gate),
    mlp.experts.{gate_up_proj,down_proj}(_bias|_blocks|_scales) fused over the experts,
    self_attn.sinks."""

    def __init__(self, cfg: dict, spec: ArchSpec, backend: AttentionBackend,
                 linear: LinearMethod, tp: TensorParallel | None = None,
                 stage: PipelineParallel | None = None) -> None:
        # (set before the layers are built: make_layer reads it)
        self.expert_linear = _expert_method(cfg, backend, tp is not None and tp.size > 1)
        super().__init__(cfg, spec, backend, linear, tp, stage)

    def make_layer(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                   linear: LinearMethod, shard: Shard) -> nn.Module:
        mlp = sparse_mlp(spec, layer_idx, backend.ops, linear, shard, self.expert_linear)
        return DecoderLayer(spec, layer_idx, backend, linear, shard, mlp)

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def checkpoint_entries(self, entries: Iterable[CheckpointEntry]
                           ) -> Iterator[CheckpointEntry]:
        """Each fused expert tensor as its experts' own entries: experts.E.{gate,up,down}_proj
        .{weight,bias}, [out, in] as Linear holds them; an MXFP4 projection (its blocks and
        its scales, two entries met in either order) as each expert's QuantizedWeight."""
        halves: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 projection's first seen
        for where, name, value in entries:
            match = _EXPERTS.match(name)
            if match is None:
                yield where, name, value
                continue
            prefix, proj, what = match.groups()
            if what in ("_blocks", "_scales"):
                got = halves.setdefault(f"{prefix}.{proj}", {})
                got[what] = value[:]
                if len(got) == 2:
                    del halves[f"{prefix}.{proj}"]
                    for e, sub, weight in _mxfp4_experts(proj, got):
                        yield where, f"{prefix}.{e}.{sub}.weight", weight
                continue
            leaf = "bias" if what == "_bias" else "weight"
            for e in range(_num_experts(value)):
                for sub, part in _float_expert(proj, value[e], leaf):
                    yield where, f"{prefix}.{e}.{sub}.{leaf}", part
        if halves:  # (a projection's blocks without its scales, or the other way round)
            missing = {f"{p}{'_scales' if '_blocks' in got else '_blocks'}"
                       for p, got in halves.items()}
            raise ValueError(f"the checkpoint has no {', '.join(sorted(missing))}")


def _num_experts(value: object) -> int:
    shape = value.get_shape() if hasattr(value, "get_shape") else value.shape  # type: ignore[attr-defined]
    return int(shape[0])


def _float_expert(proj: str, value: torch.Tensor,
                  leaf: str) -> list[tuple[str, torch.Tensor]]:
    """One expert's slice of a float fused tensor (weights [in, out], biases [out]) as its
    Linear's parts, [out, in]: gate_up's even outputs the gate, its odd ones the up."""
    out_major = value if leaf == "bias" else value.T  # [out, in] or [out]
    if proj == "down_proj":
        return [("down_proj", out_major)]
    return [("gate_proj", out_major[0::2]), ("up_proj", out_major[1::2])]


def _mxfp4_experts(proj: str,
                   got: dict[str, torch.Tensor]) -> Iterator[tuple[int, str, object]]:
    """Each expert's MXFP4 rows (blocks [E, out, G, 16], scales [E, out, G]) as 5-bit
    blocks: gate_up's even rows the gate, its odd ones the up."""
    blocks, scales = got["_blocks"], got["_scales"]
    for e in range(blocks.shape[0]):
        if proj == "down_proj":
            yield e, "down_proj", mxfp4_blocks(blocks[e], scales[e])
        else:
            yield e, "gate_proj", mxfp4_blocks(blocks[e, 0::2], scales[e, 0::2])
            yield e, "up_proj", mxfp4_blocks(blocks[e, 1::2], scales[e, 1::2])


def _expert_method(cfg: dict, backend: AttentionBackend, ranks: bool) -> LinearMethod | None:
    """The experts' own weight format: MXFP4's blocks where the checkpoint ships them and
    the quantized kernels run here (one rank, the eager CPU forward); None (the model's,
    the blocks dequantized to its dtype by the loader) otherwise."""
    if (cfg.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        return None
    dtype = torch.get_default_dtype()  # (the model's: build_model sets it)
    why = Mxfp4Method.unsupported(dtype, backend.device)
    if why is None and backend.compiled:
        why = "the compiled forward needs plain weights"
    if why is None and ranks:
        why = "blocks are not sliced across tensor-parallel ranks"
    if why is None:
        return Mxfp4Method()
    logger.info("gpt-oss: the MXFP4 experts are dequantized to %s (%s)", dtype, why)
    return None
