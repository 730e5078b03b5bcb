"""Prompt logprobs: computed by the executor for the requests that ask (a prompt chunk's
logits), equal to transformers' through chunked prefill, preemption and run-ahead; such a
prompt takes no prefix-cache hit, others pay nothing. Over HTTP: echo with and without
logprobs, max_tokens 0, vLLM's prompt_logprobs, streaming."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from test_server import Server, serve

from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from stages.inprocess import InProcessEngine

PROMPTS = [[5, 9, 13, 40, 41, 42, 43, 44, 50, 60, 70, 80, 90, 100, 7, 8, 9, 10, 11], [7, 8],
           [3], [20, 21, 22, 23, 24, 25, 26]]


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("depth, memory", [(1, 1 << 24), (2, 1 << 24), (2, 9 * 2048)])
def test_prompt_logprobs_equal_transformers(tiny_model_dir: Path, depth: int,
                                            memory: int) -> None:
    """An 8-token budget chunks the long prompt; the small cache preempts."""
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    engine = InProcessEngine(str(tiny_model_dir), block_size=4, max_num_batched_tokens=8,
                             depth=depth, kv_cache_memory=memory, eos_token_ids=eos)
    results = engine.run([(str(i), p, SamplingParams(max_tokens=12, temperature=0.0,
                                                     ignore_eos=True, prompt_logprobs=3))
                          for i, p in enumerate(PROMPTS)])
    for i, ids in enumerate(PROMPTS):
        entries = results[str(i), 0].prompt_logprobs
        assert entries is not None and len(entries) == len(ids)
        assert entries[0].token_id == ids[0] and math.isnan(entries[0].logprob)
        ref = reference(tiny_model_dir, ids)
        for j, e in enumerate(entries[1:], start=1):
            assert e.token_id == ids[j]
            assert e.logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
            assert e.rank == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
            assert e.top_ids == ref[j - 1].topk(3).indices.tolist()
    if memory < 1 << 20:
        assert engine.scheduler.num_preemptions > 0


def test_a_scored_prompt_takes_no_prefix_hit_and_others_pay_nothing(
        tiny_model_dir: Path) -> None:
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    engine = InProcessEngine(str(tiny_model_dir), block_size=4, eos_token_ids=eos)
    prompt = PROMPTS[0]
    engine.run([("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    plain = engine.run([("plain", prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    assert plain["plain", 0].num_cached_tokens > 0 and plain["plain", 0].prompt_logprobs is None
    scored = engine.run([("scored", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                           prompt_logprobs=0))])
    assert scored["scored", 0].num_cached_tokens == 0
    assert len(scored["scored", 0].prompt_logprobs or []) == len(prompt)
    assert scored["scored", 0].token_ids == plain["plain", 0].token_ids


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    with serve(tiny_model_dir) as s:
        yield s


def complete(server: Server, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_the_prompt(server: Server) -> None:
    ids = PROMPTS[0]
    ref = reference(server.model_dir, ids)
    answer = complete(server, prompt=ids, max_tokens=3, logprobs=2, echo=True)
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) <= 2
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
    plain = complete(server, prompt=ids, max_tokens=3, logprobs=2)["choices"][0]
    assert choice["text"].endswith(plain["text"]) and len(choice["text"]) > len(plain["text"])
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                            abs=1e-4)
    assert answer["usage"]["completion_tokens"] == 3


def test_echo_without_logprobs_and_max_tokens_zero(server: Server) -> None:
    answer = complete(server, prompt="hello world", max_tokens=0, echo=True)
    assert answer["choices"][0]["text"] == "hello world"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs(server: Server) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(server.model_dir)("hello there")["input_ids"]
    ref = reference(server.model_dir, ids)
    choice = complete(server, prompt="hello there", max_tokens=1,
                      prompt_logprobs=2)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        entry = plp[j][str(ids[j])]
        assert entry["logprob"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert len(plp[j]) <= 3  # the token and its 2 alternatives
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_a_streamed_echo_adds_up_to_the_whole_answer(server: Server) -> None:
    body = {"prompt": "count: 1, 2,", "max_tokens": 4, "logprobs": 1, "echo": True,
            "temperature": 0}
    whole = complete(server, **body)["choices"][0]
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks if c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
