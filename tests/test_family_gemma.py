"""Gemma, Gemma 2, Gemma 3 and the multimodal Gemma 3's language model against transformers
(tests/family_check.py: tiny random fp32 models, greedy tokens equal, batched, chunked and
from the prefix cache, on the CPU kernels and on PyTorch's ops), with windows of 6 that
prompts and outputs outgrow, softcaps that bite, norms whose 1 + w is not 1; bf16 against
transformers' bf16; what the readers refuse, by name; reading configs as transformers does
(defaults of a sparse text_config, older rope fields, layer patterns)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from family_check import check_against_transformers, eos_of, prompts_of
from tiny_model import hf_greedy

from ipc.arch import UnsupportedModel
from ipc.families import arch_spec
from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_model, build_tokenizer
from stages.inprocess import InProcessEngine

SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 512}
# Gemma 2: alternating sliding (6) and full layers; caps low enough to change these scores
# and logits; a query scale that is not head_dim's.
GEMMA2 = {**SHAPE, "num_hidden_layers": 3, "sliding_window": 6, "attn_logit_softcapping": 5.0,
          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 32}
# Gemma 3: six layers, the sixth full (the 5:1 pattern); a head size of its own; each kind's
# rope its own (linear scaling on the full layers, as the real models have).
GEMMA3 = {**SHAPE, "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 6,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1e6}}}


def _random_norms(folder: Path, std: float = 0.3, qk_factor: float = 1.0) -> Path:
    """Every norm's stored weight w drawn from N(0, std) (transformers initialises them to 0,
    where 1 + w is 1 and a norm that forgot the offset would go unseen); q and k projections
    times `qk_factor` (scores times its square: a softcap of 5 then changes every prompt's
    tokens, where these small weights' scores of ~0.05 pass through it unchanged)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.randn(t.shape, generator=gen) * std
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = t * qk_factor
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _gemma3_multimodal(folder: Path, std: float = 0.03) -> Path:
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower of one layer) as transformers
    saves it: language_model.model.*, vision_tower.*, multi_modal_projector.*."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
           "pad_token_id": tok.pad_token_id}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32,
              "patch_size": 8}
    n = len(tok)  # (image markers inside the vocabulary: no token is remapped without images)
    cfg = Gemma3Config(text_config={**GEMMA3, "vocab_size": n, **ids}, vision_config=vision,
                       mm_tokens_per_image=4, boi_token_index=n - 3, eoi_token_index=n - 2,
                       image_token_index=n - 1, **ids)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    model.save_pretrained(folder)
    GenerationConfig(**ids).save_pretrained(folder)
    return _random_norms(folder)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma2")
    return _random_norms(build_random_model(folder, "gemma2", weight_std=0.03, **GEMMA2),
                         qk_factor=8.0)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3_text")
    return _random_norms(build_random_model(folder, "gemma3_text", weight_std=0.03, **GEMMA3))


def test_gemma_matches_transformers(tmp_path: Path) -> None:
    """Llama's pre-norm layer with Gemma's norms, sqrt(hidden) embeddings, a gelu-tanh MLP
    and a tied head."""
    folder = _random_norms(build_random_model(tmp_path, "gemma", **SHAPE))
    assert arch_spec(json.loads((folder / "config.json").read_text())).activation == "gelu_tanh"
    check_against_transformers(folder)


def test_gemma2_matches_transformers(gemma2_dir: Path) -> None:
    """Softcapped scores (the torch backend's explicit scores, the kernel's every path) and
    logits, sandwich norms, windows of 6 on every other layer."""
    spec = arch_spec(json.loads((gemma2_dir / "config.json").read_text()))
    assert [k.window for k in spec.layers] == [6, None, 6]
    assert {k.softcap for k in spec.layers} == {5.0} and spec.final_softcap == 3.0
    check_against_transformers(gemma2_dir)


@pytest.mark.slow
def test_gemma2_compiled_matches_transformers(gemma2_dir: Path) -> None:
    """The compiled forward: FlexAttention with the softcap as its score_mod and a block
    mask per window, one graph per layer kind."""
    check_against_transformers(gemma2_dir, max_new_tokens=12, cpu_kernels=(False,),
                               compile=True)


def test_gemma2_final_softcap_shapes_the_logprobs(gemma2_dir: Path) -> None:
    """The final softcap is monotonic (greedy tokens never see it): the logprobs do. Each
    sampled token's logprob is transformers' log_softmax of the capped logits."""
    from transformers import AutoModelForCausalLM

    prompt = prompts_of(gemma2_dir)[4]
    eng = InProcessEngine(str(gemma2_dir), max_num_batched_tokens=16)
    out = eng.run([("0", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2,
                                                ignore_eos=True))])["0", 0]
    model = AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
    for j, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp.top_logprobs, row.topk(2).values,
                                                     strict=True))


def test_gemma3_matches_transformers(gemma3_dir: Path) -> None:
    """Five sliding layers to one full, each kind with its rope, per-head q/k norms (on the
    CPU kernels through the fused decoder call)."""
    spec = arch_spec(json.loads((gemma3_dir / "config.json").read_text()))
    assert [k.rope for k in spec.layers] == ["sliding_attention"] * 5 + ["full_attention"]
    assert [k.window for k in spec.layers] == [6] * 5 + [None]
    check_against_transformers(gemma3_dir)


def test_gemma3_multimodal_runs_its_language_model(tmp_path: Path) -> None:
    """The vision tower's entries are skipped, the language model's names mapped; its
    tokens are transformers' Gemma3ForConditionalGeneration's on text prompts."""
    folder = _gemma3_multimodal(tmp_path)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.layers.") for n in names)
    check_against_transformers(folder, cpu_kernels=(True,))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_bf16_agrees_with_transformers_bf16(family: str, request: pytest.FixtureRequest
                                            ) -> None:
    """In bf16 the engine's products and softmax round in another order than transformers'
    (oneDNN's blocks, the kernel's online softmax), so a near tie of two logits may go the
    other way, and the rest of that prompt with it: these models' logits are small (about
    0.6 for Gemma 3, where bf16's step is 0.004) and prompt 1's first token is such a tie
    (0.6425 against 0.6391 in float32; transformers' own bf16 flips it). So each family is
    held to at least 6 of the 8 prompts' first 8 tokens equal (measured: 7 for Gemma 2, 6
    for Gemma 3 on the kernels, 8 and 7 on PyTorch's ops); a norm, rope or softcap rounded
    unlike transformers' shifts nearly every prompt."""
    folder: Path = request.getfixturevalue(f"{family}_dir")
    prompts = prompts_of(folder)
    want = hf_greedy(folder, prompts, 8, dtype="bfloat16")
    eng = InProcessEngine(str(folder), max_num_batched_tokens=16, max_num_seqs=4,
                          eos_token_ids=eos_of(folder), dtype=torch.bfloat16)
    got = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 6, (got, want)


def test_the_fused_call_runs_gemma_layers(gemma3_dir: Path) -> None:
    """(Its bits against the Python layers': tests/test_fused.py; against transformers: the
    CPU kernels' runs above, where it is on.)"""
    from stages.executor import kernels

    if not kernels.available():
        pytest.skip(f"CPU kernels: {kernels.load()}")
    assert InProcessEngine(str(gemma3_dir), cpu_kernels=True).runner.model.fused_layers is not None


# ---------------------------------------------------------------- reading configs


def _text(**fields: Any) -> dict[str, Any]:
    return {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 32, **fields}


def test_a_sparse_multimodal_config_reads_gemma3_defaults() -> None:
    """google/gemma-3-4b-it's config.json names six text fields; the rest are
    Gemma3TextConfig's defaults, the older rope fields included (rope_scaling on the full
    layers only, rope_local_base_freq on the sliding ones)."""
    cfg = {"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}}
    spec = arch_spec(cfg)
    assert (spec.family, spec.num_heads, spec.num_kv_heads, spec.head_dim) == ("gemma3", 8, 4,
                                                                                256)
    assert spec.vocab_size == 262_208 and spec.max_positions == 131_072
    assert spec.scale == 256 ** -0.5 and spec.tie_word_embeddings and spec.qk_norm == "head"
    assert [k.window for k in spec.layers[:6]] == [1024] * 5 + [None]
    assert spec.ropes["full_attention"] == {"factor": 8.0, "rope_type": "linear",
                                            "rope_theta": 1_000_000.0}
    assert spec.ropes["sliding_attention"]["rope_theta"] == 10_000.0


def test_layer_patterns_without_layer_types_are_transformers() -> None:
    gemma2 = {**_text(), "model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 8}
    assert [k.window for k in arch_spec(gemma2).layers] == [8, None, 8, None]
    pattern = arch_spec(_text(sliding_window=8, sliding_window_pattern=3))
    assert [k.window for k in pattern.layers] == [8, 8, None, 8, 8, None]


@pytest.mark.parametrize(("cfg", "field"), [
    (_text(rope_parameters={"sliding_attention": {"rope_type": "default"},
                            "full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
     "rope_parameters['full_attention']: RoPE type 'dynamic'"),
    (_text(use_bidirectional_attention=True), "use_bidirectional_attention = True"),
    (_text(hidden_activation="gelu"), "hidden_activation = 'gelu'"),
    (_text(layer_types=["chunked_attention"] * 6), "layer_types"),
    ({**_text(), "model_type": "gemma2", "hidden_activation": "silu"}, "hidden_activation"),
    ({"model_type": "gemma4_text"}, "per-layer inputs: hidden_size_per_layer_input"),
    ({"model_type": "gemma3n"}, "Gemma 3n (per-layer inputs"),
])
def test_what_gemma_lacks_is_refused_by_name(cfg: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedModel) as info:
        arch_spec(cfg)
    assert field in str(info.value)


def test_an_image_part_is_refused_offline() -> None:
    from pipeline.offline import _text as message_text

    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(ValueError, match=r"image content part \(image_url\)"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}])
