"""The causal LM every family is, over a paged KV cache, in the executor process: a
backbone of the family's decoder layers, the head, the rope tables of each kind of layer,
and the one forward. One forward takes a flattened batch mixing prefill chunks and decode
tokens of different sequences; attention reads and writes the paged cache through the
model's attention backend (backends/base.py), each projection runs in its linear method's
format (linear/); both are chosen before the model is built (backends/select.py,
linear/select.py) and never changed on it. A family (stages/executor/models/<family>.py)
subclasses CausalLM to say which layer it stacks and how checkpoint names map to its
parameters; the forward has no per-family branches, only modules that are there or not."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ipc.arch import ArchSpec
from stages.executor.backends.base import AttentionBackend
from stages.executor.kv_pool import KVShape
from stages.executor.linear.base import LinearMethod
from stages.executor.models.blocks import Attention, Backbone, DecoderLayer
from stages.executor.sharding import ParallelLMHead, Shard

if TYPE_CHECKING:
    from stages.executor.fused import FusedLayers
    from stages.executor.lora import LoraState
    from stages.executor.parallel import PipelineParallel, TensorParallel

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


CheckpointEntry = tuple[str, str, Any]  # (file name, checkpoint name, a sliceable value)


class CausalLM(nn.Module):
    """forward(input_ids [T], kv_caches (one per layer), meta (the backend's metadata of the
    step), logits_indices [S]) -> [S, V]. `compile_layers` compiles each decoder layer (one
    graph serves every layer of a kind, one per padded step size) and leaves the rest eager.
    With `tp`, this is one rank's shard (sharding.py); without, the whole model. With `stage`,
    one pipeline stage's layers (parallel.py): the embedding on the first, the norm and the
    head on the last (and the embedding there too when the head is tied to it)."""

    def __init__(self, cfg: dict, spec: ArchSpec, backend: AttentionBackend,
                 linear: LinearMethod, tp: TensorParallel | None = None,
                 stage: PipelineParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.spec, self.backend, self.tp, self.stage = cfg, spec, backend, tp, stage
        first, last = stage is None or stage.first, stage is None or stage.last
        tied = spec.tie_word_embeddings and not linear.takes_blocks
        shard = Shard(tp.rank, tp.size, tp) if tp is not None else Shard()
        self.model = Backbone(spec, backend, linear, shard, self.make_layer,
                              self.make_final_norm(spec) if last else None,
                              stage.layers if stage is not None else None,
                              embed=first or (last and tied), final_norm=last)
        self.lm_head = (ParallelLMHead(spec.hidden, spec.vocab_size, linear.for_head(), shard)
                        if last else None)
        if tied and self.lm_head is not None:
            assert self.model.embed_tokens is not None  # (kept on the last stage when tied)
            self.lm_head.weight = self.model.embed_tokens.weight
        # (the model's dtype, wherever its parameters are: it follows .to(dtype) as they do)
        self.register_buffer("_dtype", torch.empty(0), persistent=False)
        attn: Attention = self.model.layers[0].self_attn  # type: ignore[assignment]
        self.num_layers = len(self.model.layers)  # (this stage's)
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        self.fused_layers: FusedLayers | None = None  # set once loaded (load_model)
        self.lora: LoraState | None = None  # its adapters, where built with them (load_model)
        # Whether the last layer runs past its attention for the logits' rows only (see
        # forward); on the eager CPU forward (load_model), not in a compiled layer or a graph.
        self.trim_last_layer = False
        # The rope tables [max_len, D] of each rope kind, in the order of rope_keys (the
        # layers' LayerAttention.rope indexes them); init_rope fills them.
        self.rope_keys = backend.rope_keys(spec)
        self.ropes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def make_layer(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                   linear: LinearMethod, shard: Shard) -> nn.Module:
        """The family's decoder layer `layer_idx` (the pre-norm Llama layer here)."""
        return DecoderLayer(spec, layer_idx, backend, linear, shard)

    def make_final_norm(self, spec: ArchSpec) -> nn.Module | None:
        """The family's norm after the last layer; None: RMSNorm on the backend's ops."""
        return None

    def checkpoint_name(self, name: str) -> str | None:
        """The model's name for checkpoint entry `name` (loader.py maps fused projections'
        parts after this); None: an entry the model does not use (skipped)."""
        return name

    def holds_entry(self, name: str) -> bool:
        """Whether a checkpoint entry (by its Hugging Face name) may be this pipeline stage's:
        not another stage's layer, nor the head before the last stage, nor the embedding
        where it is neither looked up nor the tied head. The loader does not even read the
        others (a GGUF file's blocks)."""
        stage = self.stage
        if stage is None:
            return True
        match = _LAYER.match(name)
        if match is not None:
            return int(match.group(1)) in stage.layers
        if name.startswith("lm_head."):
            return stage.last
        if name.startswith("model.embed_tokens."):
            return stage.first or (stage.last and self.spec.tie_word_embeddings)
        return True

    def on_stage(self, name: str) -> str | None:
        """A checkpoint name (the model's, after checkpoint_name) as this pipeline stage's
        parameter: a layer's with its index in the stage, or None where the stage does not
        hold it (another stage's layer; the embedding, the norm or the head elsewhere)."""
        if self.stage is None:
            return name
        match = _LAYER.match(name)
        if match is not None:
            index = int(match.group(1))
            if index not in self.stage.layers:
                return None
            return f"model.layers.{index - self.stage.layers.start}.{name[match.end():]}"
        if name.startswith("model.embed_tokens."):
            return name if self.model.embed_tokens is not None else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.stage.last else None
        return name

    def checkpoint_entries(self, entries: Iterable[CheckpointEntry]
                           ) -> Iterator[CheckpointEntry]:
        """The checkpoint's entries as the model's: a family whose checkpoint fuses what the
        model keeps apart (gpt-oss's experts, stacked in one tensor) yields each part as an
        entry of its own, in the checkpoint's naming (checkpoint_name then applies), its
        value anything sliceable or a QuantizedWeight (kept in blocks where the layer takes
        them, else dequantized). As they come here."""
        return iter(entries)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype.dtype

    @property
    def kv_shape(self) -> KVShape:
        """What this model's (rank's) KV cache holds per token (kv_pool.py allocates it)."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def init_rope(self, max_len: int) -> None:
        """The rope tables of every position (rope_tables), in the model's dtype, one pair
        per rope kind of the layers."""
        device = self._dtype.device
        self.ropes = []
        for key in self.rope_keys:
            cos, sin = rope_tables(self.cfg, self.head_dim, max_len, key)
            self.ropes.append((cos.to(device, self.dtype), sin.to(device, self.dtype)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None  # (a pipeline's first stage embeds)
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                logits_indices: torch.Tensor, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The logits [S, vocab] of the rows `logits_indices`, in the model's dtype (float32
        with tensor parallelism, on rank 0; None on the others). A pipeline stage after the
        first takes the previous stage's `hidden` [T, hidden] in place of the embedding of
        `input_ids`, and one before the last returns its own hidden states [T, hidden]."""
        x = self.hidden_states(input_ids, kv_caches, meta, logits_indices, hidden)
        if self.stage is not None and not self.stage.last:
            return x
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits [S, vocab] of final hidden states x [S, hidden] (see forward)."""
        logits = self.logits(x)  # [S, vocab], in the model's dtype (the sampler widens)
        return logits if self.tp is None else self.tp.gather_logits(  # type: ignore[return-value]
            logits.float())

    def hidden_states(self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: Any, logits_indices: torch.Tensor,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output [S, hidden] of the rows `logits_indices` (what forward
        turns into logits, and an embedding pools); a pipeline stage before the last: its
        own hidden states [T, hidden], as forward."""
        x = self.embed(input_ids) if hidden is None else hidden  # [T, hidden]
        if self.stage is not None and not self.stage.last:
            if self.fused_layers is not None:
                return self.fused_layers(x, kv_caches, meta)
            for layer, cache in zip(self.model.layers, kv_caches, strict=True):
                x = layer(x, cache, meta)
            return x
        # A prompt chunk's rows other than its last feed only the next layers (their keys and
        # values): past the last layer's attention, only the logits' rows are needed. Its
        # output projection and MLP then run on those rows alone (a 128-token prompt's
        # prefill does 1/30 less of the default model's work), the same bits for them where
        # the products compute a row independently of the rows beside it (MKL, AMX, the
        # quantized kernels; docs/ARCHITECTURE.md "The forward: eager or compiled").
        keep = (logits_indices if self.trim_last_layer
                and logits_indices.shape[0] < x.shape[0] else None)
        layers, norm = self.model.layers, self.model.norm
        assert norm is not None  # (the last stage's)
        fused = self.fused_layers
        if self.lora is not None and self.lora.step is not None:  # (a step with adapters)
            fused = None  # (the fused call takes none)
            self.lora.kept = None if keep is None else self.lora.step.select(keep)
        if fused is not None:  # the same kernels, in one call (fused.py)
            x = fused(x, kv_caches, meta, all_layers=keep is None)
        else:
            for i in range(len(layers) - (keep is not None)):
                x = layers[i](x, kv_caches[i], meta)
        if keep is not None:
            x = norm(layers[-1](x, kv_caches[-1], meta, keep))  # [S, hidden]
        else:
            # (index_select: a decode step's rows, too few to share out, copy on this thread;
            # x[...]'s advanced index forked torch's OpenMP team for them every step)
            x = norm(x.index_select(0, logits_indices))  # [S, hidden]
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # (the last stage's)
        return self.lm_head(x)  # type: ignore[no-any-return]


def rope_tables(cfg: dict, head_dim: int, max_len: int,
                key: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of cos/sin [max_len, head_dim] per position, computed as Hugging Face's
    rotary embeddings do (in float32). `key`: "default" for the config's one rope, else the
    layer type whose own rope parameters it is (transformers' rope_parameters by layer
    type, Gemma 3's). The plain rope of a config that names its theta is computed here
    (compute_default_rope_parameters' formula); scaled ropes go through transformers' rope
    functions. (Importing transformers' model code costs ~2.5 s of every executor's start,
    and modeling_llama imports torch._dynamo too.)"""
    params = cfg.get("rope_parameters") or {}
    layer_type = None if key == "default" else key
    if layer_type is not None:
        params = params.get(layer_type) or {}
    scaled = cfg.get("rope_scaling") if layer_type is None else None
    theta = params.get("rope_theta", cfg.get("rope_theta") if layer_type is None else None)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    if params.get("rope_type", "default") == "default" and not scaled and theta is not None:
        inv_freq, scaling = 1.0 / (float(theta) ** exponents), 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_cfg = AutoConfig.for_model(**cfg)
        hf_params = hf_cfg.rope_parameters
        if layer_type is not None:
            hf_params = hf_params[layer_type]
        rope_type = hf_params["rope_type"]
        if rope_type == "default":  # (the theta came from the config class's default)
            inv_freq, scaling = 1.0 / (hf_params["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, layer_type=layer_type)
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
