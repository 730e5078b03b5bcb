"""Families with sliding windows on some layers, layers without rope, or post-norm layers,
against transformers (family_check.py): SmolLM3 (NoPE layers, windows on them), OLMo 2
(post-norms, q/k norms over the whole projections), OLMo 3 (OLMo 2 with sliding layers,
a rope per layer type), Qwen2/Qwen3 with use_sliding_window (the layers from
max_window_layers on); and what of their configs the engine does not implement, refused by
name. Tiny random models whose windows (6 positions) the prompts and outputs outgrow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from family_check import check_against_transformers, eos_of, prompts_of
from tiny_model import hf_greedy

from ipc.arch import UnsupportedModel
from ipc.families import arch_spec
from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_model
from stages.inprocess import InProcessEngine

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # layers 1 and 3 without rope, windowed (SmolLM3Config's default layer_types)
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0],
                            "use_sliding_window": True, "sliding_window": 6}),
    "olmo2": ("olmo2", {"num_hidden_layers": 2}),
    # three sliding layers, then a full one, each kind with its own rope theta
    "olmo3": ("olmo3", {"num_hidden_layers": 4, "sliding_window": 6, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}}),
    # the last of three layers windowed
    "qwen2-window": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True,
                               "sliding_window": 6, "max_window_layers": 2}),
    "qwen3-window": ("qwen3", {"num_hidden_layers": 2, "use_sliding_window": True,
                               "sliding_window": 6, "max_window_layers": 1, "head_dim": 16}),
}


def _build(tmp_path: Path, name: str) -> Path:
    model_type, fields = MODELS[name]
    return build_random_model(tmp_path / name, model_type, **TINY, **fields)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    folder = _build(tmp_path, name)
    spec = arch_spec(json.loads((folder / "config.json").read_text()))
    windows = [k.window for k in spec.layers]
    if name != "olmo2":  # (the windows were read: some layers have one, some not)
        assert 6 in windows and None in windows
    check_against_transformers(folder)


def test_the_layers_kinds_are_transformers(tmp_path: Path) -> None:
    """Which layers window and rope, as the config classes lay them out by default: SmolLM3
    every fourth layer without rope (windowed with use_sliding_window), OLMo 3 three
    sliding layers then a full one, Qwen the layers from max_window_layers on; an older
    OLMo 3 config's rope_scaling is its full layers' rope only."""
    base = {"vocab_size": 64, "num_hidden_layers": 8, **TINY}
    smol = arch_spec({"model_type": "smollm3", **base, "use_sliding_window": True,
                      "sliding_window": 32})
    assert [k.rope for k in smol.layers] == ["default", "default", "default", None] * 2
    assert [k.window for k in smol.layers] == [None, None, None, 32] * 2
    olmo3 = arch_spec({"model_type": "olmo3", **base, "sliding_window": 32,
                       "rope_theta": 500000.0,
                       "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                        "original_max_position_embeddings": 64}})
    assert [k.window for k in olmo3.layers] == [32, 32, 32, None] * 2
    assert olmo3.ropes["full_attention"]["rope_type"] == "yarn"
    assert olmo3.ropes["sliding_attention"] == {}
    assert olmo3.qk_norm == "proj" and olmo3.norms == "post"
    qwen = arch_spec({"model_type": "qwen2", **base, "use_sliding_window": True,
                      "sliding_window": 32, "max_window_layers": 5})
    assert [k.window for k in qwen.layers] == [None] * 5 + [32] * 3
    off = arch_spec({"model_type": "qwen2", **base, "sliding_window": 32,
                     "max_window_layers": 5})
    assert off.sliding_window is None  # (use_sliding_window off: transformers drops it)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"model_type": "smollm3", "no_rope_layers": [0] * 4}, "no_rope_layers"),
    ({"model_type": "smollm3", "layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"model_type": "olmo3", "sliding_window": None}, "sliding_window"),
    ({"model_type": "olmo3", "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0},
        "sliding_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"model_type": "olmo2", "layer_types": ["full_attention", "sliding_attention"] * 2},
     "layer_types"),
    ({"model_type": "olmo2", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"] * 2},
     "layer_types"),
    ({"model_type": "mistral", "layer_types": ["full_attention", "sliding_attention"] * 2},
     "layer_types"),
])
def test_what_the_engine_does_not_implement_is_refused_by_name(change: dict,
                                                               field: str) -> None:
    cfg = {"vocab_size": 64, "num_hidden_layers": 4, **TINY, **change}
    with pytest.raises(UnsupportedModel, match=f"{field} = "):
        arch_spec(cfg)


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_olmo_splits_across_ranks_as_its_heads_do(model_type: str) -> None:
    """The q/k norms over the whole projections split with the heads (their squares summed
    across ranks: test_tensor_parallel.py), so only the heads must divide: 4 query and 2
    key/value heads split over 2 ranks, not over 4."""
    from stages.executor.preflight import check_divisible

    fields = {"sliding_window": 6} if model_type == "olmo3" else {}
    spec = arch_spec({"model_type": model_type, "vocab_size": 64, "num_hidden_layers": 4,
                      **TINY, **fields})
    check_divisible(spec, 2)
    with pytest.raises(UnsupportedModel, match="num_key_value_heads = 2 is not divisible"):
        check_divisible(spec, 4)


@pytest.mark.parametrize("name", ["olmo2", "olmo3"])
def test_bfloat16_mostly_agrees_with_transformers(tmp_path: Path, name: str) -> None:
    """OLMo's norms in bfloat16, rounded as Olmo2RMSNorm does. The engine still rounds some
    steps otherwise than transformers (its rope tables are in the model's dtype,
    transformers' OLMo ropes in float32; products sum in another order), and one flipped
    near-tie changes every later token of a random model's flat logits: at least 5 of the 8
    prompts' 16 greedy tokens equal (measured on this machine: OLMo 2 7, OLMo 3 6; SmolLM3
    and Qwen2 with windows, Llama's rounding, 5 and 6), and every prompt's first 2 (a wrong
    layer, norm or window would flip most of them at once)."""
    import torch

    folder = _build(tmp_path, name)
    prompts = prompts_of(folder)
    want = hf_greedy(folder, prompts, 16, dtype="bfloat16")
    eng = InProcessEngine(str(folder), dtype=torch.bfloat16, max_num_batched_tokens=16,
                          max_num_seqs=4, eos_token_ids=eos_of(folder))
    got = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 5, (got, want)
    assert all(g[:2] == w[:2] for g, w in zip(got, want, strict=True)), (got, want)


@pytest.mark.slow
def test_olmo3_compiled_matches_transformers(tmp_path: Path) -> None:
    """The compiled forward (FlexAttention, a block mask per window) on OLMo 3: its
    post-norm layer, sliding and full layers (two kinds of compiled layer, one graph each per
    step size) and a rope per layer type; greedy tokens equal transformers'."""
    from tiny_model import hf_greedy

    from stages.executor.backends.select import compile_unavailable

    if compile_unavailable("cpu") is not None:
        pytest.skip("TorchInductor needs a C++ compiler here")
    folder = _build(tmp_path, "olmo3")
    prompts = prompts_of(folder)[3:7]
    want = hf_greedy(folder, prompts, max_new_tokens=12)
    eng = InProcessEngine(str(folder), compile=True, max_num_batched_tokens=8,
                          max_num_seqs=2, eos_token_ids=eos_of(folder))
    assert eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0)) == want
    stats = eng.runner.compile_stats
    assert 0 < stats.num_graphs <= stats.max_graphs
