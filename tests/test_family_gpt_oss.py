"""gpt-oss (ipc/families/gpt_oss.py, stages/executor/models/gpt_oss.py): tiny random models
give transformers' greedy tokens (attention sinks on every layer, alternating windowed and
full layers, YaRN rope, biased attention, router and experts, the clamped SwiGLU), from float
checkpoints and from MXFP4 experts as they ship (kept in their blocks, or dequantized where
the quantized kernels cannot run); the CPU kernel's sinks equal the torch path's in every
form; the rope tables equal GptOssRotaryEmbedding's; what the engine lacks is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from family_check import check_against_transformers, eos_of, prompts_of
from kernel_marks import needs_kernels
from safetensors.torch import load_file, save_file

from ipc.arch import UnsupportedModel
from ipc.families import arch_spec
from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_model
from stages.executor import kernels
from stages.executor.linear.quantized import kernel_missing
from stages.inprocess import InProcessEngine

pytestmark = pytest.mark.timeout(600)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0}
FIELDS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=5, num_experts_per_tok=2,
    sliding_window=6, max_position_embeddings=256, rope_parameters=YARN,
    layer_types=["sliding_attention", "full_attention"] * 2)


def build(folder: Path, **fields: Any) -> Path:
    """A tiny random gpt-oss whose sinks are drawn too (build_random_model draws matrices
    and biases only; the sinks' init is N(0, 0.02), too small to matter): N(0, 1), so a
    sink takes a real share of each softmax."""
    build_random_model(folder, "gpt_oss", **{**FIELDS, **fields})
    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def test_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    """fp32, batched in chunks of 16 tokens (prompts past the 6-token window), from the
    prefix cache, on the CPU kernels and on PyTorch's ops (family_check)."""
    folder = build(tmp_path / "gpt_oss")
    spec = arch_spec(json.loads((folder / "config.json").read_text()))
    assert [k.window for k in spec.layers] == [6, None, 6, None]
    assert all(k.sinks for k in spec.layers)
    check_against_transformers(folder)


def test_sinks_change_the_tokens(tmp_path: Path) -> None:
    """The sinks matter to the check above: without them transformers' tokens differ."""
    from tiny_model import hf_greedy

    folder = build(tmp_path / "gpt_oss")
    prompts = prompts_of(folder)
    want = hf_greedy(folder, prompts, max_new_tokens=16)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("self_attn.sinks"):
            tensors[name] = torch.full_like(tensors[name], -80.0)  # exp(-80): none
    save_file(tensors, path, metadata={"format": "pt"})
    assert hf_greedy(folder, prompts, max_new_tokens=16) != want


def test_rope_tables_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from stages.executor.models.base import rope_tables

    cfg = {"model_type": "gpt_oss", **FIELDS, "vocab_size": 100}
    cos, sin = rope_tables(cfg, 16, 256)
    rotary = GptOssRotaryEmbedding(AutoConfig.for_model(**cfg))
    want_cos, want_sin = rotary(torch.zeros(1), torch.arange(256)[None])  # [1, L, D / 2]
    assert torch.equal(cos, torch.cat([want_cos[0]] * 2, dim=-1))
    assert torch.equal(sin, torch.cat([want_sin[0]] * 2, dim=-1))


def test_bf16_agrees_with_transformers_bf16(tmp_path: Path) -> None:
    """bf16, 8 new tokens. On PyTorch's ops the sinks' explicit scores round as transformers'
    eager attention (bf16 scores and softmax): 5 of the 8 prompts must agree with
    transformers' bf16 (6 measured). The CPU kernels attend in float32, so they follow the
    float model rather than transformers' bf16 roundings (3 of 8 agree with transformers'
    bf16 on this model, whose bf16 itself agrees with its fp32 on 5): they must be as close
    to the fp32 tokens as transformers' bf16 is, within one prompt (4 measured)."""
    from tiny_model import hf_greedy

    folder = build(tmp_path / "gpt_oss")
    prompts = prompts_of(folder)
    want = hf_greedy(folder, prompts, max_new_tokens=8, dtype="bfloat16")
    fp32 = hf_greedy(folder, prompts, max_new_tokens=8)

    def agree(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    def tokens(on_kernels: bool) -> list[list[int]]:
        eng = InProcessEngine(str(folder), dtype=torch.bfloat16, eos_token_ids=eos_of(folder),
                              max_num_batched_tokens=16, max_num_seqs=4,
                              cpu_kernels=on_kernels)
        return eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))

    torch_ops = tokens(False)
    assert agree(torch_ops, want) >= 5, f"torch ops: {agree(torch_ops, want)} of 8 agree"
    if kernels.available():
        on_kernels = tokens(True)
        assert agree(on_kernels, fp32) >= agree(want, fp32) - 1, (
            f"kernels: {agree(on_kernels, fp32)} of 8 agree with fp32, transformers' bf16 "
            f"{agree(want, fp32)}")


# --- MXFP4 experts as they ship --------------------------------------------------------------

def as_mxfp4(float_folder: Path, folder: Path, seed: int = 2) -> Path:
    """`folder`: the float model with random MXFP4 experts in the shipped layout
    (`*_blocks` [E, out, in / 32, 16], `*_scales` [E, out, in / 32], gate/up rows
    interleaved) and quantization_config mxfp4; `float_folder` gets transformers' own
    dequantization of them (convert_moe_packed_tensors), for transformers to run."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder.mkdir(parents=True, exist_ok=True)
    for f in float_folder.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(float_folder / "model.safetensors")
    packed, dense = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        experts, inputs, outputs = value.shape  # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen,
                               dtype=torch.uint8)
        # 2^-6 to 2^-3: values up to 6 * 2^-3, of the float weights' size
        scales = torch.randint(121, 125, (experts, outputs, inputs // 32), generator=gen,
                               dtype=torch.uint8)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dense[name].shape == value.shape
    save_file(packed, folder / "model.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in dense.items()},
              float_folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def engine_tokens(folder: Path, prompts: list[list[int]], **engine: Any) -> list[list[int]]:
    eng = InProcessEngine(str(folder), max_num_batched_tokens=16, max_num_seqs=4,
                          eos_token_ids=eos_of(folder), **engine)
    return eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))


@pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))
def test_mxfp4_experts_run_in_their_blocks(tmp_path: Path) -> None:
    """fp32 activations against transformers on the dequantized experts: the blocks hold
    the values exactly (linear/mxfp4.py), the quantized kernels round the activations to 8
    bits, so the tokens of most prompts agree (7 of 8), and the experts' layers are
    MXFP4's."""
    from tiny_model import hf_greedy

    float_folder = build(tmp_path / "float")
    folder = as_mxfp4(float_folder, tmp_path / "mxfp4")
    prompts = prompts_of(folder)
    want = hf_greedy(float_folder, prompts, max_new_tokens=32)
    eng = InProcessEngine(str(folder), max_num_batched_tokens=16, max_num_seqs=4,
                          eos_token_ids=eos_of(folder))
    expert = eng.runner.model.model.layers[0].mlp.experts[0]  # type: ignore[index, union-attr]
    assert expert.gate_up_proj.method.name == "mxfp4"
    assert eng.runner.model.model.layers[0].self_attn.qkv_proj.method.name != "mxfp4"  # type: ignore[union-attr]
    got = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    agree = sum(g == w for g, w in zip(got, want, strict=True))
    assert agree >= 7, f"{agree} of {len(prompts)} prompts agree"


def test_mxfp4_experts_dequantized_equal_transformers(tmp_path: Path) -> None:
    """Where the blocks cannot run (PyTorch's ops: no quantized kernel), the experts are
    dequantized to the model's dtype: exactly transformers' dequantized weights, so fp32
    tokens equal transformers' on every prompt."""
    from tiny_model import hf_greedy

    float_folder = build(tmp_path / "float")
    folder = as_mxfp4(float_folder, tmp_path / "mxfp4")
    prompts = prompts_of(folder)
    want = hf_greedy(float_folder, prompts, max_new_tokens=32)
    assert engine_tokens(folder, prompts, cpu_kernels=False) == want


def test_mxfp4_blocks_without_scales_are_named(tmp_path: Path) -> None:
    float_folder = build(tmp_path / "float", num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"])
    folder = as_mxfp4(float_folder, tmp_path / "mxfp4")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.mlp.experts.down_proj_scales"):
        InProcessEngine(str(folder), cpu_kernels=False)


# --- Refusals ---------------------------------------------------------------------------------

def config(**fields: Any) -> dict[str, Any]:
    return {"model_type": "gpt_oss", **FIELDS, "vocab_size": 100, **fields}


def test_another_quantization_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModel, match="quantization_config"):
        arch_spec(config(quantization_config={"quant_method": "fp8"}))


def test_backends_without_sinks_refuse_them_by_name() -> None:
    from ipc.config import EngineLimits
    from stages.executor.backends.flex import FlexBackend

    spec = arch_spec(config(layer_types=["full_attention"] * 4, sliding_window=None))
    backend = FlexBackend(EngineLimits(4, 64, 16, 256, 100), torch.device("cpu"))
    with pytest.raises(UnsupportedModel, match="attention sinks are not implemented"):
        backend.layer_attention(spec, 0)


@needs_kernels
def test_the_fused_call_says_why_not(tmp_path: Path) -> None:
    folder = build(tmp_path / "gpt_oss", num_hidden_layers=2,
                   layer_types=["sliding_attention", "full_attention"])
    eng = InProcessEngine(str(folder), cpu_kernels=True)
    layer: Any = eng.runner.model.model.layers[0]
    assert eng.runner.model.fused_layers is None
    assert "attention sinks" in layer.fast_path()
