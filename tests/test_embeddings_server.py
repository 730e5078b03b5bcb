"""POST /v1/embeddings through `run_pipeline serve` and the official `openai` package (its
default base64 and float), against sentence-transformers on the same folder (mean pooling,
Matryoshka dimensions declared), the 400s that name the field, and LLM.embed."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_embeddings import TEXTS, reference
from test_server import Server, serve

from pipeline.tools.random_model import add_pooling_modules, build_random_llama

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]
DIMS = [16, 32]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_random_llama(tmp_path_factory.mktemp("st-served"), num_layers=2, hidden=64,
                               weight_std=0.05, seed=5)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": DIMS}))
    return add_pooling_modules(model, "mean")


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Server]:
    with serve(folder, "--max-num-batched-tokens", "16", "--max-num-seqs", "8") as s:  # chunks
        yield s


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)  # type: ignore[no-any-return]


def test_the_openai_sdk_gets_sentence_transformers_vectors(server: Server,
                                                           folder: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    want = reference(folder, TEXTS)
    for fmt in ("base64", "default", "float"):  # (by default the SDK asks for base64 and
        # decodes it; asked for base64, it hands back the text)
        extra = {} if fmt == "default" else {"encoding_format": fmt}
        r = client.embeddings.create(model=server.model, input=TEXTS, **extra)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        for d, w in zip(r.data, want, strict=True):
            got = (np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64"
                   else np.asarray(d.embedding, dtype=np.float32))
            assert got.shape == w.shape
            assert float(got @ unit(w)) >= 0.9999
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    assert r.usage.prompt_tokens >= len(ids)
    one = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    assert one.usage.prompt_tokens == len(ids) == one.usage.total_tokens
    assert np.allclose(one.data[0].embedding, r.data[1].embedding, atol=1e-5)
    short = client.embeddings.create(model=server.model, input=TEXTS[:2], dimensions=DIMS[0],
                                     user="me", encoding_format="float")
    for d, w in zip(short.data, want, strict=False):
        got = np.asarray(d.embedding)
        assert got.shape == (DIMS[0],) and np.isclose(np.linalg.norm(got), 1.0)
        assert float(got @ unit(w[:DIMS[0]])) >= 0.9999


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[1], []]}, "input"),
    ({"input": [1, 10**9]}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "pooling": "max"}, "pooling"), ({"input": "x" * 5000}, "input"),
])
def test_bad_embedding_requests_name_the_field(server: Server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_llm_embed(folder: Path) -> None:
    from pipeline import LLM

    want = reference(folder, TEXTS[:2])
    with LLM(model=str(folder), max_num_seqs=4) as llm:
        outs = llm.embed(TEXTS[:2], use_tqdm=False)
        assert [o.error for o in outs] == [None, None]
        for out, w in zip(outs, want, strict=True):
            assert out.embedding is not None and out.num_prompt_tokens > 0
            assert float(np.asarray(out.embedding) @ unit(w)) >= 0.9999
        with pytest.raises(ValueError, match="Matryoshka"):
            llm.embed("x", dimensions=8)


def test_the_bench_row(folder: Path, tmp_path: Path) -> None:
    """`scripts/bench embed`, tiny: its rows come out and its vectors are the reference's."""
    from pipeline.tools.bench import main

    out = tmp_path / "embed.json"
    assert main(["embed", "--model", str(folder), "--num-texts", "8", "--input-len", "24",
                 "--batch-size", "4", "--num-generations", "2", "--output-len", "4",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pooling"] == "mean" and report["texts_per_s"] > 0
    assert report["min_cosine"] >= 0.9999 and set(report["seconds"]) == {"embed", "generate",
                                                                         "mixed"}
