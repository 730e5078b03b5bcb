"""Every decoder layer in one call (stages/executor/fused.py, csrc/decoder_layers.cpp): the
same bits as the Python layers (greedy tokens and prompt log-probs, through the scheduler
and executor cores) for every family and weight format it runs (Llama's pre-norm layer, with
Qwen3's q/k norms; Gemma 2's and 3's sandwich layer: 1 + w norms, gelu-tanh, per-layer
windows, softcaps and ropes), and the Python layers where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_marks import needs_kernels, needs_quantized_kernels

from ipc.messages import SamplingParams
from pipeline.tools.random_model import build_random_llama, build_random_model
from stages.inprocess import InProcessEngine

pytestmark = needs_kernels  # (the one call is decoder_layers.cpp's)
PROMPTS = [[1, 5, 9, 14, 3, 7], [2, 8, 8, 8], [11, 4, 6, 2, 9, 10, 12, 1, 3, 5, 5, 6, 7, 8]]
GEMMA_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
# Gemma (1): Llama's layer with 1 + w norms and gelu-tanh; Gemma 2: sliding (6) and full
# layers in turn, a softcap and a query scale not head_dim's; Gemma 3: five sliding layers to
# one full, each kind its rope, per-head q/k norms.
GEMMAS = {
    "gemma": {**GEMMA_SHAPE, "num_hidden_layers": 2},
    "gemma2": {**GEMMA_SHAPE, "num_hidden_layers": 3, "sliding_window": 6,
               "attn_logit_softcapping": 5.0, "query_pre_attn_scalar": 32},
    "gemma3_text": {**GEMMA_SHAPE, "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 6,
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1e6}}},
}


def _model(folder: Path, arch: str) -> Path:
    """A tiny random model: build_random_llama's `arch`, or a Gemma of GEMMAS whose norms'
    stored w are N(0, 0.3) (1 + w not 1: a norm without its offset shows) and whose q and k
    are 8 times larger (scores the softcap of 5 bends)."""
    if arch not in GEMMAS:
        return build_random_llama(folder, arch=arch)
    from safetensors.torch import load_file, save_file

    build_random_model(folder, arch, weight_std=0.03, **GEMMAS[arch])
    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.3
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = t * 8.0
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _run(engine: InProcessEngine) -> dict:
    """Prefill chunks (a 16-token budget splits the long prompt) and decode steps of 3
    sequences; seeded sampling and prompt log-probs."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0,
                            logprobs=1)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    requests = [(str(i), p, greedy) for i, p in enumerate(PROMPTS)]
    requests.append(("s", PROMPTS[0], seeded))
    return {key: (r.token_ids, [lp.logprob for lp in r.prompt_logprobs or []],
                  [lp.logprob for lp in r.logprobs or []])
            for key, r in engine.run(requests).items()}


@pytest.mark.parametrize("arch,dtype,quantization", [
    ("llama", torch.float32, None),
    ("qwen2", torch.bfloat16, None),  # q/k/v biases, a tied head
    ("llama-bias", torch.float32, None),  # o and MLP biases too
    ("mistral-window", torch.float32, None),  # a sliding window
    ("qwen3", torch.bfloat16, None),  # per-head q/k norms
    ("gemma", torch.bfloat16, None),
    ("gemma2", torch.float32, None),
    ("gemma2", torch.bfloat16, None),
    ("gemma3_text", torch.float32, None),
    ("gemma3_text", torch.bfloat16, None),  # (the gelu after AVX512-BF16's product)
    pytest.param("llama", torch.bfloat16, "int4", marks=needs_quantized_kernels),
    pytest.param("qwen2", torch.float32, "int8", marks=needs_quantized_kernels),
    pytest.param("gemma3_text", torch.float32, "int8", marks=needs_quantized_kernels),
    # (on AMX, both widened on the tiles: llama's gate/up gated, gemma's gelu after it)
    pytest.param("gemma3_text", torch.bfloat16, "int8", marks=needs_quantized_kernels),
])
def test_one_call_gives_the_bits_of_the_python_layers(tmp_path: Path, arch: str,
                                                      dtype: torch.dtype,
                                                      quantization: str | None) -> None:
    folder = _model(tmp_path / arch, arch)
    engine = InProcessEngine(str(folder), dtype=dtype, quantization=quantization,
                             max_num_batched_tokens=16)
    assert engine.runner.model.fused_layers is not None
    python = InProcessEngine(str(folder), dtype=dtype, quantization=quantization,
                             max_num_batched_tokens=16)
    python.runner.model.fused_layers = None
    assert _run(engine) == _run(python)


def test_the_python_layers_run_where_one_call_does_not_apply(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    olmoe = build_random_model(tmp_path / "olmoe", "olmoe", hidden_size=64,
                               intermediate_size=32, num_hidden_layers=2, num_experts=4,
                               num_experts_per_tok=2, num_attention_heads=4,
                               num_key_value_heads=2)
    with caplog.at_level("INFO", logger="stages.executor.fused"):
        assert InProcessEngine(str(olmoe)).runner.model.fused_layers is None
    assert "layer 0: q/k norms over the whole projections" in caplog.text
    llama = build_random_llama(tmp_path / "llama")
    assert InProcessEngine(str(llama), cpu_kernels=False).runner.model.fused_layers is None
    assert InProcessEngine(str(llama)).runner.model.fused_layers is not None


@pytest.mark.parametrize("arch,dtype,quantization,fused", [
    ("llama-bias", torch.float32, None, True),  # MKL's products
    ("llama-bias", torch.float32, None, False),  # (the Python layers)
    ("llama", torch.float32, None, True),  # no biases: MKL's one-row path where it agrees
    ("llama", torch.bfloat16, None, True),  # AMX's products where the CPU has them
    ("gemma3_text", torch.bfloat16, None, True),  # the sandwich layer's last norms
    pytest.param("qwen2", torch.float32, "int8", True, marks=needs_quantized_kernels),
])
def test_the_last_layer_past_attention_on_the_logits_rows_alone_gives_their_bits(
        tmp_path: Path, arch: str, dtype: torch.dtype, quantization: str | None,
        fused: bool) -> None:
    """Prompt chunks run the last layer's output projection and MLP on the rows whose logits
    are sampled or scored only: tokens and log-probs are those of the whole last layer,
    beside a request whose prompt log-probs keep every row of its chunks."""
    folder = _model(tmp_path / "m", arch)
    engines = [InProcessEngine(str(folder), dtype=dtype, quantization=quantization,
                               max_num_batched_tokens=16) for _ in range(2)]
    rows: list[int] = []
    for engine in engines:
        model = engine.runner.model
        assert model.trim_last_layer and (model.fused_layers is not None)
        if not fused:
            model.fused_layers = None
    engines[1].runner.model.trim_last_layer = False
    engines[0].runner.model.model.layers[-1].mlp.register_forward_hook(
        lambda _module, args, _out: rows.append(args[0].shape[0]))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                            logprobs=1)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    requests = [(str(i), p, greedy) for i, p in enumerate(PROMPTS)]
    requests += [("s", PROMPTS[2], seeded), ("p", PROMPTS[0] + PROMPTS[2], scored)]
    trimmed, whole = ({key: (r.token_ids, [(lp.logprob, lp.top_logprobs) for lp in r.logprobs
                                           or []],
                             [lp.logprob for lp in r.prompt_logprobs or []])
                       for key, r in engine.run(requests).items()} for engine in engines)
    assert trimmed == whole
    # (the first step: 16 tokens of three prompts, 2 of them last; decode steps keep all)
    assert rows[0] == 2 and min(rows) < 16
