"""LoRA adapters served (live): a request's model names an adapter and gets that adapter's
greedy tokens (those of peft's merged weights), /v1/models lists it under the model, an
unknown model is a 404 naming what is served; with --enable-lora-updating an adapter loaded
at run time serves its merged tokens, is listed, and is gone (404) once unloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_lora import make_adapter, merge_adapter
from test_server import Server, serve

from ipc.messages import SamplingParams
from stages.inprocess import InProcessEngine

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-served")
    make_adapter(tiny_model_dir, root / "alpha", 4, 8, ["q_proj", "v_proj", "down_proj"],
                 False, seed=3)
    merge_adapter(tiny_model_dir, root / "alpha", root / "merged")
    make_adapter(tiny_model_dir, root / "beta", 8, 16, ["k_proj", "o_proj", "up_proj"],
                 False, seed=4)
    merge_adapter(tiny_model_dir, root / "beta", root / "beta-merged")
    return {"alpha": root / "alpha", "merged": root / "merged", "beta": root / "beta",
            "beta-merged": root / "beta-merged"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter: dict[str, Path]) -> Iterator[Server]:
    # one slot for alpha, one for the adapters loaded at run time
    with serve(tiny_model_dir, "--lora-modules", f"alpha={adapter['alpha']}",
               "--enable-lora-updating", "--max-loras", "2") as s:
        yield s


def greedy_text(folder: Path, prompt: str, max_tokens: int) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    eng = InProcessEngine(str(folder), cpu_kernels=False)
    (ids,) = eng.generate([tok(prompt)["input_ids"]],
                          SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True))
    return tok.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]


def test_a_request_runs_under_the_adapter_it_names(server: Server,
                                                   adapter: dict[str, Path]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    base = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    served = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "alpha"},
                        timeout=60).json()
    assert served["model"] == "alpha" and base["model"] == server.model
    want = greedy_text(adapter["merged"], PROMPT, 10)
    assert served["choices"][0]["text"] == want != base["choices"][0]["text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "alpha"


def test_models_lists_the_adapters(server: Server) -> None:
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in data] == [
        (server.model, None, server.model), ("alpha", server.model, server.model)]


def test_unknown_models_are_refused(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=10,
                   json={"model": "beta", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "'alpha'" in error["message"]


def test_an_adapter_loaded_at_run_time_serves_until_unloaded(
        server: Server, adapter: dict[str, Path]) -> None:
    def post(route: str, **body: str) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)

    r = post("load_lora_adapter", lora_name="gamma", lora_path=str(adapter["beta"] / "none"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json" in r.json()["error"]["message"]
    r = post("load_lora_adapter", lora_name="beta", lora_path=str(adapter["beta"]))
    assert r.status_code == 200 and "beta" in r.text
    for name in ("beta", "alpha"):  # (loaded already: now, or at start)
        r = post("load_lora_adapter", lora_name=name, lora_path=str(adapter["beta"]))
        assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [server.model, "alpha", "beta"]
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "beta"},
                     timeout=60).json()
    assert got["model"] == "beta"
    assert got["choices"][0]["text"] == greedy_text(adapter["beta-merged"], PROMPT, 10)
    r = post("unload_lora_adapter", lora_name="alpha")
    assert r.status_code == 400 and "--lora-modules" in r.json()["error"]["message"]
    # unloaded while a request runs under it: that request finishes, under the adapter
    long = {**body, "model": "beta", "max_tokens": 64, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert post("unload_lora_adapter", lora_name="beta").status_code == 200
        chunks = [first, *(line for line in lines if line.startswith("data: "))]
    assert chunks[-1] == "data: [DONE]"
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1]
                   if json.loads(c[6:])["choices"])
    assert text == greedy_text(adapter["beta-merged"], PROMPT, 64)
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "beta"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post("unload_lora_adapter", lora_name="beta").status_code == 404
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [server.model, "alpha"]
