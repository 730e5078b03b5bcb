"""GGUF files of Gemma 2, Gemma 3 and gpt-oss (pipeline/tools/gguf_export.py writes them as
llama.cpp's converter does; ipc/gguf_source.py, gguf_families.py and the executor's
gguf_loader.py read them as llama.cpp's loader does): tiny random models written to GGUF
and loaded back read as the same model (the spec the engine builds from the folder's
config.json), give the safetensors folder's greedy tokens (F32 files, MXFP4 experts kept
in their blocks: every prompt; Q8_0: most), and what a file cannot say is refused by name,
writing or reading."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from family_check import eos_of, prompts_of
from kernel_marks import needs_quantized_kernels
from test_family_gemma import GEMMA2, GEMMA3, _random_norms
from test_family_gpt_oss import as_mxfp4
from test_family_gpt_oss import build as build_gpt_oss

from ipc.errors import ConfigError
from ipc.families import arch_spec
from ipc.messages import SamplingParams
from pipeline.tools.gguf_export import export
from pipeline.tools.gguf_families import ggml_mxfp4, read_fields
from pipeline.tools.model_source import resolve_model
from pipeline.tools.random_model import build_random_model
from stages.inprocess import InProcessEngine

pytestmark = pytest.mark.timeout(600)
# llama.cpp's query scale is 1 / sqrt(head_dim) below 27B: the fixtures' scalar is head_dim.
GEMMA2_GGUF = {**GEMMA2, "query_pre_attn_scalar": 16}
GEMMA3_GGUF = {**GEMMA3, "query_pre_attn_scalar": 32}


def _source(folder: Path, family: str) -> Path:
    """A tiny random model of `family` whose every part the file must carry: norms whose
    1 + w is not 1, scores large enough for Gemma 2's softcap to bite, gpt-oss's sinks."""
    if family == "gemma2":
        model = build_random_model(folder, "gemma2", weight_std=0.03, **GEMMA2_GGUF)
        return _random_norms(model, qk_factor=8.0)
    if family == "gemma3_text":
        model = build_random_model(folder, "gemma3_text", weight_std=0.03, **GEMMA3_GGUF)
        return _random_norms(model)
    return build_gpt_oss(folder)


def _tokens(folder: Path, prompts: list[list[int]], **engine: Any) -> list[list[int]]:
    eng = InProcessEngine(str(folder), max_num_batched_tokens=16, max_num_seqs=4,
                          eos_token_ids=eos_of(folder), **engine)
    return eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))


def _spec(folder: Path) -> Any:
    """The engine's reading of a folder's config, eps aside (a GGUF file holds it as a
    float32: 1e-6 comes back as 9.99999997e-07, as every family's file has it)."""
    spec = arch_spec(json.loads((folder / "config.json").read_text()))
    return dataclasses.replace(spec, eps=float(np.float32(spec.eps)))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gpt_oss"])
def test_an_f32_file_is_the_same_model(tmp_path: Path, family: str) -> None:
    """The file's folder reads as the source's spec (windows, softcaps, query scale, each
    layer kind's rope, experts) and gives its greedy tokens on every prompt, batched in
    chunks of 16 past the 6-token windows: F32 holds the weights exactly and the norms'
    1 + w comes back bit for bit."""
    source = _source(tmp_path / "source", family)
    folder = resolve_model(export(source, tmp_path / f"{family}.gguf", "F32"))
    try:
        assert _spec(folder) == _spec(source)
        prompts = prompts_of(source)
        assert _tokens(folder, prompts) == _tokens(source, prompts)
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


@needs_quantized_kernels
@pytest.mark.parametrize("family,fields", [("gemma2", GEMMA2_GGUF),
                                           ("gemma3_text", GEMMA3_GGUF)])
def test_a_q8_0_file_mostly_agrees(tmp_path: Path, family: str, fields: dict) -> None:
    """Q8_0 projections (gguf's symmetric 8-bit rounding of every matrix, the tied embedding
    and head included) on the quantized kernels: the 32 greedy tokens of at least 5 of the
    8 prompts equal the float32 folder's (weights of std 0.1: peaked logits whose tokens
    vary, where the fp32 tests' flatter ones flip at any rounding). Why not all: 8-bit
    blocks move a log-prob by ~5e-3 here, which flips a greedy choice wherever the top two
    are closer (measured: 8 of 8 for Gemma 2, 6 of 8 for Gemma 3); a wrong row order, block
    layout or norm offset agrees on none."""
    source = _random_norms(build_random_model(tmp_path / "source", family, weight_std=0.1,
                                              **fields))
    folder = resolve_model(export(source, tmp_path / f"{family}-q8.gguf", "Q8_0"))
    try:
        eng = InProcessEngine(str(folder))
        assert eng.runner.model.model.layers[0].self_attn.qkv_proj.method.name == "gguf"
        prompts = prompts_of(source)
        got, want = _tokens(folder, prompts), _tokens(source, prompts)
        assert sum(len(set(w)) > 2 for w in want) >= 4  # (not one token over and over)
        agree = sum(g == w for g, w in zip(got, want, strict=True))
        assert agree >= 5, f"{agree} of {len(prompts)} prompts agree"
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


@pytest.mark.parametrize("cpu_kernels", [
    pytest.param(True, marks=needs_quantized_kernels), False])
def test_mxfp4_experts_are_the_checkpoints_blocks(tmp_path: Path, cpu_kernels: bool) -> None:
    """A gpt-oss checkpoint's MXFP4 experts are repacked into ggml's MXFP4 blocks (not
    requantized); loaded back they run as the checkpoint's own do: in their blocks on the
    quantized kernels, the other layers in float32, so the greedy tokens equal the
    checkpoint's on every prompt; on PyTorch's ops both are dequantized alike."""
    folder_mx = as_mxfp4(build_gpt_oss(tmp_path / "float"), tmp_path / "mxfp4")
    file = export(folder_mx, tmp_path / "gpt-oss-mxfp4.gguf", "F32")
    folder = resolve_model(file)
    try:
        from gguf import GGUFReader

        types = {t.name: t.tensor_type.name for t in GGUFReader(str(file)).tensors}
        assert types["blk.0.ffn_up_exps.weight"] == "MXFP4"
        assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up_exps.bias"] == "F32"
        layers = [InProcessEngine(str(f), cpu_kernels=cpu_kernels).runner.model.model.layers[0]
                  for f in (folder, folder_mx)]
        experts = [layer.mlp.experts[0].gate_up_proj.method.name for layer in layers]  # type: ignore[index, union-attr]
        assert experts[0] == experts[1] and (experts[0] == "mxfp4" or not cpu_kernels)
        assert layers[0].self_attn.qkv_proj.method.name not in ("mxfp4", "gguf")  # type: ignore[union-attr]
        prompts = prompts_of(folder_mx)
        assert (_tokens(folder, prompts, cpu_kernels=cpu_kernels)
                == _tokens(folder_mx, prompts, cpu_kernels=cpu_kernels))
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


def test_ggml_mxfp4_blocks_hold_the_checkpoints_values() -> None:
    """The repacking against gguf's reference dequantization of ggml's blocks and
    transformers' of the checkpoint's."""
    import torch
    from gguf import GGMLQuantizationType, quants

    from stages.executor.linear.mxfp4 import mxfp4_values

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 130, (3, 4), generator=gen, dtype=torch.uint8)
    packed = ggml_mxfp4(blocks.numpy(), scales.numpy())
    assert packed.shape == (3, 4 * 17)
    theirs = quants.dequantize(packed, GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs, mxfp4_values(blocks, scales).numpy())


@pytest.mark.parametrize("family,fields,message", [
    ("gemma2", {**GEMMA2}, "query_pre_attn_scalar = 32"),
    ("gemma2", {**GEMMA2_GGUF, "attn_logit_softcapping": None}, "attn_logit_softcapping"),
    ("gemma2", {**GEMMA2_GGUF, "layer_types": ["full_attention", "sliding_attention",
                                               "full_attention"]}, "layer_types"),
    ("gemma3_text", {**GEMMA3_GGUF, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding_attention"),
    ("gemma3_text", {**GEMMA3_GGUF, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}},
     "full_attention"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "swiglu_limit"),
])
def test_what_a_file_cannot_say_is_not_exported(tmp_path: Path, family: str, fields: dict,
                                                message: str) -> None:
    if family == "gpt_oss":
        source = build_gpt_oss(tmp_path / "source", **fields)
    else:
        source = build_random_model(tmp_path / "source", family, **fields)
    with pytest.raises(ValueError, match=message):
        export(source, tmp_path / "x.gguf", "F32")


def test_what_llama_cpp_reads_of_the_metadata() -> None:
    """Defaults where a key is absent (Gemma 2's window and softcaps), the 27B models' query
    scale by their layer count, Gemma 3 without a window all full, and keys llama.cpp would
    ignore against what it fixes refused by name."""
    base = {"embedding_length": 4608, "attention.head_count": 32,
            "attention.key_length": 128}
    g2 = read_fields({**base, "block_count": 46}, "gemma2", "m.gguf")
    assert g2["query_pre_attn_scalar"] == 144 and g2["sliding_window"] == 4096
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2["layer_types"][:3] == ["sliding_attention", "full_attention",
                                     "sliding_attention"]
    assert read_fields({**base, "block_count": 42}, "gemma2", "m")["query_pre_attn_scalar"] == 128
    g3 = read_fields({**base, "block_count": 7}, "gemma3", "m.gguf")
    assert g3["layer_types"] == ["full_attention"] * 7 and g3["sliding_window"] is None
    g3 = read_fields({**base, "block_count": 7, "attention.sliding_window": 512,
                      "rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
                     "gemma3", "m.gguf")
    assert g3["layer_types"].count("full_attention") == 1 and g3["layer_types"][5] == \
        "full_attention"
    assert g3["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(ConfigError, match="gemma3.attention.sliding_window_pattern = 4"):
        read_fields({**base, "block_count": 8, "attention.sliding_window_pattern": 4},
                    "gemma3", "m.gguf")
    oss = {**base, "block_count": 2, "attention.sliding_window": 128,
           "expert_feed_forward_length": 32, "expert_count": 4, "expert_used_count": 2,
           "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
           "rope.scaling.original_context_length": 4096}
    assert read_fields(oss, "gpt-oss", "m")["rope_parameters"] == {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="yarn_attn_factor: this YaRN parameter"):
        read_fields({**oss, "rope.scaling.yarn_attn_factor": 1.2}, "gpt-oss", "m.gguf")
