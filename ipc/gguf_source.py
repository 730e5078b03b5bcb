"""A GGUF file as a model (`--model FILE.gguf`), what every stage may read of it without
torch: the model folder made for the file (pipeline/tools/gguf_model.py: config, tokenizer
and generation config from the file's metadata, as llama.cpp reads them) names the file in
`gguf.json`, with the types of its tensors; the executor loads the weights from the file
itself (stages/executor/gguf_loader.py), kept in their blocks. Here: that description, which
tensor types load and how, and the file's tensor names in Hugging Face's."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ipc.errors import ConfigError

SOURCE_FILE = "gguf.json"
# llama.cpp's block formats, by what they become (stages/executor/linear/gguf_blocks.py):
# 4-bit, 5-bit or 8-bit blocks exactly (a K-quant's sub-block scale d·sc rounded to fp16),
# or 8-bit blocks requantized from the values (Q6_K's 16-wide sub-blocks do not fit one
# scale per 32).
AS_INT4 = ("Q4_0", "Q4_1", "Q4_K")
AS_INT5 = ("Q5_0", "Q5_1", "Q5_K")
AS_INT8 = ("Q8_0",)
REQUANTIZED = ("Q6_K",)
# MXFP4 (gpt-oss's experts): 5-bit blocks holding its values exactly (linear/mxfp4.py).
AS_MXFP4 = ("MXFP4",)
FLOATS = ("F32", "F16", "BF16")
LOADED_TYPES = AS_INT4 + AS_INT5 + AS_INT8 + REQUANTIZED + AS_MXFP4 + FLOATS
# Files of these architectures load; llama.cpp's converter permutes the q and k rows of
# "llama" (Llama, Mistral, SmolLM, and Mixtral: "llama" with experts) for its rope, which
# loading undoes, and stores Gemma's norm weights as 1 + w (what Gemma's RMSNorm scales by;
# llama.cpp's norm multiplies by the weight alone), from which loading takes the 1 back off.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3",
                 "gpt-oss")
PERMUTED_QK = ("llama",)
NORM_PLUS_ONE = ("gemma2", "gemma3")
# A mixture of experts' stacked tensors ([experts, rows, inputs]): each expert's rows load as
# that expert's projection, EXPERT standing for its index in the Hugging Face name.
EXPERT = "*"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
                "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
                "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
                "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
                "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj",
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# Where an architecture's names differ from Llama's (gguf's tensor_mapping.py): Gemma's
# sandwich norms (ffn_norm is the norm before its MLP), gpt-oss's norm before its MLP, its
# sinks (a parameter of the attention, not a weight) and its router's bias.
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of `architecture` (blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight; a stacked expert tensor's with EXPERT for the
    expert: blk.3.ffn_up_exps.weight -> model.layers.3.mlp.experts.*.up_proj.weight); None
    for one this engine has no place for."""
    if m := _LAYER.fullmatch(name):
        part = _ARCH_LAYER_NAMES.get(architecture, {}).get(m[2]) or _LAYER_NAMES.get(m[2])
        if part == "self_attn.sinks":  # (attn_sinks.weight: a parameter of its own name)
            return f"model.layers.{m[1]}.{part}" if m[3] == "weight" else None
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else None
    if m := _GLOBAL.fullmatch(name):
        part = _GLOBAL_NAMES.get(m[1])
        return f"{part}.{m[2]}" if part else None
    return None


def is_mxfp4_experts(name: str, kind: str) -> bool:
    """A stacked expert tensor of MXFP4 blocks."""
    return kind in AS_MXFP4 and name.endswith("_exps.weight")


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return path.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a model folder stands for, and the types of its tensors (name -> type
    name: Q4_1, F32, ...)."""

    file: str
    architecture: str
    tensor_types: dict[str, str]

    @property
    def quantized(self) -> bool:
        """Whether any weight is in blocks (then the model runs on the quantized kernels),
        leaving out MXFP4 experts (mxfp4_experts)."""
        return any(t not in FLOATS and not is_mxfp4_experts(name, t)
                   for name, t in self.tensor_types.items())

    @property
    def mxfp4_experts(self) -> bool:
        """Whether the experts are MXFP4 (gpt-oss's, as llama.cpp's converter writes them):
        then they run as a safetensors checkpoint's MXFP4 experts do (in their blocks where
        the quantized kernels run, dequantized elsewhere; models/gpt_oss.py), the other
        weights in their own format."""
        return any(is_mxfp4_experts(name, t) for name, t in self.tensor_types.items())

    def describe(self) -> str:
        """The file and its tensors' types, for messages: "x.gguf (Q4_1 ×210, F32 ×61)"."""
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        kinds = ", ".join(f"{t} ×{n}" for t, n in sorted(counts.items(), key=lambda c: -c[1]))
        return f"{Path(self.file).name} ({kinds})"

    def to_json(self) -> str:
        return json.dumps({"file": self.file, "architecture": self.architecture,
                           "tensor_types": self.tensor_types}, indent=1) + "\n"


def gguf_source(model_dir: str | Path) -> GgufSource | None:
    """The GGUF file behind a model folder, or None for an ordinary (safetensors) one."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    source = GgufSource(data["file"], data["architecture"], dict(data["tensor_types"]))
    if not Path(source.file).is_file():
        raise ConfigError(f"{model_dir} stands for {source.file}, which is gone: give "
                          "--model the GGUF file again")
    return source


def check_tensors(file: str, architecture: str, tensor_types: dict[str, str]) -> None:
    """ConfigError naming what the engine cannot load: the architecture, a tensor type (and
    what to convert the file to instead), a tensor it has no place for."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"{file}: GGUF architecture {architecture!r} is not supported (the "
                          f"engine loads {', '.join(ARCHITECTURES)})")
    for name, kind in tensor_types.items():
        if kind not in LOADED_TYPES:
            raise ConfigError(
                f"{file}: tensor {name} is {kind}, a type the engine does not load (it loads "
                f"{', '.join(LOADED_TYPES)}); requantize the file with llama.cpp's "
                "llama-quantize to Q4_K_M, Q4_0 or Q8_0")
        if name == "rope_freqs.weight":
            raise ConfigError(f"{file}: tensor {name} (RoPE frequency factors, Llama 3.1's "
                              "scaling) is not read from GGUF files; load the model's Hugging "
                              "Face folder instead")
        if hf_name(name, architecture) is None:
            raise ConfigError(f"{file}: tensor {name} has no place in the engine's model")
