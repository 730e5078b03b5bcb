"""The OpenAI request mapping (every field onto SamplingParams, errors naming the field), the
response and chunk shapes, the rate limiter and the overload answer, without a server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from ipc.config import ServerOptions
from ipc.messages import ErrorKind, RequestOutput, SamplingParams, SchedulerStats, TokenLogprob
from ipc.outputs import SampleResult
from pipeline.server.errors import ApiError
from pipeline.server.limits import RateLimiter
from pipeline.server.openai_parse import parse_chat, parse_completion
from pipeline.server.openai_render import chunk_json, output_error, response_json

V = 1000


def test_every_completion_field_maps_onto_sampling_params() -> None:
    parsed = parse_completion({
        "model": "m", "prompt": ["a", "b"], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "n": 2, "stop": "END", "seed": 7, "logprobs": 3, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [4], "best_of": 2,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "priority": 3,
        "stream": True, "stream_options": {"include_usage": True}, "user": "x",
        "logit_bias": {"5": -100, "12": 2.5}}, V)
    assert parsed.prompts == ["a", "b"] and parsed.stream and parsed.include_usage
    assert parsed.params == SamplingParams(
        max_tokens=9, temperature=0.5, stop_token_ids=[4], ignore_eos=True,
        skip_special_tokens=False, min_tokens=2, top_p=0.9, top_k=5, min_p=0.05, seed=7,
        repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.2, stop=["END"],
        include_stop_str_in_output=True, n=2, logprobs=3, priority=3, user="x",
        logit_bias={5: -100.0, 12: 2.5})


def test_completion_defaults_and_prompt_forms() -> None:
    assert parse_completion({"prompt": "x"}, V).params.max_tokens == 16  # OpenAI's default
    # (hints that change nothing here: the prefix cache keys by tokens; one tier)
    assert parse_completion({"prompt": "x", "prompt_cache_key": "k", "service_tier": "default"},
                            V).params == parse_completion({"prompt": "x"}, V).params
    assert parse_completion({"prompt": [1, 2]}, V).prompts == [[1, 2]]
    assert parse_completion({"prompt": [[1], [2, 3]]}, V).prompts == [[1], [2, 3]]
    # (an empty string is the tokenizer stage's to refuse, with its own message)
    for bad_prompt in (None, [], [[]], [1, "a"], 5):
        with pytest.raises(ApiError) as info:
            parse_completion({"prompt": bad_prompt}, V)
        assert info.value.param == "prompt" and info.value.status == 400


def test_chat_fields_and_messages() -> None:
    parsed = parse_chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text",
                                                                        "text": "there"}]}],
        "max_completion_tokens": 5, "max_tokens": 99, "logprobs": True, "top_logprobs": 4}, V)
    (messages,) = parsed.prompts
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"),  # type: ignore
                                                      ("user", "hi there")]
    assert parsed.params.max_tokens == 5 and parsed.params.logprobs == 4
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}, V).params.max_tokens \
        is None
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                      V).params.logprobs == 0


BAD = [
    ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"n": True}, "n"), ({"stop": [1]}, "stop"),
    ({"seed": 1.5}, "seed"), ({"logprobs": 30}, "logprobs"), ({"top_k": -3}, "top_k"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"best_of": 3}, "best_of"),
    ({"echo": 1}, "echo"), ({"suffix": "x"}, "suffix"), ({"logit_bias": {"x": 2}},
                                                           "logit_bias"),
    ({"logit_bias": {"1": 100.5}}, "logit_bias"), ({"logit_bias": {str(V): 1}}, "logit_bias"),
    ({"logit_bias": {"1": "2"}}, "logit_bias"), ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop_token_ids": [V]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
    ({"top_k": 2**70}, "top_k"), ({"max_tokens": 2**64}, "max_tokens"),
    ({"priority": -(2**40)}, "priority"), ({"seed": 2**64}, "seed"),
    ({"prompt": [1, 2**64]}, "prompt"), ({"prompt": [[5], [-1]]}, "prompt"),
    ({"service_tier": "priority"}, "service_tier"), ({"prompt_cache_key": 3}, "prompt_cache_key"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_a_bad_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", **fields}, V)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_errors_name_the_message_field() -> None:
    cases = [({"messages": []}, "messages"),
             ({"messages": [{"role": "user"}]}, "messages[0].content"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages[0].content[0]"),
             ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
              "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
               "top_logprobs": 21}, "top_logprobs")]
    for body, param in cases:
        with pytest.raises(ApiError) as info:
            parse_chat(body, V)
        assert info.value.param == param, body


def test_an_image_in_a_chat_is_refused_by_name() -> None:
    """A multimodal checkpoint (Gemma 3) runs as its language model: an image part is a 400
    that says so, never a request answered as though the image were not there."""
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    with pytest.raises(ApiError) as info:
        parse_chat(body, V)
    assert info.value.status == 400 and info.value.param == "messages[0].content[1]"
    assert "image content part (image_url)" in info.value.message


def test_response_and_chunk_shapes() -> None:
    lp = TokenLogprob(5, -0.5, [5, 6], [-0.5, -1.5], "hi", ["hi", "ho"])
    c = SampleResult(0, "hi", [5], [lp], "stop", "END")
    body = response_json("cmpl-1", "m", False, [c], 3, True)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hi"
    assert body["choices"][0]["logprobs"] == {"tokens": ["hi"], "token_logprobs": [-0.5],
                                              "top_logprobs": [{"hi": -0.5, "ho": -1.5}],
                                              "text_offset": [0]}
    assert body["usage"]["total_tokens"] == 4 and body["choices"][0]["stop_reason"] == "END"
    chat = response_json("chatcmpl-1", "m", True, [c], 3, True)
    (entry,) = chat["choices"][0]["logprobs"]["content"]
    assert entry["bytes"] == [104, 105] and len(entry["top_logprobs"]) == 2
    out = RequestOutput("r", "lo", [6], True, "length", None, 3, 2)
    chunk = chunk_json("chatcmpl-1", "m", True, 1, out, False, 0)
    assert chunk["choices"][0] == {"index": 1, "delta": {"content": "lo"}, "logprobs": None,
                                   "finish_reason": "length", "stop_reason": None}
    role = chunk_json("chatcmpl-1", "m", True, 0, None, False, 0, role=True)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_rate_limiter_bucket_and_concurrency() -> None:
    limiter = RateLimiter(rps=2, concurrent=0)
    assert limiter.acquire("a", now=0.0) is None and limiter.acquire("a", now=0.0) is None
    wait = limiter.acquire("a", now=0.0)
    assert wait == pytest.approx(0.5)
    assert limiter.acquire("b", now=0.0) is None  # identities are separate
    assert limiter.acquire("a", now=0.6) is None
    conc = RateLimiter(rps=0, concurrent=2)
    assert conc.acquire("k") is None and conc.acquire("k") is None
    assert conc.acquire("k") == 1.0
    conc.release("k")
    assert conc.acquire("k") is None


@dataclass
class FakeHealth:
    ok: bool
    problem: str | None
    stats: SchedulerStats | None
    engines_restarting: list[int] = field(default_factory=list)


class FakeClient:
    model_name = "m"
    max_model_len = 64
    status = None

    def __init__(self, health: FakeHealth) -> None:
        self._health = health

    def health(self) -> FakeHealth:
        return self._health


def test_overload_and_outage_answer_503_with_retry_after(tmp_path: Any,
                                                         monkeypatch: Any) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from pipeline.server.app import FrontEnd

    busy = SchedulerStats(*range(7), 5, 1, 6, 0, 0)  # num_waiting = 5, num_slots = 2
    front = FrontEnd(FakeClient(FakeHealth(True, None, busy)),  # type: ignore[arg-type]
                     ServerOptions(max_waiting=5), V)
    refusal = front._refusal()
    assert refusal is not None and refusal.status == 503
    assert refusal.headers["Retry-After"] == "1" and "overloaded" in refusal.message
    front.options = ServerOptions(max_waiting=6)
    assert front._refusal() is None  # under the limit: fine
    front.num_admitted = 8  # this worker already holds its share: 2 slots + 6 waiting places
    refusal = front._refusal()
    assert refusal is not None and "8 requests in this worker" in refusal.message
    front.num_admitted = 7
    assert front._refusal() is None
    front.client = FakeClient(FakeHealth(False, "stage executor:0 is not running", None))  # type: ignore[assignment]
    refusal = front._refusal()
    assert refusal is not None and refusal.status == 503 and "executor:0" in refusal.message
    assert refusal.headers["Retry-After"] == "5"
    front.client = FakeClient(FakeHealth(False, "the engine is restarting", None, [0]))  # type: ignore[assignment]
    refusal = front._refusal()
    assert refusal is not None and refusal.headers["Retry-After"] == "2"  # back in seconds
    assert asyncio.iscoroutinefunction(front.health)


@pytest.mark.parametrize(("kind", "param", "status", "named"), [
    (ErrorKind.INVALID_REQUEST, None, 400, "prompt"),  # the prompt as a whole
    (ErrorKind.INVALID_REQUEST, "max_tokens", 400, "max_tokens"),
    (ErrorKind.UNAVAILABLE, None, 503, None),
    (ErrorKind.INTERNAL, None, 500, None),
])
def test_an_engine_error_is_answered_by_its_kind_not_its_words(
        kind: ErrorKind, param: str | None, status: int, named: str | None) -> None:
    # The same message for every kind: only error_kind and error_param decide the answer.
    out = RequestOutput.refusal("r", kind, "engine unavailable: tokenizer error", param)
    err = output_error(out, "prompt")
    assert (err.status, err.param) == (status, named)


def test_one_request_may_not_queue_more_than_its_share() -> None:
    with pytest.raises(ApiError) as info:
        parse_completion({"model": "m", "prompt": ["a"] * 129}, V)
    assert info.value.param == "prompt" and "at most 128 prompts" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_completion({"model": "m", "prompt": ["a"] * 100, "n": 3}, V)
    assert info.value.param == "n" and "300 sequences" in info.value.message
    assert len(parse_completion({"model": "m", "prompt": ["a"] * 128, "n": 2}, V).prompts) == 128
