"""Embeddings (pooling requests): the pooling a model folder declares (ipc/pooling.py), and the
in-process engine's vectors against sentence-transformers on the same folder (last-token, cls and
mean pooling, prompts prefilled in chunks, sharing the batch with generation, over the prefix
cache), the scheduler's and tokenizer's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ipc.errors import ConfigError
from ipc.messages import SamplingParams
from ipc.params import RequestError, validate_params
from ipc.pooling import PoolingConfig
from pipeline.tools.random_model import add_pooling_modules, build_random_llama

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog, and then it runs far away "
         "into the hills where nobody can find it any more.",
         "def main():\n    return 42\n", "x" * 3, "Bonjour tout le monde, ceci est un test."]


def embed_params(mode: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=mode)


@pytest.fixture(scope="module")
def st_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama as a sentence-transformers folder, once per pooling mode (the
    same weights: the same seed)."""
    folders = {}
    for mode in ("last", "mean", "cls"):
        folder = build_random_llama(tmp_path_factory.mktemp(f"st-{mode}"), num_layers=2,
                                    hidden=64, weight_std=0.05, seed=3)
        folders[mode] = add_pooling_modules(folder, mode)
    return folders


def reference(folder: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' embeddings [N, hidden] of texts, float32."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, batch_size=2, convert_to_numpy=True)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the folder's pooling


def test_pooling_read_from_the_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    default = PoolingConfig.from_dir(tmp_path)
    assert (default.mode, default.normalize, default.matryoshka_dimensions) == ("last", True,
                                                                                None)
    add_pooling_modules(tmp_path, "mean", normalize=False)
    got = PoolingConfig.from_dir(tmp_path)
    assert (got.mode, got.normalize) == ("mean", False)
    add_pooling_modules(tmp_path, "cls")
    assert (PoolingConfig.from_dir(tmp_path).mode, PoolingConfig.from_dir(tmp_path).normalize
            ) == ("cls", True)
    pool_file = tmp_path / "1_Pooling" / "config.json"
    pool_file.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_dir(tmp_path)


def test_dimensions_only_where_the_model_declares_matryoshka(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [4, 8]}))
    cfg = PoolingConfig.from_dir(tmp_path)
    assert cfg.check_dimensions(None) is None and cfg.check_dimensions(4) is None
    assert "[4, 8]" in (cfg.check_dimensions(5) or "")
    raw = np.arange(1, 9, dtype="<f4").tobytes()
    cut = cfg.finish(raw, 4)
    assert cut.shape == (4,) and np.isclose(np.linalg.norm(cut), 1.0)
    assert np.allclose(cut, np.arange(1, 5) / np.linalg.norm(np.arange(1, 5)))
    plain = PoolingConfig()
    assert "no Matryoshka" in (plain.check_dimensions(4) or "")


def test_a_pooling_request_refuses_what_only_generation_means() -> None:
    validate_params(embed_params("mean"), 100)
    for params, field in [(embed_params("max"), "pooling"),
                          (SamplingParams(max_tokens=1, pooling="last", n=2), "n"),
                          (SamplingParams(max_tokens=5, pooling="last"), "max_tokens"),
                          (SamplingParams(max_tokens=1, pooling="last", logprobs=1),
                           "logprobs"),
                          (SamplingParams(max_tokens=1, pooling="last", logit_bias={3: 1.0}),
                           "logit_bias"),
                          (SamplingParams(max_tokens=1, pooling="last", stop=["x"]), "stop"),
                          (SamplingParams(max_tokens=1, pooling="last", lora_name="a"),
                           "lora_name")]:
        with pytest.raises(RequestError) as err:
            validate_params(params, 100)
        assert err.value.param == field


# ---------------------------------------------------------------- the engine's vectors


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_in_process_vectors_match_sentence_transformers(st_folders: dict[str, Path],
                                                        mode: str) -> None:
    """Embeddings beside generations, prompts longer than the step's token budget (prefilled
    in chunks over several steps), each text twice (the second over the prefix cache where
    the mode allows it): every vector's cosine similarity with sentence-transformers' is at
    least 0.9999, and the generations are those of the engine without embeddings."""
    from transformers import AutoTokenizer

    from stages.inprocess import InProcessEngine

    folder = st_folders[mode]
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = PoolingConfig.from_dir(folder)
    assert (cfg.mode, cfg.normalize) == (mode, True)
    engine = InProcessEngine(str(folder), max_num_seqs=6, max_num_batched_tokens=16,
                             block_size=4)
    gen = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    assert max(map(len, prompts)) > 16  # (chunked)
    alone = engine.generate(prompts[:2], gen)
    requests = [(f"g{i}", ids, gen) for i, ids in enumerate(prompts[:2])]
    requests += [(f"e{i}", ids, embed_params(mode)) for i, ids in enumerate(prompts)]
    first = engine.run(requests)
    again = engine.run([(f"e{i}", ids, embed_params(mode)) for i, ids in enumerate(prompts)])
    want = reference(folder, TEXTS)
    for results in (first, again):
        for i in range(len(TEXTS)):
            result = results[f"e{i}", 0]
            assert result.token_ids == [] and result.finish_reason == "stop"
            assert result.embedding is not None
            got = cfg.finish(result.embedding)
            cosine = float(got @ want[i] / np.linalg.norm(want[i]))
            assert cosine >= 0.9999, (mode, i, cosine)
    assert [first[f"g{i}", 0].token_ids for i in range(2)] == alone
    cached = [again[f"e{i}", 0].num_cached_tokens for i in range(len(TEXTS))]
    if mode != "last":  # (computed in full: the cache holds no hidden states)
        assert cached == [0] * len(TEXTS)
    else:  # (the long prompts' full blocks came from the cache)
        assert max(cached) >= 16


def test_runs_that_cannot_pool_refuse_by_name(st_folders: dict[str, Path]) -> None:
    """Tensor and pipeline parallelism and the timed device refuse embeddings at the
    tokenizer stage (PipelineConfig.embedding_refusal), naming `pooling`."""
    from ipc.config import ExecutorConfig, PipelineConfig
    from ipc.messages import AddRequest
    from ipc.model_info import ModelInfo
    from stages.tokenizer import TokenizerCore

    info = ModelInfo.from_dir(st_folders["last"])
    assert PipelineConfig(model=info).embedding_refusal is None
    for executor in (ExecutorConfig(tensor_parallel_size=2),
                     ExecutorConfig(pipeline_parallel_size=2),
                     ExecutorConfig(timed=(1.0, 0.0, 0.0))):
        why = PipelineConfig(model=info, executor=executor).embedding_refusal
        assert why is not None
        core = TokenizerCore(info.path, info.max_model_len, info.vocab_size,
                             embedding_refusal=why)
        with pytest.raises(RequestError) as err:
            core.process(AddRequest("r", "", "hello", None, None, embed_params("last"), 0.0))
        assert err.value.param == "pooling" and err.value.message == why
        core.process(AddRequest("g", "", "hello", None, None, SamplingParams(max_tokens=2),
                                0.0))
    # a prompt the context cannot hold: the error says what room an embedding needs
    core = TokenizerCore(info.path, 4, info.vocab_size)
    for params, room in ((embed_params("last"), "an embedding's last chunk computes"),
                         (SamplingParams(max_tokens=1), "at least one output token")):
        with pytest.raises(RequestError) as err:
            core.process(AddRequest("r", "", "one two three four five", None, None, params,
                                    0.0))
        assert "context holds 4" in err.value.message and room in err.value.message
